"""``rollwise env check NAME``: run an environment under random and gold policies and judge it.

Every criterion in CRITERIA (envs.check_report) is reported by name, pass or fail, with a detail that
names the episode and step at fault. Episodes of a phase run concurrently, each step under
``asyncio.wait_for(spec.step_timeout_s)`` exactly as the runner does. The policies it plays (random,
gold) are in envs.check_policies. An agent environment (envs/agent.py), which is never stepped, plays
the random phase as agent episodes against env check's own endpoint instead (envs.check_agents).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from envs.agent import AgentEnvironment
from envs.api import (
    MESSAGE_ROLES,
    EnvFactory,
    Environment,
    EnvSpec,
    StepResult,
    Task,
    can_fork,
    is_finite_number,
)
from envs.check_agents import check_agent_episodes
from envs.check_policies import Policy, gold_policy_action, random_action
from envs.check_report import (
    CRITERIA,
    TIMEOUTS,
    CheckReport,
    CriterionResult,
    EpisodeRecord,
    Findings,
    SliceTimer,
    aborted,
    awaited,
    check_tasks,
    close_twice,
    collect_leaked_tasks,
    collect_leaked_threads,
    policy_stats,
)

__all__ = ["CRITERIA", "CheckReport", "CriterionResult", "check_env", "format_report", "main"]

RESET_COMPARISONS = 4

# --- one episode ------------------------------------------------------------------------------


def _check_messages(messages: Any, where: str, findings: Findings) -> None:
    if not isinstance(messages, list):
        findings.add(
            "observations_well_formed", f"{where}: messages is {type(messages).__name__}, not a list"
        )
        return
    for index, message in enumerate(messages):
        if (
            not isinstance(message, dict)
            or message.get("role") not in MESSAGE_ROLES
            or not isinstance(message.get("content"), str)
        ):
            findings.add(
                "observations_well_formed", f"{where}: message {index} is malformed: {message!r:.120}"
            )


def _check_result(result: Any, where: str, findings: Findings) -> bool:
    """Record problems with one StepResult; True when the episode ended."""
    if not isinstance(result, StepResult):
        findings.add(
            "observations_well_formed", f"{where}: step returned {type(result).__name__}, not StepResult"
        )
        return True
    _check_messages(result.messages, where, findings)
    if not is_finite_number(result.reward):
        findings.add("rewards_finite", f"{where}: reward {result.reward!r}")
    if result.outcome is not None and not is_finite_number(result.outcome):
        findings.add("rewards_finite", f"{where}: outcome {result.outcome!r}")
    try:
        json.dumps(result.info, allow_nan=False)
    except (TypeError, ValueError) as exc:
        findings.add("info_json_serializable", f"{where}: info {result.info!r:.80} ({exc})")
    return bool(result.done or result.truncated)


async def _run_episode(
    factory: EnvFactory,
    options: dict[str, Any],
    task: Task,
    policy: Policy,
    rng: random.Random,
    episode: EpisodeRecord,
    findings: Findings,
    spec: EnvSpec,
) -> None:
    try:
        env = factory(**options)
    except Exception as exc:
        findings.add("survives_random_actions", f"{episode.label}: factory raised {exc!r}")
        return
    started = time.monotonic()
    where = f"{episode.label} reset"
    try:
        _check_messages(await asyncio.wait_for(env.reset(task), spec.step_timeout_s), where, findings)
        for turn in range(1, spec.max_turns + 1):
            where = f"{episode.label} step {turn}"
            timed_step: SliceTimer[StepResult] = SliceTimer(env.step(policy(env, rng, spec)))
            result = await asyncio.wait_for(awaited(timed_step), spec.step_timeout_s)
            if timed_step.longest_s > spec.step_timeout_s:  # wait_for cannot interrupt a blocked loop
                findings.add(
                    "step_timeout_enforced",
                    f"{where} ran {timed_step.longest_s:.2f}s without yielding (> step_timeout_s="
                    f"{spec.step_timeout_s}): it blocks the event loop (see envs.sync_adapter)",
                )
            episode.turns = turn
            if _check_result(result, where, findings):
                episode.ended, episode.outcome = True, getattr(result, "outcome", None)
                break
        if not episode.ended:
            findings.add(
                "ends_within_max_turns", f"{episode.label}: not done after max_turns={spec.max_turns}"
            )
    except TIMEOUTS:
        findings.add("step_timeout_enforced", f"{where} exceeded step_timeout_s={spec.step_timeout_s}")
    except Exception as exc:
        findings.add("survives_random_actions", f"{where} raised {exc!r}")
    finally:
        await close_twice(env, episode.label, spec.step_timeout_s, findings)
    elapsed = time.monotonic() - started
    if elapsed > spec.episode_timeout_s:
        findings.add(
            "step_timeout_enforced",
            f"{episode.label} took {elapsed:.1f}s > episode_timeout_s={spec.episode_timeout_s}",
        )


async def _run_phase(
    name: str,
    factory: EnvFactory,
    options: dict[str, Any],
    tasks: list[Task],
    policy: Policy,
    seed: int,
    findings: Findings,
    spec: EnvSpec,
) -> list[EpisodeRecord]:
    episodes = [EpisodeRecord(f"{name} episode {i} ({task.id})") for i, task in enumerate(tasks)]
    await asyncio.gather(
        *(
            _run_episode(
                factory, options, task, policy, random.Random(f"{seed}:{name}:{i}"), ep, findings, spec
            )
            for i, (task, ep) in enumerate(zip(tasks, episodes, strict=True))
        )
    )
    return episodes


async def _check_fork(
    factory: EnvFactory, options: dict[str, Any], task: Task, seed: int, findings: Findings, spec: EnvSpec
) -> None:
    """A fork taken after the first turn behaves as its original would (the same actions give the same
    answers), and playing the fork to its end first changes nothing the original answers afterwards."""
    env = factory(**options)
    twin: Environment | None = None
    where = "fork check: reset"
    try:
        await asyncio.wait_for(env.reset(task), spec.step_timeout_s)
        rng = random.Random(f"{seed}:fork")
        where = "fork check: step 1"
        first = await asyncio.wait_for(env.step(random_action(env, rng, spec)), spec.step_timeout_s)
        if first.done or first.truncated:
            findings.notes["forks_independent"] = "the first episode ended after one turn: skipped"
            return
        where = "fork check: fork()"
        twin = await asyncio.wait_for(env.fork(), spec.step_timeout_s)
        actions = [random_action(env, rng, spec) for _ in range(spec.max_turns - 1)]
        answers = []
        for who in (twin, env):  # the fork plays to its end first, then the original
            where = f"fork check: {'the fork' if who is twin else 'the original after the fork'}"
            played = []
            for action in actions:
                result = await asyncio.wait_for(who.step(action), spec.step_timeout_s)
                played.append((result.messages, result.reward, result.done, result.truncated, result.outcome))
                if result.done or result.truncated:
                    break
            answers.append(played)
        if answers[0] != answers[1]:
            turn = next(i for i, (a, b) in enumerate(zip(*answers, strict=False)) if a != b) + 2
            findings.add(
                "forks_independent",
                f"after the same actions the fork and its original answered differently at turn {turn}: "
                "fork() must copy the state, and stepping one must not change the other",
            )
        findings.notes["forks_independent"] = f"fork after turn 1, {len(answers[0])} turns compared"
    except Exception as exc:
        findings.add("forks_independent", f"{where} raised {exc!r}")
    finally:
        for each in (twin, env):
            if each is not None:
                await close_twice(each, "fork check", spec.step_timeout_s, findings)


# --- whole-environment criteria ---------------------------------------------------------------


async def _check_reset(
    factory: EnvFactory, options: dict[str, Any], tasks: list[Task], spec: EnvSpec, findings: Findings
) -> None:
    for task in tasks[:RESET_COMPARISONS]:
        first, second = factory(**options), factory(**options)
        try:
            a = await asyncio.wait_for(first.reset(task), spec.step_timeout_s)
            b = await asyncio.wait_for(second.reset(task), spec.step_timeout_s)
            if a != b:
                findings.add(
                    "deterministic_reset", f"task {task.id}: first observation {a!r:.80} vs {b!r:.80}"
                )
        except TIMEOUTS:
            findings.add("step_timeout_enforced", f"reset of task {task.id} exceeded step_timeout_s")
        except Exception as exc:
            findings.add("deterministic_reset", f"reset of task {task.id} raised {exc!r}")
        finally:
            for env in (first, second):
                await close_twice(env, f"reset probe ({task.id})", spec.step_timeout_s, findings)
    findings.notes["deterministic_reset"] = (
        f"{min(len(tasks), RESET_COMPARISONS)} tasks, same first observation"
    )


async def _has_gold_policy(
    factory: EnvFactory, options: dict[str, Any], task: Task, spec: EnvSpec
) -> tuple[bool, str | None]:
    """Whether the env offers a gold action after reset, and its `gold_unavailable` reason when not."""
    env = factory(**options)
    try:
        await asyncio.wait_for(env.reset(task), spec.step_timeout_s)
        reason = env.gold_unavailable() if hasattr(env, "gold_unavailable") else None
        return env.gold_action() is not None, reason
    except Exception:
        return False, None  # reset failures are reported by the episode phases
    finally:
        with contextlib.suppress(Exception):  # close failures are reported by the episode phases
            await asyncio.wait_for(env.close(), spec.step_timeout_s)


async def _check_stepped(
    factory: EnvFactory,
    options: dict[str, Any],
    probe: Environment,
    tasks: list[Task],
    seed: int,
    findings: Findings,
) -> dict[str, float]:
    """The criteria of a stepped environment (reset, random and gold episodes, fork); policy statistics."""
    spec = probe.spec
    stats: dict[str, float] = {}
    await _check_reset(factory, options, tasks, spec, findings)
    random_eps = await _run_phase("random", factory, options, tasks, random_action, seed, findings, spec)
    stats.update(policy_stats("random", random_eps))
    has_gold, no_gold_reason = await _has_gold_policy(factory, options, tasks[0], spec)
    if has_gold:
        gold_eps = await _run_phase("gold", factory, options, tasks, gold_policy_action, seed, findings, spec)
        stats.update(policy_stats("gold", gold_eps))
        if stats["gold_mean_outcome"] <= 0:
            findings.add(
                "gold_policy_scores", f"gold policy mean outcome {stats['gold_mean_outcome']:.3f} <= 0"
            )
        findings.notes["gold_policy_scores"] = f"gold mean outcome {stats['gold_mean_outcome']:.3f}"
    else:
        why = f": {no_gold_reason}" if no_gold_reason else ""
        findings.notes["gold_policy_scores"] = f"no gold policy (gold_action() is None{why}): skipped"
    if can_fork(probe):
        await _check_fork(factory, options, tasks[0], seed, findings, spec)
    else:
        findings.notes["forks_independent"] = "no fork(): skipped (tree rollouts need it)"
    return stats


async def check_env(
    factory: EnvFactory,
    *,
    episodes: int = 16,
    seed: int = 0,
    options: dict[str, Any] | None = None,
    name: str | None = None,
) -> CheckReport:
    """Judge the environment made by ``factory(**options)`` on ``episodes`` random and gold episodes."""
    if episodes < 1:
        raise ValueError(f"episodes must be >= 1, got {episodes}")
    options = dict(options or {})
    findings = Findings()
    label: str = name or str(getattr(factory, "__name__", repr(factory)))
    try:
        probe = factory(**options)
    except Exception as exc:
        return aborted(label, episodes, seed, f"factory(**{options!r}) failed: {exc!r}")
    spec: Any = getattr(probe, "spec", None)
    if not isinstance(spec, EnvSpec):
        return aborted(label, episodes, seed, f"spec is {type(spec).__name__}, not EnvSpec")
    label = name or spec.name
    for problem in spec.validate():
        findings.add("spec_valid", problem)
    findings.notes["spec_valid"] = f"{spec.name} v{spec.version}, max_turns={spec.max_turns}"

    tasks_before, threads_before = asyncio.all_tasks(), set(threading.enumerate())
    stats: dict[str, float] = {}
    try:
        tasks = await check_tasks(factory, options, probe, episodes, seed, findings)
    except Exception as exc:
        findings.add("deterministic_tasks", f"tasks({seed}) raised {exc!r}")
        tasks = []
    if isinstance(probe, AgentEnvironment):  # its agent holds the conversation: envs.check_agents
        stats = await check_agent_episodes(factory, options, spec, tasks, seed, findings)
    elif tasks:
        stats = await _check_stepped(factory, options, probe, tasks, seed, findings)
    await close_twice(probe, "probe instance", spec.step_timeout_s, findings)
    await collect_leaked_tasks(tasks_before, findings)
    collect_leaked_threads(threads_before, findings)
    return CheckReport(label, episodes, seed, findings.results(), stats)


# --- command line -----------------------------------------------------------------------------


def _parse_option(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"option {text!r} is not KEY=VALUE")
    try:
        return key, json.loads(raw)
    except ValueError:
        return key, raw  # a bare word is a string option


def format_report(report: CheckReport) -> str:
    """The human-readable table printed by ``rollwise env check``."""
    lines = [f"env {report.env}: {report.episodes} episodes per policy, seed {report.seed}"]
    width = max(len(name) for name in CRITERIA)
    for criterion in report.criteria:
        lines.append(
            f"{'PASS' if criterion.passed else 'FAIL'}  {criterion.name.ljust(width)}  {criterion.detail}"
        )
    for policy in ("random", "gold"):
        if f"{policy}_mean_outcome" in report.stats:
            lines.append(
                f"{policy} policy: mean outcome {report.stats[f'{policy}_mean_outcome']:.3f}, "
                f"success {report.stats[f'{policy}_success_rate']:.0%}, "
                f"mean turns {report.stats[f'{policy}_mean_turns']:.2f}"
            )
    failed = [criterion.name for criterion in report.failures()]
    lines.append(f"FAILED: {', '.join(failed)}" if failed else "all criteria passed")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``rollwise env check NAME [--episodes N] [--seed S] [--json] [--option K=V ...]``.

    ``argv`` are the arguments after ``env check`` (a leading ``"check"`` is tolerated). Exit status:
    0 all criteria passed, 1 some failed (each named), 2 the environment could not be resolved.
    """
    from envs.discovery import EnvDiscoveryError, resolve_env

    args_in = list(sys.argv[1:] if argv is None else argv)
    if len(args_in) > 1 and args_in[0] == "check" and not args_in[1].startswith("-"):
        args_in = args_in[1:]
    parser = argparse.ArgumentParser(prog="rollwise env check", description="Check an environment plugin.")
    parser.add_argument("name", help="entry-point name (see `rollwise envs`) or module:attr")
    parser.add_argument("--episodes", type=int, default=16, help="episodes per policy, run concurrently")
    parser.add_argument("--seed", type=int, default=0, help="seed of the task stream and random policy")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--option",
        type=_parse_option,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="factory option (VALUE parsed as JSON when possible); repeatable",
    )
    args = parser.parse_args(args_in)
    if args.episodes < 1:
        parser.error(f"--episodes must be >= 1, got {args.episodes}")
    try:
        factory = resolve_env(args.name)
    except EnvDiscoveryError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    report = asyncio.run(
        check_env(factory, episodes=args.episodes, seed=args.seed, options=dict(args.option), name=args.name)
    )
    print(json.dumps(report.to_dict(), indent=2) if args.json else format_report(report))
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
