"""A discrete-event model of `rollwise bench async`: staleness, waste and steps/hour without running it.

`rollwise bench async --model` prints it for the bench's parameters (instant, so η, concurrency, the
step time and the tail of the lengths can be swept); `simulate(Workload)` is the model itself.

The same system as the bench, in simulated time, with the rollout side's rules taken from the modules
that apply them rather than re-derived: admission's count rule and the stragglers' floor
(pipeline.supervisor.actors.admission), the late cut (pipeline.supervisor.actors.late_cut), the
learner's drop and its earliest-deadline-first order (pipeline.contracts.staleness). Modelled:
- a group is G episodes started together; it is written when its last one ends or it is cut, and
  `write_s` later the scheduler counts it accepted and the learner can read it (the spool's write and
  the learner's poll; 0 by default);
- an episode is `turns` engine requests one after another (the environment costs nothing); a request
  waits while the engine is paused, takes `prefill_s` (all a request costs besides its tokens), then
  decodes its response in chunks of `chunk_tokens` at `per_token_s` a token, however many requests run
  (the fake's latency model). The response length is lognormal(median, sigma) rounded, at least 1,
  capped by `max_new_tokens`;
- a weight sync pauses the engine for `load_s`: a chunk being decoded finishes, the next waits; tokens
  take the version the engine serves when their chunk ends. Admission hears the new version when the
  sync ends. One sync at a time, each to the newest published version (the control calls' round trips
  are not modelled);
- the learner takes B groups, earliest deadline first among those it has read (it reads the spool up to
  2·B ahead at the start of each batch and again whenever it holds fewer than it still needs), drops
  those whose oldest token is older than its version − η, trains for `step_s`, publishes, and tells
  the scheduler its version and the groups it consumed: the scheduler then stops the running groups
  already holding a token older than that version − η, unwritten (in_flight_drops, counted with the
  learner's drops), and makes its late cuts;
- a run lasts `seconds`: the learner stops collecting then, and a step under way ends first; tokens
  count as generated when their turn ends (a turn a cut stops counts nowhere), as the bench's books do.

Not modelled: CPU time (HTTP, tokenising, the spool's reads and writes beyond `write_s`) and an engine
that slows under load. The model's engine is exactly as fast as its parameters: on a busy host give it
what the bench's engine delivered (the bench prints it: pipeline.tools.bench.delivered_latency), for a
real engine its latency at the concurrency it runs.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import random
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields

from pipeline.contracts.staleness import deadline_key, is_stale
from pipeline.supervisor.actors.admission import AdmissionController, Stragglers
from pipeline.supervisor.actors.late_cut import RunningGroup, groups_to_cut


@dataclass(frozen=True)
class Workload:
    """The bench's parameters (pipeline.tools.bench.async_speedup: BenchParams and the fake's
    LatencyModel) and the staleness bound η; seconds are simulated."""

    batch_groups: int = 4
    group_size: int = 4
    turns: int = 2
    max_new_tokens: int = 300
    max_concurrent: int = 12
    step_s: float = 0.5
    per_token_s: float = 0.002
    prefill_s: float = 0.02
    chunk_tokens: int = 8
    load_s: float = 0.05
    write_s: float = 0.0
    median_tokens: float = 40.0
    sigma: float = 1.0
    max_staleness: int = 2
    straggler_patience: float = 0.0
    cut_late_groups: float = 0.25
    seconds: float = 22.0
    seed: int = 0

    def __post_init__(self) -> None:
        AdmissionController(self.batch_groups, self.max_staleness, self.max_concurrent)  # its own checks
        Stragglers(self.straggler_patience)
        at_least = {"group_size": 1, "turns": 1, "max_new_tokens": 1, "chunk_tokens": 1}
        for name, low in at_least.items():
            if getattr(self, name) < low:
                raise ValueError(f"{name} must be >= {low}, got {getattr(self, name)}")
        for name in ("step_s", "median_tokens", "seconds"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("per_token_s", "prefill_s", "load_s", "write_s", "sigma"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.cut_late_groups <= 1:
            raise ValueError(f"cut_late_groups must be a share in [0, 1], got {self.cut_late_groups}")


@dataclass(frozen=True)
class Prediction:
    """What the bench reports for one η, predicted. Tokens are generated tokens; shares are of the
    generated tokens, or of the groups the learner consumed (`dropped_group_share`)."""

    wall_s: float
    steps: int
    learner_idle_s: float
    engine_busy_s: float
    staleness_sum: int  # over the trained tokens: learner version − token version
    trained_groups: int
    dropped_groups: int  # by the learner, and in flight by the scheduler
    groups_cut: int
    generated_tokens: int
    trained_tokens: int
    stale_tokens: int
    cut_tokens: int

    @property
    def steps_per_hour(self) -> float:
        return self.steps * 3600.0 / self.wall_s

    @property
    def learner_idle_fraction(self) -> float:
        return self.learner_idle_s / self.wall_s

    @property
    def engine_idle_fraction(self) -> float:
        return 1.0 - self.engine_busy_s / self.wall_s

    @property
    def mean_staleness(self) -> float:
        return self.staleness_sum / self.trained_tokens if self.trained_tokens else 0.0

    @property
    def dropped_group_share(self) -> float:
        consumed = self.trained_groups + self.dropped_groups
        return self.dropped_groups / consumed if consumed else 0.0

    @property
    def stale_share(self) -> float:
        return share(self.stale_tokens, self.generated_tokens)

    @property
    def cut_share(self) -> float:
        return share(self.cut_tokens, self.generated_tokens)

    @property
    def waste_share(self) -> float:
        return share(self.stale_tokens + self.cut_tokens, self.generated_tokens)


RATIOS = (
    "steps_per_hour",
    "learner_idle_fraction",
    "engine_idle_fraction",
    "mean_staleness",
    "dropped_group_share",
    "stale_share",
    "cut_share",
    "waste_share",
)
TABLE_HEADER = (
    f"{'eta':>4} {'steps/h':>9} {'learner idle':>13} {'engine idle':>12} {'staleness':>10} "
    f"{'dropped':>8} {'stale':>7} {'cut':>7} {'wasted':>7}"
)


def table_line(eta: int, p: Prediction) -> str:
    """One row under TABLE_HEADER: dropped is the share of the consumed groups, stale, cut and wasted
    the shares of the generated tokens."""
    return (
        f"{eta:>4} {p.steps_per_hour:>9.0f} {p.learner_idle_fraction:>13.1%} {p.engine_idle_fraction:>12.1%} "
        f"{p.mean_staleness:>10.2f} {p.dropped_group_share:>8.1%} {p.stale_share:>7.1%} {p.cut_share:>7.1%} "
        f"{p.waste_share:>7.1%}"
    )


def summary(p: Prediction) -> dict[str, float]:
    """The prediction as JSON: its totals and its ratios."""
    return {**{f.name: getattr(p, f.name) for f in fields(Prediction)}, **{r: getattr(p, r) for r in RATIOS}}


def share(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


def pooled(predictions: Iterable[Prediction]) -> Prediction:
    """Several runs as one: every count and every second added (ratios over the pooled totals)."""
    runs = list(predictions)
    if not runs:
        raise ValueError("pooled needs at least one prediction")
    return Prediction(**{f.name: sum(getattr(r, f.name) for r in runs) for f in fields(Prediction)})


def response_tokens(rng: random.Random, median: float, sigma: float, cap: int) -> int:
    """One response length as the fake's lognormal script draws it: round(median · e^N(0, σ)) in
    [1, cap]."""
    return max(1, min(cap, round(median * math.exp(rng.gauss(0.0, sigma)))))


def split_at_pause(
    elapsed_s: float, remaining: int, chunk_tokens: int, per_token_s: float
) -> tuple[int, int]:
    """A request decoding for `elapsed_s` with `remaining` tokens to go when the engine pauses: (tokens
    its finished chunks decoded, tokens of the chunk under way, which finishes during the pause). Chunks
    start at 0 of `elapsed_s`; (remaining, 0) when it ends within its current chunk anyway."""
    chunk_s = chunk_tokens * per_token_s
    done = min(remaining, int(elapsed_s // chunk_s) * chunk_tokens) if chunk_s > 0 else remaining
    under_way = min(chunk_tokens, remaining - done)
    if done + under_way >= remaining:
        return remaining, 0
    return done, under_way


class _Episode:
    __slots__ = ("cut", "done", "generated", "group", "request", "turn", "versions")

    def __init__(self, group: _Group) -> None:
        self.group = group
        self.turn = 0
        self.generated = 0  # tokens of its finished turns
        self.versions: Counter[int] = Counter()  # those tokens by version
        self.request: _Request | None = None
        self.done = False
        self.cut = False  # ended by a cut: never trained


class _Group:
    __slots__ = ("episodes", "gid", "seq", "started", "version")

    def __init__(self, gid: int, version: int, started: float, size: int) -> None:
        self.gid, self.version, self.started = gid, version, started
        self.episodes = [_Episode(self) for _ in range(size)]
        self.seq = 0  # its place in the spool (1, 2, ...), once written

    @property
    def unfinished(self) -> int:
        return sum(1 for e in self.episodes if not e.done)

    def oldest_version(self) -> int | None:
        """Of the tokens the learner would train (its episodes not cut), as learner.process reads it."""
        return min((v for e in self.episodes if not e.cut for v in e.versions), default=None)


class _Request:
    """One engine request: `tokens` to decode, `done` so far, by version in `versions`. `epoch` tells
    a scheduled event from one a pause or a cut overtook."""

    __slots__ = ("done", "episode", "epoch", "segment_from", "tokens", "versions")

    def __init__(self, episode: _Episode, tokens: int) -> None:
        self.episode, self.tokens = episode, tokens
        self.done = 0
        self.versions: Counter[int] = Counter()
        self.epoch = 0
        self.segment_from = 0.0


class Simulation:
    """One run of a Workload: the engine, the scheduler's counters, the learner and the syncer, driven by
    a heap of timed events. `run()` returns the Prediction."""

    def __init__(self, w: Workload) -> None:
        self.w = w
        self.rng = random.Random(w.seed)
        self.admission = AdmissionController(w.batch_groups, w.max_staleness, w.max_concurrent)
        self.stragglers = Stragglers(w.straggler_patience)
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[..., None], tuple[object, ...]]] = []
        self._order = itertools.count()
        # engine
        self.served = 0  # the version the engine decodes with
        self.paused = False
        # decoding requests, in the order they started: a set's order (by address) would make runs differ
        self.decoding: dict[_Request, None] = {}
        self.frozen: list[_Request] = []  # decoding requests waiting for the pause to end
        self.arriving: list[_Request] = []  # requests sent while paused, not yet registered
        self.registered = 0
        self.busy_s, self._busy_from = 0.0, 0.0
        # scheduler
        self.version = 0  # served, as admission knows it (a sync's end)
        self.accepted = self.running = self.written = 0
        self.writing = 0  # groups ended, not yet written
        self.admitted: dict[int, _Group] = {}
        self._gids = itertools.count(1)
        self._floor_wake: float | None = None
        self.learner_heard: tuple[int, int] | None = None  # (version, groups consumed) at its last step
        # learner
        self.learner_version = 0
        self.spool: list[_Group] = []
        self.read = 0
        self.waiting: list[tuple[tuple[int, int], _Group]] = []
        self.taken: list[_Group] = []
        self.collecting, self.refresh, self.collect_from = True, True, 0.0
        self.syncing = False
        self.finished = False
        # books
        self.steps = self.trained = self.dropped = self.dropped_in_flight = self.cut_groups = 0
        self.idle_s = 0.0
        self.staleness_sum = self.generated = self.trained_tokens = self.stale_tokens = self.cut_tokens = 0

    # ------------------------------------------------------------------ the clock
    def at(self, when: float, action: Callable[..., None], *args: object) -> None:
        heapq.heappush(self._events, (when, next(self._order), action, args))

    def run(self) -> Prediction:
        self.at(self.w.seconds, self._deadline)
        self._admit()
        while self._events and not self.finished:
            self.now, _, action, args = heapq.heappop(self._events)
            action(*args)
        return Prediction(
            wall_s=self.now,
            steps=self.steps,
            learner_idle_s=self.idle_s,
            engine_busy_s=self.busy_s + (self.now - self._busy_from if self.registered else 0.0),
            staleness_sum=self.staleness_sum,
            trained_groups=self.trained,
            dropped_groups=self.dropped + self.dropped_in_flight,
            groups_cut=self.cut_groups,
            generated_tokens=self.generated,
            trained_tokens=self.trained_tokens,
            stale_tokens=self.stale_tokens,
            cut_tokens=self.cut_tokens,
        )

    def _deadline(self) -> None:
        if self.collecting:  # a step under way finishes first (_step_done)
            self.idle_s += self.now - self.collect_from
            self.finished = True

    # ------------------------------------------------------------------ the engine
    def _send(self, episode: _Episode) -> None:
        w = self.w
        request = _Request(episode, response_tokens(self.rng, w.median_tokens, w.sigma, w.max_new_tokens))
        episode.request = request
        if self.paused:
            self.arriving.append(request)
        else:
            self._register(request)

    def _register(self, request: _Request) -> None:
        if not self.registered:
            self._busy_from = self.now
        self.registered += 1
        self.at(self.now + self.w.prefill_s, self._prefilled, request, request.epoch)

    def _prefilled(self, request: _Request, epoch: int) -> None:
        if epoch == request.epoch:
            self._decode_or_freeze(request)

    def _decode_or_freeze(self, request: _Request) -> None:
        if self.paused:
            self.frozen.append(request)
            return
        request.segment_from = self.now
        self.decoding[request] = None
        end = self.now + (request.tokens - request.done) * self.w.per_token_s
        self.at(end, self._decoded, request, request.epoch)

    def _decoded(self, request: _Request, epoch: int) -> None:
        if epoch != request.epoch:
            return
        self.decoding.pop(request, None)
        request.versions[self.served] += request.tokens - request.done
        self._unregister()
        self._turn_ended(request.episode, request)

    def _unregister(self) -> None:
        self.registered -= 1
        if not self.registered:
            self.busy_s += self.now - self._busy_from

    def _pause(self) -> None:
        """Freeze decoding: each request's chunk under way finishes during the pause, the next waits."""
        self.paused = True
        w = self.w
        for request in list(self.decoding):
            remaining = request.tokens - request.done
            done, under_way = split_at_pause(
                self.now - request.segment_from, remaining, w.chunk_tokens, w.per_token_s
            )
            if not under_way:
                continue  # it ends within its current chunk, as scheduled
            self.decoding.pop(request, None)
            request.done += done
            request.versions[self.served] += done
            request.epoch += 1
            chunk_end = request.segment_from + (done + under_way) * w.per_token_s
            self.at(chunk_end, self._chunk_ended, request, request.epoch, under_way)

    def _chunk_ended(self, request: _Request, epoch: int, tokens: int) -> None:
        if epoch == request.epoch:
            request.done += tokens
            request.versions[self.served] += tokens
            self._decode_or_freeze(request)

    def _resume(self, version: int) -> None:
        """The new weights are loaded: decoding continues with them; requests sent meanwhile start."""
        self.served, self.paused = version, False
        frozen, arriving = self.frozen, self.arriving
        self.frozen, self.arriving = [], []
        for request in frozen:
            self._decode_or_freeze(request)
        for request in arriving:
            self._register(request)

    # ------------------------------------------------------------------ episodes and groups
    def _turn_ended(self, episode: _Episode, request: _Request) -> None:
        episode.request = None
        episode.generated += request.tokens
        episode.versions.update(request.versions)
        self.generated += request.tokens
        episode.turn += 1
        if episode.turn < self.w.turns:
            self._send(episode)
            return
        episode.done = True
        if all(e.done for e in episode.group.episodes):
            self._group_ended(episode.group)

    def _group_ended(self, group: _Group) -> None:
        del self.admitted[group.gid]
        self.stragglers.durations.append(self.now - group.started)
        self.writing += 1
        self.at(self.now + self.w.write_s, self._written, group)

    def _cut(self, group: _Group) -> None:
        """Its running episodes end where they stand: a turn under way is lost, finished turns are cut
        waste; the group is written with the episodes that finished."""
        self.cut_groups += 1
        self.cut_tokens += self._stop_episodes(group)
        self._group_ended(group)

    def _drop_doomed(self) -> None:
        """The running groups holding a token older than the learner's version − η stop, unwritten; all
        their tokens are stale (in_flight_drops)."""
        for group in list(self.admitted.values()):
            oldest = min((v for e in group.episodes for v in e.versions), default=None)
            if oldest is None or not is_stale(oldest, self.learner_version, self.w.max_staleness):
                continue
            self._stop_episodes(group)
            del self.admitted[group.gid]
            self.stragglers.durations.append(self.now - group.started)
            self.running -= 1
            self.dropped_in_flight += 1
            self.stale_tokens += sum(e.generated for e in group.episodes)

    def _stop_episodes(self, group: _Group) -> int:
        """End the group's running episodes where they stand (a turn under way is lost); returns the
        tokens of their finished turns."""
        stopped = 0
        for episode in group.episodes:
            if episode.done:
                continue
            request = episode.request
            if request is not None:
                request.epoch += 1
                self.decoding.pop(request, None)
                if request in self.arriving:
                    self.arriving.remove(request)
                else:
                    if request in self.frozen:
                        self.frozen.remove(request)
                    self._unregister()
            episode.request = None
            episode.done = True
            episode.cut = True
            stopped += episode.generated
        return stopped

    # ------------------------------------------------------------------ the scheduler
    def _start_group(self) -> None:
        group = _Group(next(self._gids), self.version, self.now, self.w.group_size)
        self.admitted[group.gid] = group
        self.running += 1
        for episode in group.episodes:
            self._send(episode)

    def _admit(self) -> None:
        """One admission round, then the late cuts (GroupScheduler.run); wakes again when a straggler's
        protection ends."""
        admitted = ((g.version, g.started) for g in self.admitted.values())
        floor, protected_until = self.stragglers.floor(admitted, self.version, self.now)
        for _ in range(self.admission.capacity(self.version, self.accepted, self.running, floor)):
            self._start_group()
        self._check_cuts()
        if protected_until is not None and protected_until != self._floor_wake:
            self._floor_wake = protected_until
            self.at(protected_until + 1e-3, self._admit)

    def _check_cuts(self) -> None:
        if self.learner_heard is None or not self.w.cut_late_groups:
            return
        learner_version, consumed = self.learner_heard
        running = [RunningGroup(str(g.gid), g.version, g.unfinished) for g in self.admitted.values()]
        cut_ids = groups_to_cut(
            running,
            learner_version=learner_version,
            waiting_groups=self.written - consumed,
            writing_groups=self.writing,
            batch_groups=self.w.batch_groups,
            max_staleness=self.w.max_staleness,
            group_size=self.w.group_size,
            max_share=self.w.cut_late_groups,
        )
        for gid in cut_ids:
            self._cut(self.admitted[int(gid)])

    def _written(self, group: _Group) -> None:
        self.writing -= 1
        self.running -= 1
        self.accepted += 1
        self.written += 1
        self.spool.append(group)
        group.seq = len(self.spool)
        self._check_cuts()
        self._admit()
        self._collect()

    # ------------------------------------------------------------------ the learner and the syncer
    def _collect(self) -> None:
        """Take groups until B are taken, as the bench's learner loop does; then step."""
        if not self.collecting or self.finished:
            return
        b, eta = self.w.batch_groups, self.w.max_staleness
        while len(self.taken) < b:
            room = 2 * b - len(self.waiting)
            if room > 0 and (self.refresh or len(self.waiting) < b - len(self.taken)):
                self.refresh = False
                for group in self.spool[self.read : self.read + room]:
                    self.waiting.append((deadline_key(group.oldest_version(), group.seq), group))
                self.read = min(len(self.spool), self.read + room)
            if not self.waiting:
                return  # wait for a write
            self.waiting.sort(key=lambda item: item[0])
            (oldest, _), group = self.waiting.pop(0)
            if oldest < 0 or is_stale(oldest, self.learner_version, eta):
                self.dropped += 1
                self.stale_tokens += sum(e.generated for e in group.episodes if not e.cut)
                self.accepted -= 1
                self._admit()
                continue
            self.taken.append(group)
        self.idle_s += self.now - self.collect_from
        self.collecting = False
        self.at(self.now + self.w.step_s, self._step_done)

    def _step_done(self) -> None:
        for group in self.taken:
            for episode in (e for e in group.episodes if not e.cut):
                for version, tokens in episode.versions.items():
                    self.staleness_sum += (self.learner_version - version) * tokens
                    self.trained_tokens += tokens
        self.trained += len(self.taken)
        self.taken = []
        self.learner_version += 1
        self.steps += 1
        if self.now >= self.w.seconds:
            self.finished = True
            return
        self._sync()
        self.learner_heard = (self.learner_version, self.trained + self.dropped)
        self._drop_doomed()
        self._check_cuts()
        self._admit()
        self.collecting, self.refresh, self.collect_from = True, True, self.now
        self._collect()

    def _sync(self) -> None:
        if self.syncing or self.learner_version <= self.served:
            return
        self.syncing = True
        self._pause()
        self.at(self.now + self.w.load_s, self._synced, self.learner_version)

    def _synced(self, version: int) -> None:
        self.syncing = False
        self._resume(version)
        self.version = version
        self._admit()
        self._sync()  # a newer version published during this sync


def simulate(workload: Workload) -> Prediction:
    """One run of the model (module docstring)."""
    return Simulation(workload).run()


def predict(workload: Workload, runs: int = 1) -> Prediction:
    """`runs` runs with seeds seed, seed + 1, ..., pooled: the bench's figure for these parameters with
    its run-to-run spread averaged out."""
    if runs < 1:
        raise ValueError(f"runs must be >= 1, got {runs}")
    seeds = range(workload.seed, workload.seed + runs)
    return pooled(simulate(dataclasses.replace(workload, seed=seed)) for seed in seeds)
