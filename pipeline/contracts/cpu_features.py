"""What the CPU offers the embedded engine: native bf16 matmuls, and how many cores this process may use.

Torch-free (read from /proc/cpuinfo and the scheduler's affinity mask), so the supervisor can predict the
dtype an embedded engine picks (its served-policy check's tolerance follows it) without importing torch.
"""

from __future__ import annotations

import os
from pathlib import Path

# CPU flags (Linux /proc/cpuinfo) of instructions that multiply bf16 matrices natively: Intel AMX
# (Sapphire Rapids and later) and AVX512-BF16 (Cooper Lake, AMD Zen 4 and later). oneDNN, behind torch's
# CPU matmuls, uses them; without them bf16 is emulated and slower than fp32.
BF16_FLAGS = ("amx_bf16", "avx512_bf16")
CPUINFO = Path("/proc/cpuinfo")


def cpu_flags(cpuinfo: Path = CPUINFO) -> frozenset[str]:
    """The first processor's flags; empty when the file is unreadable (not Linux)."""
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def native_bf16(cpuinfo: Path = CPUINFO) -> tuple[bool, str]:
    """(whether bf16 matmuls are native on this CPU, the reason in words)."""
    flags = cpu_flags(cpuinfo)
    found = [flag for flag in BF16_FLAGS if flag in flags]
    if found:
        return True, f"CPU flags {', '.join(found)}: native bf16 matmuls"
    if not flags:
        return False, f"no CPU flags readable from {cpuinfo}: bf16 support unknown"
    return False, f"CPU has none of {', '.join(BF16_FLAGS)}: bf16 would be emulated"


def auto_cpu_dtype(cpuinfo: Path = CPUINFO) -> tuple[str, str]:
    """The embedded engine's dtype on a CPU when none is configured: bfloat16 where bf16 matmuls are
    native, float32 otherwise; with the reason."""
    native, why = native_bf16(cpuinfo)
    return ("bfloat16" if native else "float32"), f"auto: {why}"


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask; os.cpu_count where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
