"""The shipped configs load, resolve, and start what they say (the GPU recipe cannot run here)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from pipeline.contracts.config import ConfigError, load_config
from pipeline.supervisor.fleet.engine_launch import engine_argv, plan_engines
from pipeline.supervisor.wiring import bare_run_config, resolve_config

ROOT = Path(__file__).resolve().parents[2]


def _ns(config: Path, overrides: list[str]) -> argparse.Namespace:
    return argparse.Namespace(
        config=str(config), set=overrides, run_dir=None, max_steps=None, log_format=None
    )


def test_qwen3_recipe_resolves_and_starts_sglang_with_its_flags(tmp_path: Path) -> None:
    model = tmp_path / "Qwen3-1.7B"
    model.mkdir()
    (model / "config.json").write_text("{}")  # stands in for the downloaded checkpoint
    setup = resolve_config(
        _ns(ROOT / "examples" / "qwen3_calculator.toml", [f"model.path={json.dumps(str(model))}"])
    )
    cfg = setup.cfg
    assert (cfg.learner.precision, cfg.learner.gradient_checkpointing, cfg.learner.optim.lr) == (
        "bf16-mixed",
        True,
        1e-6,
    )
    assert (cfg.learner.loss.clip_low, cfg.learner.loss.clip_high) == (3e-4, 4e-4)
    assert (cfg.learner.mismatch.proximal, cfg.learner.mismatch.is_weights) == ("learner", "token")
    assert setup.env.spec.name == "calculator" and setup.env.spec.tools
    slot = plan_engines(cfg)[0]
    argv = engine_argv(cfg, slot, model_dir=model, version=0)
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    flags = argv[3:]
    assert flags[flags.index("--model-path") + 1] == str(model)
    assert flags[flags.index("--mem-fraction-static") + 1] == "0.45"
    assert flags[flags.index("--tp-size") + 1] == "1"
    assert flags[flags.index("--dtype") + 1] == "bfloat16"
    assert flags[flags.index("--context-length") + 1] == "8192"
    assert flags[flags.index("--weight-version") + 1] == "0"
    assert "--enable-metrics" in flags and slot.host == "127.0.0.1" and slot.port > 0  # a free port


def test_the_defaults_are_a_pretrained_models_and_the_toy_overrides_them() -> None:
    defaults = resolve_config(_ns(ROOT / "examples" / "guess_number.toml", [])).cfg
    builtin = load_config(None, [])
    assert (builtin.learner.optim.lr, builtin.sampling.max_new_tokens, builtin.env.max_context_tokens) == (
        1e-6,
        1024,
        8192,
    )
    # Run as they are on the tiny preset, episodes are cut at its 1024-token context (check_context_fits).
    resolved = resolve_config(
        argparse.Namespace(config=None, set=[], run_dir=None, max_steps=None, log_format=None)
    ).cfg
    assert resolved.env.max_context_tokens == 1024
    assert (builtin.learner.loss.clip_low, builtin.learner.loss.clip_high) == (3e-4, 4e-4)
    assert (builtin.learner.mismatch.proximal, builtin.learner.mismatch.is_weights) == ("learner", "token")
    assert builtin.learner.precision == "auto"  # bf16-mixed on CUDA, fp32 on a CPU
    assert (defaults.learner.optim.lr, defaults.sampling.max_new_tokens) == (3e-3, 1)
    assert (defaults.learner.mismatch.proximal, defaults.learner.schedule.warmup_steps) == ("engine", 0)
    text = (ROOT / "examples" / "guess_number.toml").read_text()
    for key in ("lr = 3e-3", "warmup_steps = 0", 'proximal = "engine"', "max_new_tokens = 1"):
        # every value that differs from a default carries its reason on the comment lines above it
        before = text.split(key)[0].rstrip().splitlines()[-1]
        assert before.startswith("#"), key


def _bare(**kw: object) -> argparse.Namespace:
    fields: dict[str, object] = {
        "config": None,
        "set": [],
        "run_dir": None,
        "max_steps": None,
        "log_format": None,
    }
    return argparse.Namespace(**{**fields, **kw})


def test_the_bare_run_command_runs_the_cpu_recipe_and_says_so() -> None:
    ns = _bare(max_steps=3)
    notice = bare_run_config(ns)
    assert ns.config == str(ROOT / "examples" / "guess_number.toml")
    assert notice is not None and "examples/guess_number.toml" in notice and "make run" in notice
    cfg = resolve_config(ns).cfg
    # the toy's values, which learn on a CPU, not the pretrained-model defaults
    assert (cfg.model.preset, cfg.learner.optim.lr, cfg.sampling.max_new_tokens) == ("tiny", 3e-3, 1)
    assert cfg.run.max_steps == 3


def test_a_config_or_an_override_keeps_the_bare_recipe_out(tmp_path: Path) -> None:
    with_set = _bare(set=["learner.optim.lr=1e-5"])
    assert bare_run_config(with_set) is None and with_set.config is None
    with_file = _bare(config=str(tmp_path / "mine.toml"))
    assert bare_run_config(with_file) is None and with_file.config == str(tmp_path / "mine.toml")


def test_the_bare_run_command_without_the_recipe_on_disk_names_what_to_pass(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"is not installed: pass --config FILE, or --set"):
        bare_run_config(_bare(), recipe=tmp_path / "missing.toml")


@pytest.mark.parametrize(
    ("name", "attempts", "digits", "every", "tasks"),
    [("smollm2_arithmetic.toml", 1, 1, 1, 32), ("smollm2_arithmetic_retry.toml", 3, 2, 4, 64)],
)
def test_the_smollm2_recipes_resolve_to_the_pretrained_preset_on_reasoning_gym(
    name: str, attempts: int, digits: int, every: int, tasks: int
) -> None:
    pytest.importorskip(
        "reasoning_gym", reason="reasoning-gym is not installed (pip install 'rollwise[reasoning-gym]')"
    )
    setup = resolve_config(_ns(ROOT / "examples" / name, []))
    cfg = setup.cfg
    assert (cfg.model.preset, cfg.env.name) == ("smollm2-135m-instruct", "reasoning-gym/basic_arithmetic")
    assert setup.env.spec.max_turns == attempts
    assert cfg.env.options["answer_format"] == "number"
    assert cfg.env.options["config"]["max_digits"] == digits
    assert cfg.learner.lora.enabled and cfg.eval.every_versions == every and cfg.eval.tasks == tasks
    assert cfg.eval.max_engine_share == 0.10 and cfg.engine.threads == cfg.learner.threads == 1
    text = (ROOT / "examples" / name).read_text()
    for key in ('preset = "smollm2-135m-instruct"', "lr = 1e-4", "tolerance = 0.15", "threads = 1"):
        # every value that differs from a default carries its reason on the comment line above it
        before = text.split(key)[0].rstrip().splitlines()[-1]
        assert before.startswith("#"), (name, key)


def test_agent_workers_need_an_importable_agent_function(tmp_path: Path) -> None:
    react = ROOT / "examples" / "react_agent.toml"
    run_dir = f"run.run_dir={json.dumps(str(tmp_path / 'run'))}"
    setup = resolve_config(_ns(react, [run_dir, "env.agent_workers=2"]))
    assert setup.cfg.env.agent_workers == 2
    with pytest.raises(ConfigError, match=r"env\.agent_workers"):
        resolve_config(_ns(ROOT / "examples" / "guess_number.toml", [run_dir, "env.agent_workers=1"]))


def test_a_tree_rollout_needs_an_environment_that_forks(tmp_path: Path) -> None:
    run_dir = f"run.run_dir={json.dumps(str(tmp_path / 'run'))}"
    guess = ROOT / "examples" / "guess_number.toml"
    assert resolve_config(_ns(guess, [run_dir, "rollout.branch_turn=1"])).cfg.rollout.branch_turn == 1
    with pytest.raises(
        ConfigError, match=r"rollout\.branch_turn: .*calculator is an environment without fork"
    ):
        resolve_config(_ns(guess, [run_dir, "rollout.branch_turn=1", "env.name='calculator'"]))
    react = ROOT / "examples" / "react_agent.toml"
    with pytest.raises(ConfigError, match=r"rollout\.branch_turn: .* is an agent environment"):
        resolve_config(_ns(react, [run_dir, "rollout.branch_turn=2"]))
