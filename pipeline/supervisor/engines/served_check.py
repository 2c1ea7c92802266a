"""The served-policy check: after every weight sync, prove that each engine serves the new policy.

With each published version the learner sends a probe (learner.served_probe): token ids with its
log-probs under the new and the previous weights. After the sync every engine scores the same ids
(`/generate`, `max_new_tokens = 0`, `return_logprob`, `logprob_start_len = 0`; with LoRA adapters, naming
the new one). With d_new = mean |engine - new|, d_prev = mean |engine - previous|, gap = mean |new -
previous| and the engine's numerical floor, the engine serves the new version when

    d_new <= tolerance                      within the dtype's tolerance of the new version, or
    gap <= floor / 2                        the versions cannot be told apart on this engine, or
    gap <= floor and d_new <= floor + gap   which of d_new and d_prev is smaller is noise there, or
    d_new < d_prev                          closer to the new version than to the old one.

The floor is calibrated once per engine (`calibrate`, before its first sync): its distance to the version
it was launched with. An engine that kept the old weights sits at its floor from the previous version and
further from the new one, so it fails. Without previous log-probs only the tolerance applies:

    float32 engine   1e-3 nats   the same fp32 maths in other orders and batch shapes
    bfloat16 engine  5e-2 nats   bf16 log-probs land ~0.01-0.03 from fp32 (docs/scale_out.md)

Verdicts per engine: `ok`, `mismatch` (the rule fails, or the engine refused the request) or `error`
(unreachable: a restart reloads it). Each mismatch is an error event and a metric; `max_failures`
consecutive mismatches of one engine stop the daemon naming it; a passing check resets the count.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from pipeline.contracts.config import Config
from pipeline.contracts.cpu_features import auto_cpu_dtype
from pipeline.supervisor.engines.pool import EnginePool
from pipeline.supervisor.engines.protocol import EngineHTTPError, EngineProtocolError
from pipeline.supervisor.observability import metrics

log = logging.getLogger("rollwise.served_check")

Status = Literal["ok", "mismatch", "error"]
TOLERANCE_FP32 = 1e-3
TOLERANCE_BF16 = 5e-2


def tolerance_for(cfg: Config) -> float:
    """`async.served_check.tolerance`, or the default of the engines' dtype (module docstring)."""
    configured = cfg.async_.served_check.tolerance
    if configured is not None:
        return configured
    dtype: str | None = cfg.engine.dtype
    if dtype is None:  # an embedded engine's follows this machine's CPU; SGLang is launched in bf16
        dtype = auto_cpu_dtype()[0] if cfg.engine.kind == "embedded" else "bfloat16"
    return TOLERANCE_FP32 if dtype == "float32" else TOLERANCE_BF16


def mean_abs_diff(a: Sequence[float], b: Sequence[float]) -> float:
    if len(a) != len(b) or not a:
        raise ValueError(f"log-prob lists must be non-empty and equally long, got {len(a)} and {len(b)}")
    return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / len(a)


@dataclass(frozen=True)
class Probe:
    """Token ids and the learner's log P(ids[i + 1] | ids[: i + 1]) of the published weights, and of the
    previously published ones (`previous`; None from an older learner)."""

    input_ids: list[int]
    logprobs: list[float]
    previous: list[float] | None = None

    def __post_init__(self) -> None:
        if len(self.input_ids) < 2 or len(self.logprobs) != len(self.input_ids) - 1:
            raise ValueError(
                f"a probe needs >= 2 ids and one log-prob per id after the first, got "
                f"{len(self.input_ids)} ids and {len(self.logprobs)} log-probs"
            )
        if self.previous is not None and len(self.previous) != len(self.logprobs):
            raise ValueError(
                f"the previous version's probe log-probs have {len(self.previous)} entries, the new "
                f"version's {len(self.logprobs)}"
            )


def judge(
    engine: Sequence[float], probe: Probe, tolerance: float, floor: float | None = None
) -> tuple[Status, float, str]:
    """Does an engine whose probe log-probs are `engine`, numerical floor `floor` (None: not calibrated),
    serve the probe's new version? (status, d_new, why), by the rule of the module docstring."""
    d_new = mean_abs_diff(engine, probe.logprobs)
    if d_new <= tolerance:
        return "ok", d_new, f"mean |engine - new| {d_new:.4g} <= tolerance {tolerance:g}"
    if probe.previous is None:
        return "mismatch", d_new, f"mean |engine - learner| log-prob {d_new:.4g} > {tolerance:g}"
    d_prev = mean_abs_diff(engine, probe.previous)
    gap = mean_abs_diff(probe.logprobs, probe.previous)
    distances = (
        f"mean |engine - new| {d_new:.4g}, |engine - previous| {d_prev:.4g}, |new - previous| {gap:.4g}"
        + (f", floor {floor:.4g}" if floor is not None else "")
    )
    if floor is not None and gap <= floor / 2:
        return "ok", d_new, f"the versions differ by less than half the engine's floor ({distances})"
    if floor is not None and gap <= floor and d_new <= floor + gap:
        return "ok", d_new, f"within the engine's floor plus the versions' gap of the new one ({distances})"
    if d_new < d_prev:
        return "ok", d_new, f"closer to the new version than to the previous one ({distances})"
    return "mismatch", d_new, f"closer to the previous version than to the new one ({distances})"


@dataclass(frozen=True)
class Verdict:
    """One engine's answer for one version. `diff` = mean |engine - learner| (None without an answer);
    `base_diff` = mean |engine with the adapter - engine without| (adapters only: how far the served
    adapter moved the policy, so a check that passes also shows the adapter is applied)."""

    engine: str
    version: int
    status: Status
    diff: float | None
    detail: str = ""
    base_diff: float | None = None


class ServedPolicyCheck:
    """Runs the check after each sync and keeps each engine's consecutive mismatches."""

    def __init__(
        self,
        pool: EnginePool,
        *,
        tolerance: float,
        max_failures: int,
        fail: Callable[[str], None],
        names: dict[str, str] | None = None,
    ) -> None:
        if not tolerance > 0 or max_failures < 1:
            raise ValueError(f"need tolerance > 0 and max_failures >= 1, got {tolerance}, {max_failures}")
        self.pool = pool
        self.tolerance = tolerance
        self.max_failures = max_failures
        self.fail = fail
        self.names = names or {}  # engine URL -> the daemon's name for it (engine0, ...), for messages
        self.consecutive: dict[str, int] = {}
        self.floors: dict[str, float] = {}  # engine URL -> mean |engine - learner| on the version it served
        for client in pool.members:
            self.consecutive[client.base_url] = 0
            for status in ("ok", "mismatch", "error"):
                metrics.SERVED_CHECKS.labels(engine=client.base_url, result=status)
            metrics.SERVED_CHECK_FAILURES.labels(engine=client.base_url).set(0)
            metrics.SERVED_LOGPROB_DIFF.labels(engine=client.base_url).set(0)

    async def calibrate(self, version: int, probe: Probe, *, lora_path: str | None = None) -> None:
        """Before a sync: the numerical floor of every engine without one, from the version it serves
        now (`version`, whose log-probs are the probe's `previous`). Engines that do not answer are
        calibrated at a later sync."""
        if probe.previous is None or all(c.base_url in self.floors for c in self.pool.members):
            return
        rid = f"served-floor-v{version}"
        for outcome in await self.pool.prompt_logprobs_all(probe.input_ids, rid=rid, lora_path=lora_path):
            if outcome.value is not None and outcome.url not in self.floors:
                floor = mean_abs_diff(outcome.value, probe.previous)
                self.floors[outcome.url] = floor
                log.info(
                    "engine %s: numerical floor %.4g nats per token against the learner", outcome.url, floor
                )

    async def run(self, version: int, probe: Probe, *, lora_path: str | None = None) -> list[Verdict]:
        """Ask every engine for the probe's log-probs (naming `lora_path` if given), judge, record."""
        rid = f"served-check-v{version}"
        outcomes = await self.pool.prompt_logprobs_all(probe.input_ids, rid=rid, lora_path=lora_path)
        base: dict[str, list[float]] = {}
        if lora_path is not None:
            for outcome in await self.pool.prompt_logprobs_all(probe.input_ids, rid=f"{rid}-base"):
                if outcome.value is not None:
                    base[outcome.url] = outcome.value
        verdicts = []
        for outcome in outcomes:
            if outcome.value is not None:
                status, diff, why = judge(outcome.value, probe, self.tolerance, self.floors.get(outcome.url))
                detail = "" if status == "ok" else why
                moved = base.get(outcome.url)
                base_diff = mean_abs_diff(outcome.value, moved) if moved is not None else None
                verdicts.append(Verdict(outcome.url, version, status, diff, detail, base_diff))
            elif isinstance(outcome.error, (EngineHTTPError, EngineProtocolError)) and not (
                isinstance(outcome.error, EngineHTTPError) and outcome.error.status >= 500
            ):
                # It answered, but not with this version's log-probs (e.g. the adapter is not loaded).
                verdicts.append(Verdict(outcome.url, version, "mismatch", None, f"refused: {outcome.error}"))
            else:
                verdicts.append(Verdict(outcome.url, version, "error", None, f"no answer: {outcome.error}"))
        for verdict in verdicts:
            self._record(verdict)
        return verdicts

    def _record(self, v: Verdict) -> None:
        metrics.SERVED_CHECKS.labels(engine=v.engine, result=v.status).inc()
        if v.diff is not None:
            metrics.SERVED_LOGPROB_DIFF.labels(engine=v.engine).set(v.diff)
        if v.status == "error":
            log.warning("served-policy check of version %d on %s: %s", v.version, v.engine, v.detail)
            return
        count = self.consecutive.get(v.engine, 0) + 1 if v.status == "mismatch" else 0
        self.consecutive[v.engine] = count
        metrics.SERVED_CHECK_FAILURES.labels(engine=v.engine).set(count)
        if v.status == "ok":
            return
        log.error(
            "engine %s does not serve policy version %d (%d in a row): %s",
            v.engine,
            v.version,
            count,
            v.detail,
        )
        if count >= self.max_failures:
            name = f"{self.names[v.engine]} ({v.engine})" if v.engine in self.names else v.engine
            self.fail(
                f"engine {name} does not serve the published policy: {count} consecutive served-policy "
                f"checks failed (last: version {v.version}, {v.detail}); it acknowledged the updates but "
                "its log-probs are another policy's. See docs/scale_out.md, served-policy check."
            )
