"""`rollwise run` on the shipped ReAct agent (examples/react_agent): an agent written against the openai SDK
trains end to end on the tiny preset (episodes through the in-process endpoint, steps, published versions)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from tests.e2e.test_run_e2e import TINY, DaemonRun, daemons

__all__ = ["daemons"]  # a re-exported fixture, used by name

AGENT = [
    "env.name=agent",
    'env.options={ agent = "examples/react_agent/agent.py:react_agent", '
    'tasks = "examples/react_agent/agent.py:tasks", max_turns = 3 }',
    "sampling.max_new_tokens=32",
    "env.max_context_tokens=1024",
    # A random tiny model rarely earns a reward in two steps; the entropy bonus keeps zero-advantage
    # groups in the batch, so every step updates the weights and a version is published.
    "learner.regularizers.entropy_coef=0.01",
]


@pytest.mark.integration
@pytest.mark.slow
def test_react_agent_trains_through_the_openai_endpoint(tmp_path: Path, daemons: list[DaemonRun]) -> None:
    run = DaemonRun(tmp_path / "run", [*TINY, *AGENT])
    daemons.append(run)
    run.wait_steps(2, timeout_s=150)
    # The daemon keeps running while it is read: the turns and episodes come from one scrape, and the
    # requests from a later one (a turn is counted before its reply is sent; reading requests first
    # raced the episodes still running, 24 requests against 32 turns on a loaded CI machine).
    counts = run.scrape()
    turns = run.metric("rollwise_turns_total", {"env": "agent"}, text=counts)
    episodes = run.metric("rollwise_episodes_total", {"env": "agent"}, text=counts)
    trainable = sum(
        run.metric("rollwise_episodes_total", {"env": "agent", "reason": r}, text=counts)
        for r in ("stop", "length", "truncated")
    )
    requests = run.metric("rollwise_openai_requests_total", {"route": "episode", "status": "ok"})
    run.signal(signal.SIGTERM)
    assert run.wait(timeout_s=60) == 0, run.tail()
    assert run.steps()[:2] == [1, 2]
    assert [s["version"] for s in run.snapshot("sync")][:2] == [1, 2]
    assert all(step["tokens"] > 0 for step in run.snapshot("step")[:2])  # agent turns were trained
    # Every turn of an agent episode is one chat completion the endpoint answered and recorded.
    assert requests >= turns > 0 and episodes >= 16
    assert trainable >= 0.9 * episodes, (trainable, episodes)
    config = (tmp_path / "run" / "config.toml").read_text()
    assert 'name = "agent"' in config and json.dumps("examples/react_agent/agent.py:tasks") in config
