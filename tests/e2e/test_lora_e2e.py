"""End to end: `rollwise run` with LoRA on guess-number (tiny preset, embedded engine, real learner child),
and the served-policy check failing the daemon when the engine acknowledges updates but keeps its weights
(the embedded engine's documented fault switch, `--fault-stale-weights`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.test_run_e2e import TINY, DaemonRun, checkpoint_state, daemons, tiny_model  # noqa: F401

# An optimizer step moves the tiny policy well past the fp32 tolerance (1e-3), so a stale engine shows.
FAST = ["learner.optim.lr=1e-2", "learner.schedule.warmup_steps=0"]
LORA = ["learner.lora.enabled=true", "learner.lora.rank=4", "learner.lora.alpha=8"]


def _served(run: DaemonRun) -> list[tuple[int, dict[str, object]]]:
    """(version, the one engine's served-check verdict) per sync event."""
    out = []
    for sync in run.snapshot("sync"):
        [verdict] = sync["served_check"].values()
        out.append((int(sync["version"]), verdict))
    return out


@pytest.mark.integration
@pytest.mark.slow
def test_tiny_lora_run_trains_and_its_served_logprobs_follow_the_adapter_versions(
    tmp_path: Path,
    tiny_model: Path,  # noqa: F811
    daemons: list[DaemonRun],  # noqa: F811
) -> None:
    run_dir = tmp_path / "run"
    # With a KL term: its reference is the policy's own model with the adapter off (no second base).
    overrides = [
        *TINY,
        *FAST,
        *LORA,
        "learner.regularizers.kl_coef=0.05",
        f"model.path={json.dumps(str(tiny_model))}",
    ]
    first = DaemonRun(run_dir, overrides, max_steps=3)
    daemons.append(first)
    assert first.wait(timeout_s=180) == 0, first.tail()
    assert first.steps() == [1, 2, 3] and all(s["groups"] > 0 for s in first.snapshot("step"))
    step_log = (run_dir / "logs" / "steps.jsonl").read_text().splitlines()
    kls = [float(json.loads(line)["metrics"]["kl_reference"]) for line in step_log]
    assert kls[0] >= 0.0 and kls[-1] > 1e-6, kls  # the policy moves away from the base it started as
    served = _served(first)
    assert [v for v, _ in served] == [1, 2, 3]
    for version, verdict in served:
        # The engine's log-probs of the probe are the learner's for this version's adapter ...
        assert verdict["status"] == "ok" and float(verdict["diff"]) <= 1e-3, (version, verdict)  # type: ignore[arg-type]
        # ... and not the base model's: the adapter is applied.
        assert float(verdict["base_diff"]) > 1e-2, (version, verdict)  # type: ignore[arg-type]
    assert not first.snapshot("error")
    published = sorted(p.name for p in (run_dir / "weights" / "v3").iterdir())
    assert published == ["adapter_config.json", "adapter_model.safetensors", "rollwise_version.json"]
    assert (run_dir / "checkpoints" / "step3" / "adapter" / "adapter_model.safetensors").is_file()
    engine_log = (run_dir / "logs" / "engine0.log").read_text()
    assert "--enable-lora" in engine_log and "LoRA adapter rollwise-v1 unloaded" in engine_log

    # Resume: the learner restores its adapter; the restarted engine starts on the v3 adapter.
    second = DaemonRun(run_dir, overrides, max_steps=4)
    daemons.append(second)
    assert second.wait(timeout_s=180) == 0, second.tail()
    assert second.steps() == [4]
    [(version, verdict)] = _served(second)
    assert version == 4 and verdict["status"] == "ok"
    assert (
        f"--lora-paths rollwise-v3={run_dir / 'weights' / 'v3'}"
        in (run_dir / "logs" / "engine0.log").read_text()
    )
    assert checkpoint_state(run_dir)["step"] == 4


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full-weights", "lora-adapter"])
def test_an_engine_that_keeps_its_old_weights_fails_the_daemon_loudly(
    lora: bool,
    tmp_path: Path,
    tiny_model: Path,  # noqa: F811
    daemons: list[DaemonRun],  # noqa: F811
) -> None:
    overrides = [
        *TINY,
        *FAST,
        *(LORA if lora else []),
        f"model.path={json.dumps(str(tiny_model))}",
        'engine.extra_args=["--fault-stale-weights"]',
        "async.served_check.max_failures=2",
    ]
    run = DaemonRun(tmp_path / "run", overrides, max_steps=20)
    daemons.append(run)
    assert run.wait(timeout_s=180) == 1, run.tail()
    errors = run.snapshot("error")
    assert [e["kind"] for e in errors] == ["served_policy_mismatch"] * 2
    assert [e["version"] for e in errors] == [1, 2]
    assert all(float(e["diff"]) > 1e-3 for e in errors)
    # The version strings all said the engine had loaded each version.
    assert all(s["ok"] for s in run.snapshot("sync"))
    stderr = run.stderr_path.read_text()
    engine_url = next(iter(run.snapshot("sync")[0]["served_check"]))
    assert f"rollwise: engine engine0 ({engine_url}) does not serve the published policy" in stderr
    assert "2 consecutive served-policy checks failed" in stderr
    assert max(run.steps()) < 20  # it stopped long before run.max_steps
