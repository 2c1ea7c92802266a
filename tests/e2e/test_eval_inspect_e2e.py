"""End to end: a real daemon evaluates held-out tasks while it trains, writes the learner's trace, and the
run it leaves is what `rollwise inspect` and `rollwise eval` read."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from pipeline.contracts.schema import batch_to_segments
from pipeline.supervisor.eval_schedule import read_eval_log
from pipeline.tools.inspect.trajectories import GroupFilter, RunView
from pipeline.transport.spool import read_group_file
from tests.e2e.test_run_e2e import TINY, DaemonRun


@pytest.mark.integration
@pytest.mark.slow
def test_daemon_evaluates_traces_and_leaves_a_run_the_inspector_and_eval_read(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    overrides = [
        *TINY,
        f"model.path={json.dumps(str(tiny_model_dir))}",
        "learner.checkpoint_every=100",  # keep every spool file for the checks below
        "eval.every_versions=2",
        "eval.max_engine_share=1.0",  # every 2 versions, whatever it costs: no budget spacing them out
        "eval.tasks=4",
        "eval.samples=2",
        "trace.groups_per_step=1",
    ]
    daemon = DaemonRun(run_dir, overrides, max_steps=5)
    try:
        assert daemon.wait(timeout_s=240) == 0, daemon.tail()
    finally:
        if daemon.proc.poll() is None:
            daemon.proc.kill()

    # Held-out evaluation: the start version, then every 2 versions while no evaluation runs.
    rows = read_eval_log(run_dir / "logs" / "eval.jsonl")
    versions = [r["version"] for r in rows]
    assert versions[0] == 0 and len(rows) >= 2 and all(b - a >= 2 for a, b in itertools.pairwise(versions))
    for row in rows:
        assert row["greedy"]["episodes"] == 4 and row["sampled"]["episodes"] == 8 and row["sampled"]["k"] == 2
    assert [e["version"] for e in daemon.snapshot("eval")] == versions  # the status view's eval lines

    # Eval episodes never enter the spool: every spool row belongs to a scheduler group.
    spool_rows = []
    for path in sorted((run_dir / "spool").glob("g*.arrow")):
        _, batch = read_group_file(path)
        spool_rows += batch_to_segments(batch)[0]
    assert spool_rows and not [r.episode_id for r in spool_rows if "eval" in r.episode_id]
    assert all(r.group_id.split("-g")[0] == spool_rows[0].group_id.split("-g")[0] for r in spool_rows)

    # The learner traced one group per step; the inspector shows it with its token values.
    assert len(list((run_dir / "trace").glob("s*.arrow"))) == 5
    view = RunView(run_dir, AutoTokenizer.from_pretrained(tiny_model_dir))
    listing = view.list_groups(GroupFilter(traced=True))
    assert listing["matched"] >= 1 and all(g["trained_step"] is not None for g in listing["groups"])
    detail = view.group_detail(listing["groups"][0]["group_id"])
    assert detail is not None
    generated = [
        t for ep in detail["episodes"] for b in ep["blocks"] if b["role"] == "model" for t in b["tokens"]
    ]
    assert generated and all(
        {"logprob", "learner_logprob", "advantage", "clip"} <= t.keys() for t in generated
    )
    assert all(t["logprob"] <= 0.0 and t["clip"] in (0, 1, 2) for t in generated)

    # `rollwise eval` scores the newest published version of the finished run.
    from pipeline.tools.offline_eval import main as eval_main

    assert eval_main(["--run-dir", str(run_dir), "--tasks", "2", "--greedy", "--json"]) == 0
    offline = json.loads(capsys.readouterr().out)
    assert offline["version"] == 5 and offline["greedy"]["versions"] == [5, 5]
