"""Every variant of the learner's step reproduces its captured parity fixture (capture_trainer.py): the
same backpropagated losses, gradients, parameters after the step, metrics and trace.

Bit for bit (torch.equal, equal digests, equal floats) when the CPU and torch version are the capture's;
elsewhere float reductions may round differently, so values are compared with rtol 1e-5 and the
digests are not compared (the failure message says which mode ran)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.learner.parity.capture_trainer import VARIANTS, fingerprint, load_fixtures, run_variant

pytestmark = pytest.mark.usefixtures("one_torch_thread")

RTOL = 1e-5
_FIXTURES, _TENSORS = load_fixtures()
EXACT = _FIXTURES["fingerprint"] == fingerprint()
MODE = (
    "exact (same CPU and torch as the capture)"
    if EXACT
    else f"rtol {RTOL}: captured on {_FIXTURES['fingerprint']}, running on {fingerprint()}"
)


def _same(got: Any, want: Any) -> bool:
    if isinstance(want, float) and isinstance(got, float):
        if math.isnan(want) or math.isnan(got):
            return math.isnan(want) and math.isnan(got)
        return got == want if EXACT else math.isclose(got, want, rel_tol=RTOL, abs_tol=1e-9)
    if isinstance(want, list) and isinstance(got, list):
        return len(got) == len(want) and all(_same(g, w) for g, w in zip(got, want, strict=True))
    if isinstance(want, dict) and isinstance(got, dict):
        return got.keys() == want.keys() and all(_same(got[k], want[k]) for k in want)
    return bool(got == want)


def test_the_fixtures_cover_every_variant_and_stay_small() -> None:
    assert set(_FIXTURES["variants"]) == set(VARIANTS)
    folder = Path(__file__).parent / "fixtures"
    assert sum(f.stat().st_size for f in folder.iterdir()) < 2_000_000


@pytest.mark.parametrize("name", list(VARIANTS))
def test_a_step_reproduces_its_capture(name: str, tiny_model_dir: Path, moe_tiny_model_dir: Path) -> None:
    record, tensors = run_variant(VARIANTS[name], {"tiny": tiny_model_dir, "moe-tiny": moe_tiny_model_dir})
    want = _FIXTURES["variants"][name]
    for key in ("losses", "metrics", "trace"):
        assert _same(record[key], want[key]), f"{name}: {key} differ ({MODE})\n{record[key]}\n{want[key]}"
    if EXACT:
        assert record["grad_digests"] == want["grad_digests"], f"{name}: gradients differ ({MODE})"
        assert record["param_digest"] == want["param_digest"], f"{name}: parameters differ ({MODE})"
    assert len(record["grad_digests"]) == len(want["grad_digests"])
    saved = {key.partition("/")[2]: value for key, value in _TENSORS.items() if key.startswith(f"{name}/")}
    assert saved.keys() == tensors.keys()
    for key, value in saved.items():
        if EXACT:
            assert torch.equal(tensors[key], value), f"{name}: {key} differs ({MODE})"
        else:
            torch.testing.assert_close(
                tensors[key], value, rtol=RTOL, atol=1e-9, msg=f"{name}: {key} ({MODE})"
            )
