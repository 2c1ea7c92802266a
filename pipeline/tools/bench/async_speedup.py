"""`rollwise bench async`: learner steps/hour with staleness η = 2 versus synchronous η = 0.

What is real and what is modelled:
- real: GroupScheduler, AdmissionController, SpoolWriter/SpoolReader, run_group (the multi-turn runner with
  its chat buffer), EnginePool/EngineClient over HTTP on 127.0.0.1, sync_weights;
- modelled engine: the SGLang fake (pipeline.tools.fake_sglang, the one the tests hold rollwise's client
  to) with its GPU-like latency model: response lengths lognormal (long tail, capped by max_new_tokens),
  `prefill_s` + `per_token_s` per token via asyncio.sleep (no CPU, independent of how many requests run
  at once: an engine far from saturation). Pausing in place freezes decoding; tokens decoded after an
  update carry the new version (the embedded engine's per-token version extension);
- modelled learner: a step is `step_s` of asyncio.sleep consuming B groups; then it publishes the
  version and goes on with its next step while the supervisor syncs the engines (pause -> update with
  `load_s` of sleep -> continue), one sync at a time, skipping a version a newer one overtook, and
  tells admission the served version when a sync completes: as the daemon does (learner.process
  publishes and trains on; pipeline.supervisor.lineage syncs); it reads up to 2·B groups ahead (their
  trainable rows: a cut episode's are the scheduler's waste) and takes them earliest staleness deadline
  first, as learner.process does; groups older than v − η are dropped.

Both runs use the same seeds and parameters; only η differs. Reported per η: learner steps/hour,
learner idle fraction (waiting for B groups), engine idle fraction (no request in the server), actor
idle fraction (admission held work back because of staleness), mean token staleness of trained
groups, groups dropped as stale (by the modelled learner, or in flight by the scheduler once the
learner passed their bound: in_flight_drops), and groups cut at their last chance
(async.cut_late_groups; after each modelled step the scheduler hears the version and the groups
consumed, as from the learner's step event). Then the
limit (pipeline.tools.bench.bounds): which resource binds, its bound in steps/hour, the efficiency
(achieved over the bound), and the generated tokens never trained by cause (pipeline.contracts.waste:
the modelled learner's stale drops, the scheduler's cut, failed and lost episodes). Last, the engine as it
delivered (pipeline.tools.bench.delivered_latency: seconds per token and per request, syncs): on a busy
host the fake is slower than its latency model, and `--model` given these figures predicts the run.

`--model` runs nothing: it prints the staleness model's prediction (pipeline.tools.bench.staleness_model,
a discrete-event model of this bench in simulated time) for the same parameters and each η from 0 to
--eta, pooled over --runs simulated runs, in about a second; `--write-ms` is the model's only parameter
the bench has no flag for (the bench's spool writes take what they take).

Where the speed-up ends: with η > 0 the learner is never idle once generation keeps up, so steps/hour
cannot exceed 3600 / step_s, and the speed-up cannot exceed (the η = 0 step time) / step_s: the time
η = 0 spends waiting for generation and syncs is all that overlapping can win.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import math
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from envs.api import Action, Environment, EnvSpec, Message, StepResult, Task
from pipeline.contracts.schema import batch_to_segments
from pipeline.contracts.staleness import deadline_key, is_stale
from pipeline.contracts.waste import STALE, WASTE_CAUSES
from pipeline.supervisor.actors.admission import AdmissionController
from pipeline.supervisor.actors.rollout import RolloutSettings
from pipeline.supervisor.actors.scheduler import GroupRecipe, GroupScheduler, Pacing
from pipeline.supervisor.engines.client import EngineClient
from pipeline.supervisor.engines.pool import EnginePool
from pipeline.supervisor.engines.protocol import SamplingParams
from pipeline.supervisor.engines.weightsync import sync_weights
from pipeline.supervisor.observability.learner_metrics import token_books
from pipeline.tools.bench.bounds import Bounds, efficiency, run_bounds, waste_share
from pipeline.tools.bench.delivered_latency import TimedEngine, fit_latency
from pipeline.tools.bench.staleness_model import TABLE_HEADER, Workload, predict, summary, table_line
from pipeline.tools.fake_sglang import FakeSGLang, LatencyModel, lognormal_script
from pipeline.transport.spool import SpoolReader, SpoolWriter

GOAL_SPEEDUP = 2.0
END_TEXT = "<|end|>"


class CharTokenizer:
    """A dependency-free chat tokenizer: one id per character code point below 256, id 256 = <|end|>.

    Template: "<role>: <content><|end|>\\n" per message, "assistant: " as the generation prompt. Decoding
    then encoding any id sequence round-trips exactly, which the runner's token buffer relies on.
    """

    eos_token_id = 256
    vocab_size = 257

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> str:
        text = "".join(f"{m['role']}: {m['content']}{END_TEXT}\n" for m in conversation)
        return text + ("assistant: " if kwargs.get("add_generation_prompt") else "")

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        ids: list[int] = []
        for k, part in enumerate(text.split(END_TEXT)):
            if k:
                ids.append(self.eos_token_id)
            for ch in part:
                code = ord(ch)
                if code >= 256:
                    raise ValueError(f"CharTokenizer cannot encode {ch!r} (code point {code} >= 256)")
                ids.append(code)
        return ids

    def decode(self, token_ids: Any, **kwargs: Any) -> str:
        return "".join(END_TEXT if t == self.eos_token_id else chr(t) for t in token_ids)


class CoinEnv(Environment):
    """A trivial multi-turn task: `turns` turns, then outcome 1.0 when the last reply has an odd length.

    Cheap on purpose (the benchmark measures scheduling, not environments); rewards still vary within
    a group so the groups carry a learning signal.
    """

    def __init__(self, turns: int = 2) -> None:
        self.spec = EnvSpec(name="bench-coin", version="1", max_turns=turns, step_timeout_s=30.0)
        self._turn = 0

    def tasks(self, seed: int) -> Iterator[Task]:
        for index in itertools.count():
            yield Task(id=f"coin-{seed}-{index}", seed=seed * 1_000_003 + index, data={})

    async def reset(self, task: Task) -> list[Message]:
        self._turn = 0
        return [{"role": "user", "content": f"Flip {task.id}."}]

    async def step(self, action: Action) -> StepResult:
        self._turn += 1
        if self._turn >= self.spec.max_turns:
            return StepResult(messages=[], done=True, outcome=float(len(action.text) % 2))
        return StepResult(messages=[{"role": "user", "content": "Again."}])


@dataclass(frozen=True)
class BenchParams:
    seconds: float = 22.0
    batch_groups: int = 4
    group_size: int = 4
    turns: int = 2
    max_new_tokens: int = 300
    max_concurrent: int = 12  # (η + 1)·B for η = 2: the overlapped run can use every slot
    step_s: float = 0.5
    seed: int = 0
    median_tokens: float = 40.0  # response lengths ~ lognormal(median, sigma), capped by max_new_tokens
    sigma: float = 1.0
    straggler_patience: float = 0.0  # async.straggler_patience (0 = no straggler protection)
    cut_late_groups: float = 0.25  # async.cut_late_groups (0 = never cut)


@dataclass
class ModeResult:
    eta: int
    wall_s: float
    steps: int
    steps_per_hour: float
    learner_idle_fraction: float
    engine_idle_fraction: float
    actor_idle_fraction: float
    mean_staleness: float
    max_staleness: int
    trained_groups: int
    dropped_stale: int
    groups_cut: int
    sync_s_mean: float
    generated_tokens: int
    trained_tokens: int
    wasted_tokens: dict[str, int]  # by cause (pipeline.contracts.waste)
    bounds: Bounds
    # What the engine delivered (pipeline.tools.bench.delivered_latency); None without the requests to tell
    delivered_prefill_s: float | None
    delivered_per_token_s: float | None

    @property
    def efficiency(self) -> float | None:
        return efficiency(self.steps_per_hour, self.bounds)

    def summary(self) -> dict[str, Any]:
        """The result as JSON: its fields, the binding resource, the bound and the efficiency."""
        out = asdict(self)
        out.update(
            binding=self.bounds.binding,
            bound_steps_per_hour=self.bounds.bound,
            efficiency=self.efficiency,
            waste_share=waste_share(self.wasted_tokens, self.generated_tokens),
        )
        return out


def _group_min_version(batch: Any) -> tuple[int | None, list[int]]:
    """Oldest version among the group's trainable generated tokens, and each one's version: the rows
    learner.process reads (a cut episode's rows are the scheduler's waste, never trained or dropped)."""
    rows, _ = batch_to_segments(batch)
    versions = [
        v for row in rows if row.trainable for v, m in zip(row.versions, row.loss_mask, strict=True) if m
    ]
    return (min(versions) if versions else None), versions


async def run_mode(eta: int, params: BenchParams, model: LatencyModel, workdir: Path) -> ModeResult:
    """One timed run at staleness bound `eta` (see module docstring)."""
    engine = FakeSGLang(
        latency=model,
        script=lognormal_script(median_tokens=params.median_tokens, sigma=params.sigma, seed=params.seed),
        vocab_size=CharTokenizer.vocab_size,
        report_token_versions=True,
    )
    url = await engine.start()
    pool = EnginePool([EngineClient(url, retries=0, request_timeout_s=60.0)])
    timed = TimedEngine(pool)
    spool_dir = workdir / f"spool-eta{eta}"
    admission = AdmissionController(params.batch_groups, eta, params.max_concurrent)
    settings = RolloutSettings(
        sampling=SamplingParams(max_new_tokens=params.max_new_tokens),
        max_context_tokens=params.turns * (params.max_new_tokens + 64) + 64,
    )
    env = CoinEnv(params.turns)
    scheduler = GroupScheduler(
        recipe=GroupRecipe(
            engine=timed,
            tokenizer=CharTokenizer(),
            factory=CoinEnv,
            env_name="bench-coin",
            settings=settings,
            group_size=params.group_size,
            env_options={"turns": params.turns},
        ),
        admission=admission,
        spool=SpoolWriter(spool_dir),
        tasks=env.tasks(params.seed),
        pacing=Pacing(straggler_patience=params.straggler_patience, cut_late_groups=params.cut_late_groups),
    )
    reader = SpoolReader(spool_dir, after_seq=0)
    stop = asyncio.Event()
    version = 0
    steps = 0
    idle_s = 0.0
    staleness: list[int] = []
    dropped = 0
    trained = 0
    stale_tokens = 0
    generated_before, _ = token_books()  # the scheduler's episodes count into this process's registry
    sync_times: list[float] = []
    sync_spans: list[tuple[float, float]] = []  # the engine paused within each
    published = asyncio.Event()
    waiting: list[tuple[int | None, list[int], int]] = []  # read, not taken: (oldest version, versions, seq)

    async def sync_engines() -> None:
        """The supervisor's side: sync each published version in turn, the newest when several wait."""
        served = 0
        while True:
            await published.wait()
            published.clear()
            target = version
            if target <= served:
                continue
            weights = workdir / f"weights-eta{eta}" / f"v{target}"
            sync_from = time.monotonic()
            timings = await sync_weights(pool, model_path=str(weights), version=target, mode="in_place")
            sync_spans.append((sync_from, time.monotonic()))
            sync_times.append(timings.total_s)
            served = target
            scheduler.on_version(served)

    started = time.monotonic()
    deadline = started + params.seconds
    scheduler_task = asyncio.create_task(scheduler.run(stop))
    syncer = asyncio.create_task(sync_engines())
    try:
        while time.monotonic() < deadline:
            batch_versions: list[int] = []
            taken = 0
            wait_from = time.monotonic()
            refresh = True
            while taken < params.batch_groups and time.monotonic() < deadline:
                room = 2 * params.batch_groups - len(waiting)  # the learner's look-ahead, read as it does
                if room > 0 and (refresh or len(waiting) < params.batch_groups - taken):
                    refresh = False
                    items = await asyncio.to_thread(reader.poll, room)
                    waiting.extend((*_group_min_version(item.batch), item.seq) for item in items)
                if not waiting:
                    await asyncio.sleep(0.005)
                    continue
                waiting.sort(key=lambda w: deadline_key(w[0], w[2]))
                oldest, versions, _ = waiting.pop(0)
                if oldest is None or is_stale(oldest, version, eta):
                    dropped += 1
                    stale_tokens += len(versions)
                    scheduler.on_dropped(1)
                    continue
                batch_versions.extend(version - v for v in versions)
                taken += 1
            idle_s += time.monotonic() - wait_from
            if taken < params.batch_groups:
                break
            await asyncio.sleep(params.step_s)  # the optimizer step, GPU-like: no CPU
            version += 1
            steps += 1
            trained += taken
            staleness.extend(batch_versions)
            (workdir / f"weights-eta{eta}" / f"v{version}").mkdir(parents=True)  # the export
            published.set()
            # The step event: the spool groups consumed so far (trained or dropped), as the learner's
            # watermark plus the seqs it consumed beyond it say.
            scheduler.on_learner_step(version, trained + dropped)
    finally:
        wall = time.monotonic() - started
        engine_busy_s = engine.busy_seconds()
        # The books at the end of the measured window: what the bench's own stop cancels (the groups
        # still running) is neither trained nor waste of the steady state, only unfinished.
        generated = token_books()[0] - generated_before
        wasted = {cause: scheduler.waste.tokens[cause] for cause in WASTE_CAUSES}
        syncer.cancel()
        stop.set()
        await scheduler.drain(0.0)
        await scheduler_task
        await asyncio.gather(syncer, return_exceptions=True)
        await pool.close()
        await engine.stop()
    wasted[STALE] += stale_tokens
    delivered = fit_latency(timed.requests, sync_spans)
    return ModeResult(
        eta=eta,
        wall_s=wall,
        steps=steps,
        steps_per_hour=steps * 3600.0 / wall,
        learner_idle_fraction=idle_s / wall,
        engine_idle_fraction=1.0 - engine_busy_s / wall,
        actor_idle_fraction=scheduler.actor_idle_s / wall,
        mean_staleness=sum(staleness) / len(staleness) if staleness else 0.0,
        max_staleness=max(staleness) if staleness else 0,
        trained_groups=trained,
        dropped_stale=dropped + scheduler.dropped_in_flight,
        groups_cut=scheduler.groups_cut,
        sync_s_mean=sum(sync_times) / len(sync_times) if sync_times else 0.0,
        generated_tokens=generated,
        trained_tokens=len(staleness),
        wasted_tokens=wasted,
        bounds=run_bounds(
            step_s=params.step_s,
            generated_tokens=generated,
            engine_busy_s=engine_busy_s,
            batch_groups=params.batch_groups,
            trained_tokens=len(staleness),
            trained_groups=trained,
        ),
        delivered_prefill_s=delivered[0] if delivered else None,
        delivered_per_token_s=delivered[1] if delivered else None,
    )


async def run_bench(params: BenchParams, model: LatencyModel, etas: Sequence[int]) -> list[ModeResult]:
    with tempfile.TemporaryDirectory(prefix="rollwise-bench-async-") as tmp:
        return [await run_mode(eta, params, model, Path(tmp)) for eta in etas]


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rollwise bench async", description=__doc__.split("\n\n")[0])
    d, m = BenchParams(), LatencyModel()
    p.add_argument("--seconds", type=float, default=d.seconds, help="wall time of each run")
    p.add_argument("--eta", type=int, default=2, help="staleness bound compared with eta = 0")
    p.add_argument("--batch-groups", type=int, default=d.batch_groups, help="B: groups per learner step")
    p.add_argument("--group-size", type=int, default=d.group_size, help="G: episodes per group")
    p.add_argument("--turns", type=int, default=d.turns, help="turns per episode")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help="cap of one response")
    p.add_argument("--max-concurrent", type=int, default=d.max_concurrent, help="groups running at once")
    p.add_argument("--step-s", type=float, default=d.step_s, help="modelled learner step (seconds)")
    p.add_argument("--per-token-ms", type=float, default=m.per_token_s * 1e3, help="decode latency/token")
    p.add_argument("--prefill-ms", type=float, default=m.prefill_s * 1e3, help="latency per request")
    p.add_argument("--median-tokens", type=float, default=d.median_tokens, help="median response length")
    p.add_argument("--sigma", type=float, default=d.sigma, help="lognormal sigma of response lengths")
    p.add_argument("--load-ms", type=float, default=m.load_s * 1e3, help="weight load time of the engine")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--straggler-patience",
        type=float,
        default=d.straggler_patience,
        help="async.straggler_patience: median group durations a straggler is protected (0 = off)",
    )
    p.add_argument(
        "--cut-late-groups",
        type=float,
        default=d.cut_late_groups,
        help="async.cut_late_groups: largest share of a group's episodes a cut may stop (0 = never cut)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument(
        "--model",
        action="store_true",
        help="print the staleness model's prediction for eta = 0 .. --eta instead of running the bench",
    )
    p.add_argument("--runs", type=int, default=10, help="--model: simulated runs of --seconds each, pooled")
    p.add_argument(
        "--write-ms",
        type=float,
        default=0.0,
        help="--model: from a group's end until the learner can read it (spool write and poll)",
    )
    return p.parse_args(list(argv))


def _limit_line(r: ModeResult) -> str:
    """One arm's limit: the binding resource, its bound, the efficiency, and the waste by cause."""
    bound, eff = r.bounds.bound, r.efficiency
    share = waste_share(r.wasted_tokens, r.generated_tokens)
    causes = ", ".join(f"{cause} {n}" for cause, n in r.wasted_tokens.items() if n) or "none"
    return (
        f"{r.eta:>4} {r.bounds.binding or '-':>8} {f'{bound:.0f}' if bound else '-':>8} "
        f"{f'{eff:.1%}' if eff is not None else '-':>11} {f'{share:.1%}' if share is not None else '-':>7}  "
        f"{causes} (of {r.generated_tokens} generated)"
    )


def print_model(args: argparse.Namespace, params: BenchParams, model: LatencyModel) -> None:
    """--model: the staleness model's prediction for the bench's parameters, η = 0 .. --eta."""
    base = Workload(
        batch_groups=params.batch_groups,
        group_size=params.group_size,
        turns=params.turns,
        max_new_tokens=params.max_new_tokens,
        max_concurrent=params.max_concurrent,
        step_s=params.step_s,
        per_token_s=model.per_token_s,
        prefill_s=model.prefill_s,
        chunk_tokens=model.chunk_tokens,
        load_s=model.load_s,
        write_s=args.write_ms / 1e3,
        median_tokens=params.median_tokens,
        sigma=params.sigma,
        straggler_patience=params.straggler_patience,
        cut_late_groups=params.cut_late_groups,
        seconds=params.seconds,
        seed=params.seed,
    )
    rows = [
        (eta, predict(dataclasses.replace(base, max_staleness=eta), args.runs)) for eta in range(args.eta + 1)
    ]
    if args.json:
        predictions = [{"eta": eta, **summary(p)} for eta, p in rows]
        print(json.dumps({"workload": asdict(base), "runs": args.runs, "predictions": predictions}))
        return
    print(
        f"model: B={base.batch_groups} G={base.group_size} turns={base.turns} step={base.step_s}s "
        f"tokens~lognormal(median {base.median_tokens:g}, sigma {base.sigma:g}) <= {base.max_new_tokens}, "
        f"{base.per_token_s * 1e3:g} ms/token + {base.prefill_s * 1e3:g} ms prefill, "
        f"load {base.load_s * 1e3:g} ms, write {base.write_s * 1e3:g} ms; "
        f"{args.runs} runs of {base.seconds:g} s pooled"
    )
    print(TABLE_HEADER)
    for eta, p in rows:
        print(table_line(eta, p))


def _delivered_line(r: ModeResult) -> str:
    """One arm's engine as it delivered (delivered_latency): `--model --per-token-ms T --prefill-ms R
    --load-ms S` predicts this run rather than the one the latency model asks for."""
    token, request = r.delivered_per_token_s, r.delivered_prefill_s
    return (
        f"{r.eta:>4} {f'{token * 1e3:.2f}' if token is not None else '-':>9} "
        f"{f'{request * 1e3:.1f}' if request is not None else '-':>11} {r.sync_s_mean * 1e3:>8.1f}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run η = 0 and η = --eta back to back; exit 0 when the speed-up reaches the goal, 1 otherwise.
    With --model, print the model's prediction instead and exit 0."""
    args = _parse(argv or [])
    params = BenchParams(
        seconds=args.seconds,
        batch_groups=args.batch_groups,
        group_size=args.group_size,
        turns=args.turns,
        max_new_tokens=args.max_new_tokens,
        max_concurrent=args.max_concurrent,
        step_s=args.step_s,
        seed=args.seed,
        median_tokens=args.median_tokens,
        sigma=args.sigma,
        straggler_patience=args.straggler_patience,
        cut_late_groups=args.cut_late_groups,
    )
    model = LatencyModel(
        per_token_s=args.per_token_ms / 1e3, prefill_s=args.prefill_ms / 1e3, load_s=args.load_ms / 1e3
    )
    if args.model:
        print_model(args, params, model)
        return 0
    results = asyncio.run(run_bench(params, model, [0, args.eta]))
    sync, overlapped = results
    speedup = overlapped.steps_per_hour / sync.steps_per_hour if sync.steps_per_hour else math.inf
    if args.json:
        print(
            json.dumps(
                {
                    "params": asdict(params),
                    "model": asdict(model),
                    "results": [r.summary() for r in results],
                    "speedup": speedup,
                    "ceiling": 3600.0 / params.step_s / sync.steps_per_hour if sync.steps_per_hour else None,
                    "goal": GOAL_SPEEDUP,
                }
            )
        )
    else:
        print(
            f"B={params.batch_groups} G={params.group_size} turns={params.turns} step={params.step_s}s "
            f"tokens~lognormal(median {params.median_tokens:g}, sigma {params.sigma:g})"
            f" <= {params.max_new_tokens}, "
            f"{model.per_token_s * 1e3:g} ms/token + {model.prefill_s * 1e3:g} ms prefill"
        )
        header = f"{'eta':>4} {'steps':>6} {'steps/h':>9} {'learner idle':>13} {'engine idle':>12} "
        header += f"{'actor idle':>11} {'staleness':>10} {'max':>4} {'dropped':>8} {'cut':>4} {'sync s':>7}"
        print(header)
        for r in results:
            print(
                f"{r.eta:>4} {r.steps:>6} {r.steps_per_hour:>9.0f} {r.learner_idle_fraction:>13.1%} "
                f"{r.engine_idle_fraction:>12.1%} {r.actor_idle_fraction:>11.1%} {r.mean_staleness:>10.2f} "
                f"{r.max_staleness:>4} {r.dropped_stale:>8} {r.groups_cut:>4} {r.sync_s_mean:>7.3f}"
            )
        print(
            f"{'eta':>4} {'binds':>8} {'bound/h':>8} {'efficiency':>11} {'wasted':>7}  tokens wasted by cause"
        )
        for r in results:
            print(_limit_line(r))
        print(f"{'eta':>4} {'ms/token':>9} {'ms/request':>11} {'sync ms':>8}  as the engine delivered them")
        for r in results:
            print(_delivered_line(r))
        ceiling = 3600.0 / params.step_s / sync.steps_per_hour if sync.steps_per_hour else math.inf
        print(
            f"ceiling for any eta > 0 (a learner that never waits, {3600.0 / params.step_s:.0f} steps/h): "
            f"{ceiling:.2f}x"
        )
        verdict = "meets" if speedup >= GOAL_SPEEDUP else "misses"
        print(f"speed-up eta={args.eta} vs eta=0: {speedup:.2f}x ({verdict} the {GOAL_SPEEDUP:.1f}x goal)")
    return 0 if speedup >= GOAL_SPEEDUP else 1
