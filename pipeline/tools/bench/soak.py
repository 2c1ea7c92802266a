"""`rollwise bench soak --minutes M [--chaos]`: the default task for a long while, with every process's
resources sampled, faults injected, and the books checked at the end.

The soak runs `rollwise run` (JSON progress) on a fresh run directory under `--out` and, every
`--sample-s` seconds, records for each process of the daemon (supervisor, engine, learner) its resident
memory, open file descriptors and threads, the supervisor's asyncio tasks (its /metrics), and the run
directory's size by part (soak_resources.py). With `--chaos` it also
- SIGKILLs the engine, the learner or the supervisor at random moments (chaos.KillPlan) from the first
  learner step on; a supervisor
  that exits, killed or not, is started again on the same run directory after `--restart-delay-s`, the
  way an init system (systemd `Restart=always`) would;
- runs the task through `pipeline.tools.bench.chaos:ChaosGuessNumber`, whose environment raises, hangs or
  answers garbage on `--fault-rate` of its steps.
At the end it stops the daemon with SIGTERM and reports:
- the books (soak_books.py): groups written = trained + dropped by reason + quarantined + pending, and
  no group trained twice into the committed weights;
- each process life's growth after `--warmup-minutes` (RSS, fds, threads, asyncio tasks), the
  longest stall without a learner step outside restarts, the run directory's size by part;
- `soak.png` (drawn with `rollwise report`'s renderer), `summary.json`, `resources.jsonl`,
  `events.jsonl` (starts, exits, kills), `ledger.jsonl` (a copy of the learner's consumption ledger)
  in `--out`.
Exit code 0 when the books balance, 1 when they do not, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from pipeline.contracts import memory_trace
from pipeline.contracts.run_dir import RunDir
from pipeline.supervisor.observability.run_health.findings import ranked
from pipeline.supervisor.observability.run_health.health_checks import examine
from pipeline.supervisor.observability.run_health.run_view import load
from pipeline.tools.bench.chaos import KillPlan
from pipeline.tools.bench.soak_books import Books, reconcile
from pipeline.tools.bench.soak_resources import Growth, daemon_processes, dir_sizes, growth, sample_process

CHAOS_ENV = "pipeline.tools.bench.chaos:ChaosGuessNumber"
RSS_GOAL = 0.05  # relative growth per process life after the warm-up
STALL_GOAL_S = 60.0


@dataclass(frozen=True)
class SoakOptions:
    minutes: float
    chaos: bool
    out: Path
    config: str | None
    overrides: list[str]
    kill_every_s: float
    fault_rate: float
    sample_s: float
    warmup_s: float
    restart_delay_s: float
    seed: int
    tracemalloc_every_s: float | None = None  # None: no tracing
    tracemalloc_frames: int = 8  # 0: the native figures only (no Python tracing, no slowdown)


class Daemon:
    """One `rollwise run` process; a thread collects its JSON stdout lines (with the soak's clock)."""

    def __init__(self, argv: list[str], stderr_path: Path, env: dict[str, str] | None = None) -> None:
        self._stderr = open(stderr_path, "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self._stderr, env=env)
        self.started_at = time.monotonic()
        self.steps: list[tuple[float, int]] = []  # (monotonic time, learner step)
        self.metrics_url: str | None = None
        self.dropped_in_flight = 0  # groups stopped running as stale, from its last status line
        self._reader = threading.Thread(target=self._read, name="soak-daemon-stdout", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            try:
                event = json.loads(raw)
            except ValueError:
                continue
            kind = event.get("event") if isinstance(event, dict) else None
            if kind == "step":
                self.steps.append((time.monotonic(), int(event["step"])))
            elif kind == "status":
                self.dropped_in_flight = int(event.get("groups_dropped_in_flight") or 0)
            elif kind == "message" and "metrics on " in str(event.get("text", "")):
                self.metrics_url = str(event["text"]).split("metrics on ", 1)[1].strip()

    def asyncio_tasks(self) -> int | None:
        """The supervisor's rollwise_supervisor_asyncio_tasks gauge; None when /metrics does not answer."""
        if self.metrics_url is None:
            return None
        try:
            with urllib.request.urlopen(self.metrics_url, timeout=2) as resp:
                text = resp.read().decode()
        except OSError:
            return None
        for line in text.splitlines():
            if line.startswith("rollwise_supervisor_asyncio_tasks "):
                return int(float(line.split()[1]))
        return None

    def close(self, timeout_s: float) -> int:
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self._reader.join(timeout=5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._stderr.close()
        return code


@dataclass
class Life:
    """One process's samples from its first sighting: (seconds since then, rss, fds, threads, tasks,
    anonymous rss)."""

    role: str
    pid: int
    first_seen: float
    points: list[tuple[float, float, float, float, float | None, float]] = field(default_factory=list)


class Soak:
    """The soak's loop and its records (module docstring)."""

    def __init__(self, opts: SoakOptions) -> None:
        self.opts = opts
        self.run = RunDir.at(opts.out / "run")
        self.plan = KillPlan(opts.kill_every_s, opts.seed) if opts.chaos else None
        self.lives: dict[tuple[str, int], Life] = {}
        self.steps: list[tuple[float, int]] = []
        self.kills: list[tuple[float, str, int]] = []  # (seconds since start, target, pid)
        self.starts: list[float] = []
        self.unexpected_exits: list[str] = []
        self.disk: list[tuple[float, dict[str, int]]] = []
        self.t0 = time.monotonic()
        self._events: IO[str] = open(opts.out / "events.jsonl", "a", encoding="utf-8")  # noqa: SIM115
        self._resources: IO[str] = open(opts.out / "resources.jsonl", "a", encoding="utf-8")  # noqa: SIM115
        self.daemon: Daemon | None = None
        self._expected_exit = False
        self.dropped_in_flight = 0  # over the lives that ended (a killed life's last status: up to 5 s old)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def _note(self, **fields: Any) -> None:
        self._events.write(json.dumps({"t": round(self.now(), 2), **fields}) + "\n")
        self._events.flush()

    def _argv(self) -> list[str]:
        argv = [sys.executable, "-m", "pipeline.cli", "run", "--run-dir", str(self.run.root)]
        argv += ["--log-format", "json"]
        if self.opts.config is not None:
            argv += ["--config", self.opts.config]
        overrides = ["metrics.port=0", "engine.port=0", "admin.port=0", *self.opts.overrides]
        if self.opts.chaos:
            overrides += [f'env.name="{CHAOS_ENV}"', f"env.options.fault_rate={self.opts.fault_rate}"]
        for item in overrides:
            argv += ["--set", item]
        return argv

    def _env(self) -> dict[str, str] | None:
        """With --tracemalloc: every process of the daemon reports its allocation growth
        (pipeline.contracts.memory_trace) into out/tracemalloc/."""
        if self.opts.tracemalloc_every_s is None:
            return None
        return {
            **os.environ,
            memory_trace.TRACE_ENV: str((self.opts.out / "tracemalloc").resolve()),
            memory_trace.EVERY_ENV: str(self.opts.tracemalloc_every_s),
            memory_trace.WARMUP_ENV: str(self.opts.warmup_s),
            memory_trace.FRAMES_ENV: str(self.opts.tracemalloc_frames),
        }

    def start_daemon(self) -> None:
        n = len(self.starts) + 1
        self.daemon = Daemon(self._argv(), self.opts.out / f"supervisor-{n}.stderr", self._env())
        self.starts.append(self.now())
        self._note(kind="start", target="supervisor", pid=self.daemon.pid, n=n)

    def reap_daemon(self) -> None:
        """An exited supervisor: keep its steps, note the exit, and start another (init-system style)."""
        daemon = self.daemon
        assert daemon is not None
        code = daemon.close(timeout_s=5)
        self.steps.extend((t - self.t0, s) for t, s in daemon.steps)
        self.dropped_in_flight += daemon.dropped_in_flight
        killed = code == -signal.SIGKILL and self._expected_exit
        if not killed:
            self.unexpected_exits.append(f"supervisor pid {daemon.pid} exited with code {code}")
        self._note(kind="exit", target="supervisor", pid=daemon.pid, code=code, killed=killed)
        self._expected_exit = False
        self.daemon = None
        time.sleep(self.opts.restart_delay_s)
        self.start_daemon()

    def kill(self, target: str) -> bool:
        """SIGKILL the target's process by pid; False when it is not running now (starting, restarting)."""
        assert self.daemon is not None
        if target == "supervisor":
            pid = self.daemon.pid
            self._expected_exit = True
        else:
            pids = [p for p, role in daemon_processes(self.daemon.pid).items() if role == target]
            if not pids:
                return False
            pid = pids[0]
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return False
        self.kills.append((self.now(), target, pid))
        self._note(kind="kill", target=target, pid=pid)
        return True

    def sample(self) -> None:
        assert self.daemon is not None
        t = self.now()
        tasks = self.daemon.asyncio_tasks()
        procs = []
        for pid, role in daemon_processes(self.daemon.pid).items():
            got = sample_process(pid)
            if got is None:
                continue
            life = self.lives.setdefault((role, pid), Life(role, pid, t))
            life_tasks = tasks if role == "supervisor" else None
            life.points.append(
                (t - life.first_seen, got.rss_bytes, got.fds, got.threads, life_tasks, got.anon_bytes)
            )
            procs.append(
                {
                    "role": role,
                    "pid": pid,
                    "rss": got.rss_bytes,
                    "rss_anon": got.anon_bytes,
                    "fds": got.fds,
                    "threads": got.threads,
                }
            )
        sizes = dir_sizes(self.run.root)
        self.disk.append((t, sizes))
        record = {"t": round(t, 2), "procs": procs, "asyncio_tasks": tasks, "run_dir": sizes}
        self._resources.write(json.dumps(record) + "\n")
        self._resources.flush()

    def loop(self) -> None:
        deadline = self.t0 + self.opts.minutes * 60.0
        # The chaos clock starts at the first learner step: kills hit a running system, not a cold start.
        next_kill = float("inf")
        target = self.plan.next_target() if self.plan is not None else ""
        self.start_daemon()
        while time.monotonic() < deadline:
            assert self.daemon is not None
            if self.daemon.proc.poll() is not None:
                self.reap_daemon()
                continue
            if self.plan is not None and next_kill == float("inf") and self.daemon.steps:
                next_kill = time.monotonic() + self.plan.next_delay_s()
            self.sample()
            if self.plan is not None and time.monotonic() >= next_kill and self.kill(target):
                next_kill = time.monotonic() + self.plan.next_delay_s()
                target = self.plan.next_target()
            time.sleep(max(0.0, min(self.opts.sample_s, deadline - time.monotonic())))

    def stop(self) -> int:
        """SIGTERM the daemon and wait for its graceful exit; returns its exit code."""
        assert self.daemon is not None
        if self._expected_exit:
            # The plan SIGKILLed it in the loop's last round: it may not be reaped yet (poll() still None),
            # and a SIGTERM now would find it dying and report its -9 as the final exit.
            self.daemon.proc.wait(timeout=60)
        if self.daemon.proc.poll() is not None:  # killed just before the end: restart it, then stop it
            self.reap_daemon()
        daemon = self.daemon
        assert daemon is not None
        # Its signal handlers are installed before it announces its metrics URL.
        started = time.monotonic()
        while daemon.metrics_url is None and daemon.proc.poll() is None and time.monotonic() - started < 120:
            time.sleep(0.1)
        daemon.proc.send_signal(signal.SIGTERM)
        code = daemon.close(timeout_s=180)
        self.steps.extend((t - self.t0, s) for t, s in daemon.steps)
        self.dropped_in_flight += daemon.dropped_in_flight
        self._note(kind="exit", target="supervisor", pid=daemon.pid, code=code, killed=False, final=True)
        self._events.close()
        self._resources.close()
        return code


# --- the report ----------------------------------------------------------------------------------------
def longest_stalls(
    steps: list[tuple[float, int]], kills: list[float], starts: list[float]
) -> dict[str, float]:
    """Longest gap between learner steps overall, and the longest one with no kill and no daemon start
    inside it (a stall "outside restarts")."""
    times = sorted(t for t, _ in steps)
    worst = quiet = 0.0
    restarts = sorted([*kills, *starts])
    for a, b in itertools.pairwise(times):
        gap = b - a
        worst = max(worst, gap)
        if not any(a < r <= b for r in restarts):
            quiet = max(quiet, gap)
    return {"longest_s": round(worst, 2), "longest_outside_restarts_s": round(quiet, 2)}


def _growth_dict(g: Growth | None) -> dict[str, float] | None:
    if g is None:
        return None
    return {
        "samples": g.samples,
        "span_min": round(g.span_s / 60, 1),
        "first": round(g.first, 1),
        "last": round(g.last, 1),
        "relative": round(g.relative, 4),
        "slope_per_hour": round(g.slope_per_hour, 4),
    }


def life_report(life: Life, warmup_s: float) -> dict[str, Any]:
    columns = {"rss": 1, "fds": 2, "threads": 3, "asyncio_tasks": 4, "rss_anon": 5}
    out: dict[str, Any] = {
        "role": life.role,
        "pid": life.pid,
        "life_min": round(life.points[-1][0] / 60, 1) if life.points else 0.0,
    }
    for name, col in columns.items():
        pts = [(p[0], float(v)) for p in life.points if (v := p[col]) is not None]
        out[name] = _growth_dict(growth(pts, warmup_s)) if pts else None
    return out


def _worst_mib_per_hour(lives: list[dict[str, Any]], column: str) -> float | None:
    """The steepest least-squares slope among `lives` of `column` (bytes), in MiB per hour."""
    slopes = [lv[column]["slope_per_hour"] * lv[column]["first"] / 2**20 for lv in lives if lv.get(column)]
    return round(max(slopes), 2) if slopes else None


def summarise(soak: Soak, books: Books, final_code: int) -> dict[str, Any]:
    opts = soak.opts
    lives = [life_report(life, opts.warmup_s) for life in soak.lives.values()]
    judged = [lv for lv in lives if lv["rss"] is not None]
    by_role: dict[str, Any] = {}
    for role in ("supervisor", "engine", "learner"):
        mine = [lv for lv in judged if lv["role"] == role]
        all_rss = [p[1] for life in soak.lives.values() if life.role == role for p in life.points]
        by_role[role] = {
            "lives": sum(1 for life in soak.lives.values() if life.role == role),
            "lives_judged": len(mine),
            "worst_rss_growth": max((lv["rss"]["relative"] for lv in mine), default=None),
            # The issue-33 goal's unit: MiB an hour, of all resident memory and of its anonymous part.
            "worst_rss_mib_per_hour": _worst_mib_per_hour(mine, "rss"),
            "worst_anon_mib_per_hour": _worst_mib_per_hour(mine, "rss_anon"),
            "peak_rss_mib": round(max(all_rss, default=0) / 2**20, 1),
        }
    worst = [r["worst_rss_growth"] for r in by_role.values() if r["worst_rss_growth"] is not None]
    stalls = longest_stalls(soak.steps, [k[0] for k in soak.kills], soak.starts[1:])
    totals = [(t, sum(sizes.values())) for t, sizes in soak.disk]
    after = [b for t, b in totals if t >= opts.warmup_s]
    bounded_parts = ("spool", "weights", "checkpoints")
    kept = [sum(sizes[p] for p in bounded_parts) for t, sizes in soak.disk if t >= opts.warmup_s]
    kills: dict[str, int] = {}
    for _, target, _ in soak.kills:
        kills[target] = kills.get(target, 0) + 1
    return {
        "minutes": opts.minutes,
        "chaos": opts.chaos,
        "kill_every_s": opts.kill_every_s if opts.chaos else None,
        "fault_rate": opts.fault_rate if opts.chaos else None,
        "warmup_min": round(opts.warmup_s / 60, 2),
        "learner_steps": max((s for _, s in soak.steps), default=0),
        "kills": kills,
        "kills_survived": len(soak.kills),
        "supervisor_starts": len(soak.starts),
        "unexpected_exits": soak.unexpected_exits,
        "final_exit_code": final_code,
        "books": books.as_dict(),
        # Groups stopped while running because the learner had passed their bound: never written, so
        # outside the books; with the written groups dropped stale, the stale share of all groups ended.
        "groups_dropped_in_flight": soak.dropped_in_flight,
        "stale_share": stale_share(books.dropped.get("stale", 0), soak.dropped_in_flight, books.written),
        "stalls": stalls,
        "rss": by_role,
        "goals": {
            "rss_growth_below_5pct": (max(worst) < RSS_GOAL) if worst else None,
            "stall_below_60s_outside_restarts": stalls["longest_outside_restarts_s"] < STALL_GOAL_S,
        },
        "run_dir_mib": {
            "peak": round(max((b for _, b in totals), default=0) / 2**20, 1),
            "final": round(totals[-1][1] / 2**20, 1) if totals else 0.0,
            "retained_parts_after_warmup_min_max": [
                round(min(kept, default=0) / 2**20, 1),
                round(max(kept, default=0) / 2**20, 1),
            ],
            "final_by_part": {
                k: round(v / 2**20, 2) for k, v in (soak.disk[-1][1] if soak.disk else {}).items()
            },
            "after_warmup_samples": len(after),
        },
        "lives": lives,
    }


def plot(soak: Soak, out: Path) -> int:
    from pipeline.tools.report import Panel, Series, render

    def per_life(col: int, scale: float = 1.0) -> list[Series]:
        series = []
        for life in soak.lives.values():
            pts = [(p[0], p[col]) for p in life.points if p[col] is not None]
            if pts:
                series.append(
                    Series(
                        f"{life.role} {life.pid}",
                        [(life.first_seen + t) / 60 for t, _ in pts],
                        [float(v) / scale for _, v in pts],  # type: ignore[arg-type]
                    )
                )
        return series

    disk = []
    for part in ("spool", "weights", "checkpoints", "logs", "other"):
        disk.append(Series(part, [t / 60 for t, _ in soak.disk], [s[part] / 2**20 for _, s in soak.disk]))
    kills = []
    end = soak.now() / 60
    for target in ("engine", "learner", "supervisor"):
        xs, ys = [0.0], [0.0]  # a staircase from the start to the end, so one kill still shows
        for i, t in enumerate(t / 60 for t, who, _ in soak.kills if who == target):
            xs += [t, t]
            ys += [float(i), float(i + 1)]
        kills.append(Series(target, [*xs, end], [*ys, ys[-1]]))
    steps = sorted(soak.steps)
    panels = [
        Panel("RSS (MiB)", "none", per_life(1, 2**20)),
        Panel("Open file descriptors", "none", per_life(2)),
        Panel("Threads", "none", per_life(3)),
        Panel(
            "Supervisor asyncio tasks", "none", [s for s in per_life(4) if s.label.startswith("supervisor")]
        ),
        Panel("Run directory (MiB)", "none", disk),
        Panel(
            "Learner step", "none", [Series("step", [t / 60 for t, _ in steps], [float(s) for _, s in steps])]
        ),
        Panel("Kills (cumulative)", "none", kills),
    ]
    title = f"rollwise soak: {soak.opts.minutes:g} min" + (" with chaos" if soak.opts.chaos else "")
    return render(panels, out, title=title, xlabel="minutes")


def stale_share(dropped_stale: int, dropped_in_flight: int, written: int) -> float | None:
    """Groups lost to staleness (dropped when written, or in flight) over the groups that ended (written,
    or dropped in flight); None before any did."""
    ended = written + dropped_in_flight
    return (dropped_stale + dropped_in_flight) / ended if ended else None


def print_summary(summary: dict[str, Any]) -> None:
    books = summary["books"]
    steps = summary["learner_steps"]
    print(f"soak: {summary['minutes']:g} min, chaos={summary['chaos']}, {steps} learner steps")
    print(
        f"  kills survived: {summary['kills_survived']} {summary['kills']}; supervisor starts: "
        f"{summary['supervisor_starts']}; unexpected exits: {len(summary['unexpected_exits'])}"
    )
    print(
        f"  books: written {books['written']} = trained {books['trained']} + dropped {books['dropped']} + "
        f"quarantined {books['quarantined']} + pending {books['pending']}; trained twice: "
        f"{len(books['trained_twice'])}; "
        + ("BALANCED" if books["ok"] else "NOT BALANCED: " + "; ".join(books["problems"]))
    )
    share = summary["stale_share"]
    print(
        f"  stale: {books['dropped'].get('stale', 0)} dropped when written + "
        f"{summary['groups_dropped_in_flight']} dropped in flight"
        + ("" if share is None else f" = {100 * share:.2f}% of the groups ended")
    )
    for role, r in summary["rss"].items():
        growth_text = "n/a" if r["worst_rss_growth"] is None else f"{100 * r['worst_rss_growth']:+.1f}%"
        slopes = (
            ""
            if r["worst_rss_mib_per_hour"] is None
            else f" ({r['worst_rss_mib_per_hour']:+.1f} MiB/h; anonymous {r['worst_anon_mib_per_hour']:+.1f})"
        )
        print(
            f"  {role:<10} lives {r['lives']} (judged {r['lives_judged']}), worst RSS growth after warm-up "
            f"{growth_text}{slopes}, peak {r['peak_rss_mib']} MiB"
        )
    s = summary["stalls"]
    print(
        f"  longest gap between learner steps: {s['longest_s']} s; "
        f"outside restarts: {s['longest_outside_restarts_s']} s"
    )
    d = summary["run_dir_mib"]
    print(f"  run dir: peak {d['peak']} MiB, final {d['final']} MiB, by part {d['final_by_part']}")
    print(f"  goals: {summary['goals']}")
    print(f"  rollwise doctor: {'; '.join(summary.get('doctor', [])) or 'no finding'}")


def parse_args(argv: list[str]) -> SoakOptions:
    p = argparse.ArgumentParser(prog="rollwise bench soak", description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, required=True, help="how long to run")
    p.add_argument("--chaos", action="store_true", help="SIGKILL children and the supervisor, flaky env")
    p.add_argument("--config", default="examples/guess_number.toml", help="config file (the default task)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    p.add_argument("--out", type=Path, help="output directory (default runs/soak-<time>); must not exist")
    p.add_argument("--kill-every-s", type=float, default=300.0, help="mean seconds between kills (chaos)")
    p.add_argument("--fault-rate", type=float, default=0.03, help="share of env steps that fail (chaos)")
    p.add_argument("--sample-s", type=float, default=5.0, help="seconds between resource samples")
    p.add_argument("--warmup-minutes", type=float, default=10.0, help="growth is judged after this")
    p.add_argument("--restart-delay-s", type=float, default=2.0, help="init-system delay before a restart")
    p.add_argument("--seed", type=int, default=0, help="seed of the kill plan")
    p.add_argument(
        "--tracemalloc",
        type=float,
        metavar="EVERY_S",
        help="every EVERY_S seconds after the warm-up, each process writes its native memory figures "
        "(RSS, malloc in use / free but held, Arrow) and the Python allocation sites that grew since then "
        "to OUT/tracemalloc/<role>-<pid>.txt",
    )
    p.add_argument(
        "--tracemalloc-frames",
        type=int,
        default=8,
        help="frames per traced Python allocation (0: native figures only, no slowdown; default 8)",
    )
    a = p.parse_args(argv)
    if a.minutes <= 0 or a.sample_s <= 0 or a.kill_every_s <= 0 or a.warmup_minutes < 0:
        p.error("--minutes, --sample-s and --kill-every-s must be > 0, --warmup-minutes >= 0")
    if not 0.0 <= a.fault_rate <= 1.0:
        p.error("--fault-rate must be in [0, 1]")
    out = a.out or Path("runs") / time.strftime("soak-%Y%m%d-%H%M%S")
    if out.exists():
        p.error(f"--out {out} exists: a soak starts from a fresh run directory (its books begin at zero)")
    from pipeline.contracts.config import ConfigError, load_config

    try:
        cfg = load_config(a.config, a.set)
    except ConfigError as exc:
        p.error(str(exc))
    if a.chaos and cfg.env.name != "guess-number":
        p.error(f"--chaos wraps the default task (env guess-number), this config runs {cfg.env.name!r}")
    return SoakOptions(
        minutes=a.minutes,
        chaos=a.chaos,
        out=out,
        config=a.config,
        overrides=list(a.set),
        kill_every_s=a.kill_every_s,
        fault_rate=a.fault_rate,
        sample_s=a.sample_s,
        warmup_s=a.warmup_minutes * 60.0,
        restart_delay_s=a.restart_delay_s,
        seed=a.seed,
        tracemalloc_every_s=a.tracemalloc,
        tracemalloc_frames=a.tracemalloc_frames,
    )


def main(argv: list[str]) -> int:
    opts = parse_args(argv)
    opts.out.mkdir(parents=True)
    soak = Soak(opts)
    try:
        soak.loop()
    finally:
        final_code = soak.stop()
    books = reconcile(soak.run)
    if soak.run.consumed_log.exists():  # absent when the learner never finished a step
        shutil.copyfile(soak.run.consumed_log, opts.out / "ledger.jsonl")
    summary = summarise(soak, books, final_code)
    # What the run-health advisor says of the finished run: nothing, for a calm soak of the default task.
    summary["doctor"] = [f"{f.level} {f.check}: {f.title}" for f in ranked(examine(load(soak.run.root)))]
    (opts.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot(soak, opts.out / "soak.png")
    print_summary(summary)
    print(f"wrote {opts.out}/summary.json, soak.png, resources.jsonl, events.jsonl, ledger.jsonl")
    return 0 if books.ok else 1
