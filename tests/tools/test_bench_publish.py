"""`rollwise bench publish`: the learner's own loop, inline against background weight writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.tools.bench import publish_overlap


@pytest.mark.integration
def test_both_modes_train_every_step_and_publish_every_version(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = publish_overlap.main(
        ["--preset", "tiny", "--steps", "3", "--repeats", "1", "--prompt", "8", "--generated", "8", "--json"]
    )
    report = json.loads(capsys.readouterr().out)
    assert code in (0, 1)  # the verdict is timing; the counts below are not
    runs = report["results"]
    assert [r["background"] for r in runs] == [False, True]
    for run in runs:
        assert (run["steps"], run["published"]) == (3, 3)
        assert 0.0 < run["busy_s_per_step"] <= run["seconds_per_step"] * 1.5
    inline, background = (r["seconds_per_step"] for r in runs)
    assert report["ratio"] == pytest.approx(inline / background)
    assert (code == 0) == (report["ratio"] >= publish_overlap.GOAL_RATIO)


def test_fewer_than_two_steps_is_refused() -> None:
    with pytest.raises(SystemExit):
        publish_overlap.main(["--steps", "1"])
