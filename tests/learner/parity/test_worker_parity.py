"""The learner process publishes and resumes as it did when fixtures/worker_parity.json was captured
(tests/learner/parity/capture_worker.py): every publish path writes the same files, the inline and the
background publisher write identical ones, and a one-process and a sharded checkpoint each resume to the
same next step.

Exact (bytes, metrics, parameter hashes) on the fingerprint the fixture was captured on (torch version and
CPU); elsewhere file names and sizes are exact and numbers agree within rel 1e-5 (float summation order
may differ between CPU kernels).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.learner.parity.capture_worker import FIXTURE, RESUMED, VARIANTS, capture, fingerprint

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # its module fixture runs the learner

REL, ABS = 1e-5, 1e-7


@pytest.fixture(scope="module")
def captured() -> dict[str, Any]:
    record: dict[str, Any] = json.loads(FIXTURE.read_text())
    return record


@pytest.fixture(scope="module")
def now(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return capture(tmp_path_factory.mktemp("worker-parity"))


@pytest.fixture(scope="module")
def exact(captured: dict[str, Any]) -> bool:
    return bool(captured["fingerprint"] == fingerprint())


def _sizes(files: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, int]]:
    return {v: {name: f["size"] for name, f in by_name.items()} for v, by_name in files.items()}


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float):
        return bool(a == pytest.approx(b, rel=REL, abs=ABS))
    return bool(a == b)


def test_inline_and_background_publishers_write_identical_files(now: dict[str, Any]) -> None:
    inline, background = now["variants"]["full_inline"], now["variants"]["full_background"]
    assert background["files"] == inline["files"]
    assert background["published"] == inline["published"]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_each_publish_path_writes_the_captured_files(
    now: dict[str, Any], captured: dict[str, Any], exact: bool, variant: str
) -> None:
    got, want = now["variants"][variant], captured["variants"][variant]
    if exact:
        assert got["files"] == want["files"]
        assert got["published"] == want["published"]
    else:
        assert _sizes(got["files"]) == _sizes(want["files"])
        assert _close(got["published"], want["published"])


@pytest.mark.parametrize("variant", RESUMED)
def test_a_checkpoint_resumes_to_the_captured_next_step(
    now: dict[str, Any], captured: dict[str, Any], exact: bool, variant: str
) -> None:
    got, want = now["variants"][variant]["resume"], captured["variants"][variant]["resume"]
    assert got["ready"] == want["ready"]
    counts = ("step", "version", "groups", "group_ids", "consumed_seq")
    assert {k: got["step"][k] for k in counts} == {k: want["step"][k] for k in counts}
    if exact:
        assert got["step"]["metrics"] == want["step"]["metrics"]
        assert got["params"]["sha256"] == want["params"]["sha256"]
        assert got["published"] == want["published"]
    else:
        assert _close(got["step"]["metrics"], want["step"]["metrics"])
        assert _close(got["params"]["sums"], want["params"]["sums"])
        assert _close(got["published"], want["published"])


def test_the_fixture_covers_every_variant(captured: dict[str, Any]) -> None:
    assert set(captured["variants"]) == set(VARIANTS)
    for name in RESUMED:
        assert captured["variants"][name]["resume"]["step"]["step"] == 3
    assert Path(FIXTURE).is_file()
