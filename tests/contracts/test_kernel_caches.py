"""The oneDNN kernel caches are bounded: the variables are set unless the user set them, and on this CPU's
bf16 path the bound holds the memory new shapes would otherwise take."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pipeline.contracts.kernel_caches import CACHE_VARIABLES, DEFAULT_CAPACITY, bound_kernel_caches


def test_each_unset_variable_gets_the_bound_and_a_users_value_wins() -> None:
    env = {"LRU_CACHE_CAPACITY": "2048"}
    assert bound_kernel_caches(environ=env) == {
        "LRU_CACHE_CAPACITY": "2048",
        "ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(DEFAULT_CAPACITY),
    }
    assert env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(DEFAULT_CAPACITY)
    with pytest.raises(ValueError, match="capacity must be >= 1, got 0"):
        bound_kernel_caches(0, environ={})


# A bf16 linear at `SHAPES` new row counts (as prefills of ever new widths): malloc'd bytes gained.
_CHILD = """
import ctypes, json, sys, torch
from pipeline.contracts.kernel_caches import bound_kernel_caches
if sys.argv[1] != "default":
    bound_kernel_caches(int(sys.argv[1]))
torch.set_num_threads(1)
libc = ctypes.CDLL("libc.so.6")
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = Info
weight = torch.randn(512, 256, dtype=torch.bfloat16)
with torch.inference_mode():
    before = libc.mallinfo2().uordblks
    for rows in range(1, 301):
        torch.randn(rows, 256, dtype=torch.bfloat16) @ weight.t()
    print(json.dumps((libc.mallinfo2().uordblks - before) / 2**20))
"""


def _growth_mib(capacity: str) -> float:
    env_free = {k: v for k, v in __import__("os").environ.items() if k not in CACHE_VARIABLES}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, capacity], capture_output=True, text=True, timeout=120, env=env_free
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return float(json.loads(out.stdout.strip().splitlines()[-1]))


def test_bounded_caches_hold_the_memory_that_new_bf16_shapes_take() -> None:
    unbounded = _growth_mib("default")
    if unbounded < 50:
        pytest.skip(f"bf16 matmuls here do not cache per shape ({unbounded:.0f} MiB over 300 shapes)")
    bounded = _growth_mib("16")
    # Measured on this machine: ~165 MiB unbounded, ~10 MiB at 16 entries.
    assert bounded < 30 and bounded < unbounded / 4, (bounded, unbounded)
