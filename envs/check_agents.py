"""``rollwise env check`` on agent environments (envs/agent.py and its subclasses: agent-process commands,
verifiers tasksets): the random phase played as agent episodes against env check's own endpoint
(envs/check_endpoint.py), which answers every chat completion with the random policy.

Per task, all concurrently, with the seeds the stepped path uses: a fresh environment from the factory,
a line of its own to the endpoint, ``env.play(episode, task)`` bounded by ``spec.episode_timeout_s`` as
the run's endpoint bounds it, then ``close()`` twice. What each criterion means here:

- survives_random_actions: the agent run returns (a number or an AgentResult). An exception or an
  AgentFailure fails it (a run would end that episode ``env_error``), its detail naming the endpoint's
  refusals when there were any; so does returning without one chat completion answered, or being
  stopped for ``max_refused_requests`` refused requests in a row (as the run's endpoint stops it). A
  low outcome is the policy's doing, never a failure.
- rewards_finite: the returned outcome is finite (or None), the turn rewards finite and no more of them
  than chat completions answered.
- ends_within_max_turns: the agent asks for at most ``max_turns`` chat completions (the endpoint refuses
  the one past it, as the run's does; what the agent does after that refusal is not reported again).
- info_json_serializable: ``AgentResult.info`` is JSON.
- step_timeout_enforced: the run ends within ``episode_timeout_s`` (an AgentFailure with finish
  "timeout" is the sandbox's own limit acting) and never holds the event loop over ``step_timeout_s``.
- spec_valid, deterministic_tasks, close_idempotent, no_leaked_tasks, no_leaked_threads: as for every
  environment (envs.checker).
- deterministic_reset, observations_well_formed, gold_policy_scores, forks_independent pass with a note
  saying why they do not apply: an agent environment is never reset or stepped, has no gold policy and
  is not forked.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from envs.agent import AgentEnvironment, AgentFailure, as_agent_result
from envs.api import EnvFactory, EnvSpec, Task
from envs.check_endpoint import CheckEndpoint, EndpointEpisode
from envs.check_report import (
    EpisodeRecord,
    Findings,
    SliceTimer,
    awaited,
    close_twice,
    policy_stats,
)

SKIPPED = {
    "deterministic_reset": "agent environment (never reset: its agent holds the conversation): skipped",
    "observations_well_formed": "agent environment (its agent writes the messages): skipped",
    "gold_policy_scores": "agent environment (no gold policy): skipped",
    "forks_independent": "agent environment (an agent run is not forked): skipped",
}


async def check_agent_episodes(
    factory: EnvFactory,
    options: dict[str, Any],
    spec: EnvSpec,
    tasks: list[Task],
    seed: int,
    findings: Findings,
) -> dict[str, float]:
    """Play one random-policy agent episode per task (module docstring), recording problems in
    ``findings``; returns the random policy's statistics (none without tasks)."""
    findings.notes.update(SKIPPED)
    if not tasks:
        return {}
    records = [EpisodeRecord(f"random episode {i} ({task.id})") for i, task in enumerate(tasks)]
    per_episode = [Findings() for _ in tasks]  # merged in episode order: the report does not race
    endpoint = CheckEndpoint()
    await endpoint.start()
    try:
        durations = await asyncio.gather(
            *(
                _run_agent_episode(factory, options, task, i, seed, endpoint, ep, found, spec)
                for i, (task, ep, found) in enumerate(zip(tasks, records, per_episode, strict=True))
            )
        )
    finally:
        await endpoint.close()
        for found in per_episode:
            findings.extend(found)
    findings.notes["survives_random_actions"] = (
        f"{len(records)} agent episodes against env check's random-policy endpoint"
    )
    findings.notes["ends_within_max_turns"] = (
        f"at most {max(ep.turns for ep in records)} chat completions per episode (max_turns={spec.max_turns})"
    )
    findings.notes["step_timeout_enforced"] = (
        f"longest agent run {max(durations):.1f}s (episode_timeout_s={spec.episode_timeout_s})"
    )
    return policy_stats("random", records)


async def _run_agent_episode(
    factory: EnvFactory,
    options: dict[str, Any],
    task: Task,
    index: int,
    seed: int,
    endpoint: CheckEndpoint,
    record: EpisodeRecord,
    findings: Findings,
    spec: EnvSpec,
) -> float:
    """Episode ``index`` of the check seeded ``seed``; its duration in seconds (0 when it could not
    start)."""
    try:
        env = factory(**options)
    except Exception as exc:
        findings.add("survives_random_actions", f"{record.label}: factory raised {exc!r}")
        return 0.0
    if not isinstance(env, AgentEnvironment):
        findings.add(
            "survives_random_actions",
            f"{record.label}: the factory made a {type(env).__name__}, not an agent",
        )
        await close_twice(env, record.label, spec.step_timeout_s, findings)
        return 0.0
    line, episode = endpoint.open(env, f"check-random-{index}", f"{seed}:random:{index}")
    started = time.monotonic()
    try:
        timer = SliceTimer(env.play(episode, task), "play()")
    except Exception as exc:  # play() is not async def, or raised before its first await
        findings.add("survives_random_actions", f"{record.label}: calling play() raised {exc!r}")
        await close_twice(env, record.label, spec.step_timeout_s, findings)
        return 0.0
    agent = asyncio.ensure_future(awaited(timer))
    line.stop_agent = agent.cancel
    timed_out = False
    try:
        async with asyncio.timeout(spec.episode_timeout_s):
            await asyncio.wait({agent})  # unlike `await agent`, never cancels it on our behalf
    except TimeoutError:
        timed_out = True
    finally:
        line.stop_agent = None
        await _stop(agent, spec.step_timeout_s)
        await endpoint.end(line)
        await close_twice(env, record.label, spec.step_timeout_s, findings)
    elapsed = time.monotonic() - started
    record.turns = line.requests
    if timer.longest_s > spec.step_timeout_s:
        findings.add(
            "step_timeout_enforced",
            f"{record.label}: the agent ran {timer.longest_s:.2f}s without yielding (> step_timeout_s="
            f"{spec.step_timeout_s}): it blocks the event loop (run blocking work with asyncio.to_thread)",
        )
    if line.past_max_turns is not None:
        findings.add(
            "ends_within_max_turns",
            f"{record.label}: the agent asked for chat completion {line.past_max_turns} > "
            f"max_turns={spec.max_turns}",
        )
    if timed_out or elapsed > spec.episode_timeout_s:
        findings.add(
            "step_timeout_enforced",
            f"{record.label}: the episode took {elapsed:.1f}s > episode_timeout_s={spec.episode_timeout_s}",
        )
    else:
        _judge(agent, line, record, findings)
    return elapsed


async def _stop(agent: asyncio.Future[object], grace_s: float) -> None:
    """Cancel a run still going and give it ``grace_s`` to clean up (a process is killed and reaped); one
    that ignores cancellation is left to the leaked-task check."""
    if agent.done():
        return
    agent.cancel()
    await asyncio.wait({agent}, timeout=grace_s)


def _judge(
    agent: asyncio.Future[object],
    line: EndpointEpisode,
    record: EpisodeRecord,
    findings: Findings,
) -> None:
    """Record what a finished agent run got wrong (module docstring); the turn limit and the timeout are
    judged before."""
    label = record.label
    refused = f" (the endpoint refused {len(line.refusals)}: {line.refusals[0]})" if line.refusals else ""
    if agent.cancelled():  # the endpoint stopped it: it looped on refused requests
        if line.past_max_turns is None:
            findings.add(
                "survives_random_actions",
                f"{label}: the agent was stopped after {line.refused_in_a_row} refused requests in a row"
                f"{refused}",
            )
        return
    exc = agent.exception()
    if isinstance(exc, AgentFailure) and exc.finish == "timeout":
        findings.add("step_timeout_enforced", f"{label}: {exc}")
        return
    if exc is not None:
        if line.past_max_turns is None:  # after the turn limit's refusal it is that refusal's consequence
            what = f"failed ({exc.reason}): {exc}" if isinstance(exc, AgentFailure) else f"raised {exc!r}"
            findings.add("survives_random_actions", f"{label}: the agent {what}{refused}")
        return
    try:
        result = as_agent_result(agent.result())
    except ValueError as err:
        findings.add("rewards_finite", f"{label}: {err}")
        return
    record.ended, record.outcome = True, result.outcome
    if len(result.turn_rewards) > line.requests:
        findings.add(
            "rewards_finite",
            f"{label}: AgentResult.turn_rewards has {len(result.turn_rewards)} entries for "
            f"{line.requests} chat completions",
        )
    if line.requests == 0 and line.past_max_turns is None:
        findings.add(
            "survives_random_actions", f"{label}: the agent returned without a chat completion{refused}"
        )
    try:
        json.dumps(result.info, allow_nan=False)
    except (TypeError, ValueError) as err:
        findings.add("info_json_serializable", f"{label}: info {result.info!r:.80} ({err})")
