"""`rollwise bench publish`: the learner's steps/hour when it publishes every version, with the weight
write inline (the step waits for it) against in the background (learner.export_in_background).

Real parts only: the learner process's own loop (learner.process.loop.LearnerWorker, run in this process) on a
run directory with a preset model (default `small`; `--preset smollm2-135m-instruct` the pretrained one),
reading a spool of synthetic groups (bench learner's: `--groups` groups per step of `--group-size`
one-turn episodes, `--prompt` + `--generated` random tokens, outcomes alternating so every step updates),
training each step and publishing every version (async.sync_every_steps = 1) as HF weights to disk.
The two modes alternate, `--repeats` runs each, in this process. Per run: seconds per learner step
between the first step's event and the last's (the first step's warm-up left out), and the learner's
busy time per step (the step event's busy_s: training plus what the publish blocked). The ratio is
inline's seconds per step over background's: above 1 when the write left the step's path.

Where it ends: a background write still shares the machine's cores and disk with training, and a publish
waits for the previous write, so with writes slower than steps the learner waits for them either way.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from learner.process.shell import EventStream
from pipeline.contracts import events

GOAL_RATIO = 1.0


@dataclass
class RunResult:
    background: bool
    steps: int
    seconds_per_step: float
    busy_s_per_step: float
    published: int


class _TimedEvents(EventStream):
    """The learner's event stream, kept in memory with the time each event was emitted."""

    def __init__(self) -> None:
        super().__init__(io.StringIO())
        self.timed: list[tuple[float, dict[str, Any]]] = []

    def emit(self, event: events.LearnerEvent) -> None:
        self.timed.append((time.monotonic(), json.loads(events.encode(event))))


def _write_spool(spool_dir: Path, vocab: int, args: argparse.Namespace) -> None:
    from pipeline.contracts.schema import segments_to_batch
    from pipeline.tools.bench.learner_step import _groups
    from pipeline.transport.spool import SpoolWriter

    spec = argparse.Namespace(
        groups=args.groups * args.steps,
        group_size=args.group_size,
        prompt=args.prompt,
        generated=args.generated,
    )
    writer = SpoolWriter(spool_dir)
    for group in _groups(vocab, spec):
        rows = [segment for episode in group.episodes for segment in episode]
        writer.write_group(segments_to_batch(rows), group_id=group.group_id)


def run_once(model_dir: Path, work: Path, background: bool, args: argparse.Namespace) -> RunResult:
    """One learner run of `args.steps` steps on a fresh run directory (module docstring)."""
    from learner.process.loop import LearnerWorker
    from learner.process.shell import StopFlag
    from pipeline.contracts.config import load_config
    from pipeline.contracts.run_dir import RunDir

    root = work / f"run-{'background' if background else 'inline'}-{time.monotonic_ns()}"
    cfg = load_config(
        None,
        [
            f"run.max_steps={args.steps}",
            f"learner.batch_groups={args.groups}",
            f"env.group_size={args.group_size}",
            f"learner.mini_batches={args.mini_batches}",
            f"learner.precision='{args.precision}'",
            f"learner.threads={args.threads}",
            "learner.device='cpu'",
            f"learner.checkpoint_every={args.steps + 1}",  # the final checkpoint only, after the timing
            f"learner.export_in_background={str(background).lower()}",
            f"async.max_staleness={args.steps + 1}",  # the spool's groups are all of version 0
            "async.sync_every_steps=1",
            "async.served_check.enabled=false",
        ],
    )
    run = RunDir.at(root, model_dir)
    from transformers import AutoConfig

    _write_spool(run.spool, int(AutoConfig.from_pretrained(str(model_dir)).vocab_size), args)
    out = _TimedEvents()
    LearnerWorker(cfg, run, out, StopFlag()).run()
    steps = [(t, e) for t, e in out.timed if e["event"] == "step"]
    if len(steps) < 2:
        raise RuntimeError(f"the learner made {len(steps)} step(s); at least 2 are needed (--steps)")
    (first, _), (last, _) = steps[0], steps[-1]
    busy = [e["busy_s"] for _, e in steps[1:]]
    return RunResult(
        background=background,
        steps=len(steps),
        seconds_per_step=(last - first) / (len(steps) - 1),
        busy_s_per_step=statistics.fmean(busy),
        published=sum(1 for _, e in out.timed if e["event"] == "published"),
    )


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rollwise bench publish", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small", help="model preset (rollwise model init's presets)")
    p.add_argument("--steps", type=int, default=6, help="learner steps per run (the first is warm-up)")
    p.add_argument("--groups", type=int, default=2, help="groups per step")
    p.add_argument("--group-size", type=int, default=4, help="episodes per group")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens per episode")
    p.add_argument("--generated", type=int, default=64, help="generated tokens per episode")
    p.add_argument("--mini-batches", type=int, default=1, help="optimizer updates per step")
    p.add_argument("--precision", default="auto", help="learner.precision")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads of the learner")
    p.add_argument("--repeats", type=int, default=2, help="runs per mode, the modes alternating")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = p.parse_args(list(argv))
    if args.steps < 2:
        p.error("--steps must be >= 2 (the first step is warm-up)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Inline and background runs alternating; exit 0 when background is at least as fast, 1 otherwise."""
    from learner.model.model_init import init_model

    args = _parse(argv or [])
    with tempfile.TemporaryDirectory(prefix="rollwise-bench-publish-") as tmp:
        work = Path(tmp)
        model_dir = init_model(work / "model", args.preset, seed=0)
        results = [
            run_once(model_dir, work, background, args)
            for _ in range(args.repeats)
            for background in (False, True)
        ]
    inline = statistics.median(r.seconds_per_step for r in results if not r.background)
    overlapped = statistics.median(r.seconds_per_step for r in results if r.background)
    ratio = inline / overlapped
    if args.json:
        print(json.dumps({"params": vars(args), "results": [asdict(r) for r in results], "ratio": ratio}))
    else:
        print(
            f"preset {args.preset}, {args.groups} x {args.group_size} episodes of {args.prompt} + "
            f"{args.generated} tokens per step, precision {args.precision}, {args.threads} thread(s)"
        )
        print(f"{'mode':>11} {'steps':>6} {'s/step':>8} {'busy s/step':>12} {'published':>10}")
        for r in results:
            mode = "background" if r.background else "inline"
            print(
                f"{mode:>11} {r.steps:>6} {r.seconds_per_step:>8.3f} {r.busy_s_per_step:>12.3f} "
                f"{r.published:>10}"
            )
        print(f"steps/hour, background over inline (medians): {ratio:.2f}x")
    return 0 if ratio >= GOAL_RATIO else 1
