"""`rollwise bench hosts`' scenario loop on a scripted fleet: a clock that moves only when the loop waits
for steps, so every window it reports can be computed by hand."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeline.tools.hosts import hostile_network


@dataclass
class _Route:
    dropped: int = 0
    resets: int = 0


@dataclass
class _Proxy:
    routes: dict[str, _Route] = field(default_factory=lambda: {"weights": _Route()})
    faults: list[str] = field(default_factory=list)

    def set(self, route: str | None, **fault: Any) -> None:
        self.faults.append(f"{route}:{sorted(fault)}")

    def clear(self) -> None:
        self.faults.append("clear")


@dataclass
class _Net:
    def cut(self, host: str) -> None:
        raise AssertionError("the test runs no partition")

    def mend(self, host: str) -> None:
        pass


class _ScriptedFleet:
    """Steps every `step_s` seconds of a clock that advances only inside `wait_steps`, which returns half
    a second after the last step it waited for (the real one polls)."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.clock = 0.0
        self.times: list[float] = []
        self.waited: list[int] = []
        self.proxy = _Proxy()
        self.net = _Net()

    def now(self) -> float:
        return self.clock

    def steps(self) -> list[tuple[float, int]]:
        return [(t, i + 1) for i, t in enumerate(self.times)]

    def snapshot(self, kind: str | None = None) -> list[tuple[float, dict[str, Any]]]:
        return []

    def wait_steps(self, n: int, timeout_s: float) -> None:
        self.waited.append(n)
        for k in range(1, n + 1):
            self.times.append(self.clock + k * self.step_s)
        self.clock = self.times[-1] + 0.5


def test_the_steps_after_a_fault_are_the_calm_steps_of_the_next() -> None:
    fleet = _ScriptedFleet(step_s=2.0)
    args = hostile_network.parse(["--steps", "3"])
    outcomes = hostile_network.run_scenarios(fleet, ["latency", "throttle"], args)  # type: ignore[arg-type]
    # First fault: 4 calm steps (3 intervals) at 2-8 s, 3 under the fault (8.5-15 s), 3 after it at 17, 19
    # and 21 s. Second fault: those 3 topped up by one (23.5 s) to 3 intervals: (23.5 - 17) / 3.
    assert fleet.waited == [4, 3, 3, 1, 3, 3]
    assert [o.steps_during for o in outcomes] == [3, 3]
    assert [o.s_per_step_calm for o in outcomes] == [2.0, 2.17]
    assert [o.fault_s for o in outcomes] == [6.5, 6.5]
    assert [o.resume_s for o in outcomes] == [2.0, 2.0]
    assert fleet.proxy.faults == ["None:['latency_s']", "clear", "weights:['rate_bps']", "clear"]


def test_calm_steps_before_the_first_fault_are_counted_from_the_start() -> None:
    fleet = _ScriptedFleet(step_s=1.5)
    fleet.wait_steps(6, timeout_s=1.0)  # the run has already stepped
    args = hostile_network.parse(["--steps", "3"])
    outcome, resumed = hostile_network.run_scenario(fleet, "drops", args)  # type: ignore[arg-type]
    assert fleet.waited == [6, 3, 3]  # no wait for calm steps: six are there (1.5-9 s)
    assert outcome.s_per_step_calm == 1.5 and outcome.fault_s == 5.0  # from 9.5 s to 14.5 s
    assert resumed == 16.0
