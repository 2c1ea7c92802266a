"""Runs inside the sandbox (as ``main.py``) to grade a ``code-tests`` answer: never imported by rollwise.

The working directory holds ``solution.py`` (the model's code) and ``tests.json``::

    {"function": "sum_multiples", "inputs": [[10], [1]], "tag": "<nonce>", "load_s": 2.0, "test_s": 1.0}

The grader executes the solution (its prints go nowhere), then calls ``function(*inputs[i])`` for
every test under a per-test timer and writes one line per event to stdout, each starting with
``tag``::

    <tag>{"load_error": "NameError: ..."}          the solution could not be loaded
    <tag>{"test": 0, "value": "<canonical JSON>"}   what the function returned
    <tag>{"test": 1, "error": "ZeroDivisionError"}  what it raised instead (or "timeout")

The expected values never enter the sandbox: the environment compares outside. A solution that
writes such lines itself can only claim the values it computed, so it gains nothing it did not
solve; one that kills the process loses the tests not yet reported.
"""

from __future__ import annotations

import io
import json
import signal
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from types import FrameType


class _TestTimeout(BaseException):
    """Raised by the timer inside a test that runs too long."""


def _on_alarm(_signum: int, _frame: FrameType | None) -> None:
    raise _TestTimeout


def main() -> None:
    with open("tests.json") as handle:
        spec = json.load(handle)
    tag = spec["tag"]
    out = sys.stdout

    def emit(record: dict[str, object]) -> None:
        out.write(tag + json.dumps(record) + "\n")
        out.flush()

    signal.signal(signal.SIGALRM, _on_alarm)
    sys.stdout = io.StringIO()  # the solution's prints are not the grader's output
    namespace: dict[str, object] = {"__name__": "solution"}
    try:
        signal.setitimer(signal.ITIMER_REAL, spec["load_s"])
        with open("solution.py", "rb") as source:
            exec(compile(source.read(), "solution.py", "exec"), namespace)
        signal.setitimer(signal.ITIMER_REAL, 0)
        function = namespace.get(spec["function"])
        if not callable(function):
            raise NameError(f"the code defines no function named {spec['function']!r}")
    except BaseException as exc:
        signal.setitimer(signal.ITIMER_REAL, 0)
        reason = "timeout while loading" if isinstance(exc, _TestTimeout) else f"{type(exc).__name__}: {exc}"
        emit({"load_error": reason[:300]})
        return
    for index, args in enumerate(spec["inputs"]):
        try:
            signal.setitimer(signal.ITIMER_REAL, spec["test_s"])
            value = function(*args)
            signal.setitimer(signal.ITIMER_REAL, 0)
            emit({"test": index, "value": json.dumps(value, sort_keys=True, separators=(",", ":"))})
        except _TestTimeout:
            emit({"test": index, "error": "timeout"})
        except BaseException as exc:  # SystemExit included: one test's failure is not the run's
            signal.setitimer(signal.ITIMER_REAL, 0)
            emit({"test": index, "error": type(exc).__name__})


if __name__ == "__main__":
    main()
