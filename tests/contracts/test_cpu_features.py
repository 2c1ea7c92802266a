"""Reading the CPU's bf16 support and usable cores (the embedded engine's dtype and thread defaults)."""

from __future__ import annotations

from pathlib import Path

from pipeline.contracts.cpu_features import auto_cpu_dtype, cpu_flags, native_bf16, usable_cores

ZEN4 = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n\n"
SAPPHIRE = "processor\t: 0\nflags\t\t: avx2 avx512f amx_bf16 amx_tile amx_int8\n"
OLD = "processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\nprocessor\t: 1\nflags\t\t: fpu avx512_bf16\n"


def _cpuinfo(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cpuinfo"
    path.write_text(text)
    return path


def test_native_bf16_from_avx512_bf16_or_amx(tmp_path: Path) -> None:
    assert auto_cpu_dtype(_cpuinfo(tmp_path, ZEN4)) == (
        "bfloat16",
        "auto: CPU flags avx512_bf16: native bf16 matmuls",
    )
    native, why = native_bf16(_cpuinfo(tmp_path, SAPPHIRE))
    assert native and "amx_bf16" in why


def test_float32_without_the_flags_or_without_cpuinfo(tmp_path: Path) -> None:
    # Only the first processor's flags are read (all cores of a machine share them).
    assert cpu_flags(_cpuinfo(tmp_path, OLD)) == frozenset({"fpu", "sse2", "avx2", "fma"})
    dtype, why = auto_cpu_dtype(_cpuinfo(tmp_path, OLD))
    assert dtype == "float32" and "none of amx_bf16, avx512_bf16" in why
    dtype, why = auto_cpu_dtype(tmp_path / "missing")
    assert dtype == "float32" and "bf16 support unknown" in why


def test_usable_cores_is_at_least_one() -> None:
    assert usable_cores() >= 1
