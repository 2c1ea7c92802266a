"""The sandbox's settings: per-call resource limits and the sandbox-wide choices (isolation, concurrency).

They arrive as an environment's ``sandbox`` option (``[env.options.sandbox]`` in a run config), so
``SandboxConfig.from_options`` validates a plain mapping and every error names the key it is about
(``sandbox.wall_time_s must be > 0, got -1``). Nothing here runs a process.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

MiB = 1 << 20
Requirement = Literal["bwrap", "rlimits"]
REQUIREMENTS: tuple[str, ...] = ("bwrap", "rlimits")
# Sandboxes of a root daemon run as uid ROOT_UID_BASE + slot: no account needed, far above the ranges
# distributions give people (1000+) and containers' subordinate ids (100000+ per user).
DEFAULT_ROOT_UID_BASE = 1_700_000_000
MAX_UID = (1 << 32) - 2


@dataclass(frozen=True)
class Limits:
    """What one execution may use. Memory, CPU and file size are per process (rlimits).

    ``max_processes`` counts tasks (processes and threads) of the sandbox, the interpreter included,
    so it also bounds how far the per-process limits multiply. ``max_output_bytes`` applies to stdout
    and stderr separately; a stream that exceeds it is truncated with a marker and the run is stopped.
    """

    wall_time_s: float = 10.0
    cpu_time_s: float = 10.0
    memory_bytes: int = 512 * MiB
    max_processes: int = 32
    max_file_bytes: int = 16 * MiB
    max_open_files: int = 256
    max_output_bytes: int = 64 * 1024

    def __post_init__(self) -> None:
        _raise_problems(dataclasses.asdict(self), "limits")

    def replace(self, **changes: Any) -> Limits:
        """A copy with ``changes`` applied (``ValueError`` naming the field when one is bad)."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ValueError(f"limits: unknown field(s) {unknown}")
        return dataclasses.replace(self, **changes)

    def rlimits(self) -> dict[str, tuple[int, int]]:
        """``resource`` constant name -> (soft, hard), as the launcher applies them."""
        cpu = max(1, math.ceil(self.cpu_time_s))
        return {
            # One second between SIGXCPU and SIGKILL: a program that ignores SIGXCPU still stops.
            "RLIMIT_CPU": (cpu, cpu + 1),
            "RLIMIT_AS": (self.memory_bytes, self.memory_bytes),
            "RLIMIT_FSIZE": (self.max_file_bytes, self.max_file_bytes),
            "RLIMIT_NOFILE": (self.max_open_files, self.max_open_files),
            "RLIMIT_CORE": (0, 0),
        }


@dataclass(frozen=True)
class SandboxConfig:
    """Sandbox-wide settings; ``limits`` are the defaults of every call (a call may pass its own).

    ``require``: the least isolation the caller accepts: ``"bwrap"`` (bubblewrap namespaces and
    rlimits) or ``"rlimits"`` (resource limits only; bubblewrap is still used when it works unless
    ``bwrap = ""``). ``bwrap``: the bubblewrap command ("" = never use it). ``python``: the
    interpreter inside the sandbox ("" picks one the sandbox's user can run). ``max_concurrency``:
    executions at once per event loop; later calls wait in a FIFO queue. ``tmp_bytes``: size of the
    private /tmp under bubblewrap. ``root_uid_base``: when rollwise runs as root, sandboxes run as uid
    ``root_uid_base + slot``, never as root.
    """

    require: Requirement = "bwrap"
    bwrap: str = "bwrap"
    python: str = ""
    max_concurrency: int = 16
    tmp_bytes: int = 64 * MiB
    root_uid_base: int = DEFAULT_ROOT_UID_BASE
    limits: Limits = field(default_factory=Limits)

    def __post_init__(self) -> None:
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "limits"}
        _raise_problems(values, "sandbox")
        if not isinstance(self.limits, Limits):
            raise ValueError(f"sandbox.limits must be a Limits, got {type(self.limits).__name__}")

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None) -> SandboxConfig:
        """Validate an env's ``sandbox`` option: any field of this class or of ``Limits``, flat.

        Raises ``ValueError`` naming ``sandbox.<key>`` for an unknown key, a wrong type or a value out
        of bounds (every problem at once).
        """
        if options is None:
            return cls()
        if not isinstance(options, Mapping):
            raise ValueError(f"sandbox must be a table of settings, got {type(options).__name__}")
        limit_names = {f.name for f in dataclasses.fields(Limits)}
        own_names = {f.name for f in dataclasses.fields(cls)} - {"limits"}
        unknown = sorted(set(options) - limit_names - own_names)
        if unknown:
            raise ValueError(
                f"sandbox: unknown setting(s) {unknown}; known: {sorted(own_names | limit_names)}"
            )
        _raise_problems(dict(options), "sandbox")
        limits = Limits(**{k: v for k, v in options.items() if k in limit_names})
        return cls(**{k: v for k, v in options.items() if k in own_names}, limits=limits)


# name -> (integer only, lower bound, upper bound); bounds inclusive, None = unbounded.
_NUMBERS: dict[str, tuple[bool, float, float | None]] = {
    "wall_time_s": (False, 0.05, 86_400.0),
    "cpu_time_s": (False, 0.05, 86_400.0),
    "memory_bytes": (True, 64 * MiB, None),
    "max_processes": (True, 4, 100_000),
    "max_file_bytes": (True, 0, None),
    "max_open_files": (True, 16, 1_048_576),
    "max_output_bytes": (True, 256, 1 << 30),
    "max_concurrency": (True, 1, 4096),
    "tmp_bytes": (True, MiB, None),
    "root_uid_base": (True, 1, MAX_UID - 65_536),
}


def _raise_problems(values: Mapping[str, Any], where: str) -> None:
    problems: list[str] = []
    for key, value in values.items():
        name = f"{where}.{key}"
        if key in _NUMBERS:
            problems.extend(_number_problems(name, value, *_NUMBERS[key]))
        elif key == "require" and value not in REQUIREMENTS:
            problems.append(f'{name} must be "bwrap" or "rlimits", got {value!r}')
        elif key in ("bwrap", "python") and not isinstance(value, str):
            problems.append(f"{name} must be a string (a path or a command name), got {value!r}")
    if values.get("require", "bwrap") == "bwrap" and values.get("bwrap") == "":
        problems.append(f'{where}.require = "bwrap" but {where}.bwrap = "" turns bubblewrap off')
    if problems:
        raise ValueError("; ".join(problems))


def _number_problems(name: str, value: Any, integer: bool, low: float, high: float | None) -> list[str]:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return [f"{name} must be a number, got {value!r}"]
    if integer and not isinstance(value, int):
        return [f"{name} must be an integer, got {value!r}"]
    if not math.isfinite(value) or value < low or (high is not None and value > high):
        bounds = f">= {low:g}" if high is None else f"in [{low:g}, {high:g}]"
        return [f"{name} must be {bounds}, got {value!r}"]
    return []
