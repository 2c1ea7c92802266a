"""Tree rollouts (pipeline.supervisor.actors.tree_rollout) against the SGLang fake over real HTTP, with the
real tiny ChatML tokenizer: the trunk's turns are generated once, every branch's rows hold them verbatim,
and each branch continues in its own fork of the environment."""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator
from typing import Any

import pytest

from envs.api import Action, EnvError, StepResult, can_fork
from envs.calculator import CalculatorEnv
from envs.guess_number import GuessNumberEnv
from pipeline.contracts.schema import validate_segment
from pipeline.supervisor.actors.late_cut import GroupCut
from pipeline.supervisor.actors.tree_rollout import run_tree_group
from pipeline.supervisor.engines.client import EngineClient
from pipeline.supervisor.engines.pool import EnginePool
from pipeline.supervisor.observability.metrics import REGISTRY
from pipeline.tools.fake_sglang import FakeSGLang, Plan
from tests.supervisor.actors.test_rollout import (
    TASK,
    ScriptedEnv,
    enc,
    env_errors,
    reply_ids,
    scripted,
    settings,
)


@pytest.fixture
async def pool(fake: FakeSGLang) -> AsyncIterator[EnginePool]:
    engines = EnginePool([EngineClient(fake.base_url, retries=0)])
    yield engines
    await engines.close()


class ForkingEnv(ScriptedEnv):
    """ScriptedEnv whose fork copies its position and its record of actions; `broken_forks` forks fail."""

    forks = 0
    broken_forks: tuple[int, ...] = ()
    made: list[ForkingEnv]

    async def fork(self) -> ForkingEnv:
        type(self).forks += 1
        if type(self).forks in self.broken_forks:
            raise EnvError("no space left for a snapshot")
        twin = copy.copy(self)
        twin.actions = list(self.actions)
        twin.closed = 0
        self.made.append(twin)
        return twin


def tree_counter(env: str, shape: str) -> float:
    return REGISTRY.get_sample_value("rollwise_tree_groups_total", {"env": env, "shape": shape}) or 0.0


def shared_tokens(env: str) -> float:
    return REGISTRY.get_sample_value("rollwise_tree_shared_tokens_total", {"env": env}) or 0.0


def forking_factory(replies: list[str], broken: tuple[int, ...] = ()) -> tuple[Any, list[ForkingEnv]]:
    made: list[ForkingEnv] = []

    class Env(ForkingEnv):
        forks = 0
        broken_forks = broken

    def factory() -> ForkingEnv:
        env = Env(replies)
        env.made = made
        made.append(env)
        return env

    return factory, made


async def test_branches_share_the_trunks_turns_and_continue_in_their_own_forks(
    fake: FakeSGLang, pool: EnginePool, tok: Any
) -> None:
    eos = tok.eos_token_id
    trunk0 = [*enc(tok, "8"), eos]
    last = {i: [*enc(tok, f"answer {i}"), eos] for i in range(3)}
    plans = {"g-0-t0": Plan(trunk0, [-0.5, -0.25])}
    plans.update({f"g-{i}-t1": Plan(last[i]) for i in range(3)})
    fake.script = scripted(plans)
    factory, made = forking_factory(["higher"])
    before_branched, before_shared = tree_counter("tree", "branched"), shared_tokens("tree")
    cut = GroupCut(3)

    outcome = await run_tree_group(
        pool,
        tok,
        factory,
        TASK,
        settings(tok),
        group_size=3,
        group_id="g",
        env_name="tree",
        branch_turn=1,
        cut=cut,
    )

    assert [e.episode_id for e in outcome.episodes] == ["g-0", "g-1", "g-2"]
    assert all(e.finish_reason == "stop" and e.outcome == 1.0 for e in outcome.episodes)
    # One request for the shared turn, one per episode for its own.
    assert sorted(r["rid"] for r in fake.generate_requests()) == ["g-0-t0", "g-0-t1", "g-1-t1", "g-2-t1"]
    prompt = enc(tok, "<|im_start|>user\nGuess my number from 1 to 16.<|im_end|>\n<|im_start|>assistant\n")
    trunk_tokens = prompt + trunk0 + reply_ids(tok, "higher")
    for i, episode in enumerate(outcome.episodes):
        [row] = episode.rows
        assert validate_segment(row) is None
        assert row.token_ids == trunk_tokens + last[i]
        generated = [lp for lp, m in zip(row.logprobs, row.loss_mask, strict=True) if m][: len(trunk0)]
        assert generated == [-0.5, -0.25]  # the trunk's log-probs, verbatim, in every branch
        assert episode.turn_rewards == [0.0, 0.0]
    assert [e.generated_tokens for e in outcome.episodes] == [
        len(trunk0) + len(last[0]),
        len(last[1]),
        len(last[2]),
    ]
    # Each fork saw the trunk's first action, then only its own.
    assert len(made) == 3
    assert [[a.text for a in env.actions] for env in made] == [
        ["8", "answer 0"],
        ["8", "answer 1"],
        ["8", "answer 2"],
    ]
    assert [env.closed for env in made] == [1, 1, 1]
    assert cut.finished == 3
    assert tree_counter("tree", "branched") == before_branched + 1
    assert shared_tokens("tree") == before_shared + 2 * len(trunk0)


async def test_a_trunk_that_ends_before_the_branch_turn_leaves_the_others_to_play_whole(
    fake: FakeSGLang, pool: EnginePool, tok: Any
) -> None:
    eos = tok.eos_token_id
    fake.script = scripted({f"g-{i}-t0": Plan([*enc(tok, str(i)), eos]) for i in range(3)})
    factory, made = forking_factory([])  # the first step ends the episode
    before = tree_counter("tree-whole", "whole")

    outcome = await run_tree_group(
        pool,
        tok,
        factory,
        TASK,
        settings(tok),
        group_size=3,
        group_id="g",
        env_name="tree-whole",
        branch_turn=2,
    )

    assert [e.finish_reason for e in outcome.episodes] == ["stop", "stop", "stop"]
    assert sorted(r["rid"] for r in fake.generate_requests()) == ["g-0-t0", "g-1-t0", "g-2-t0"]
    assert len(made) == 3 and all(len(env.actions) == 1 for env in made)  # three fresh environments
    assert tree_counter("tree-whole", "whole") == before + 1


async def test_a_fork_that_fails_costs_its_branch_only(fake: FakeSGLang, pool: EnginePool, tok: Any) -> None:
    eos = tok.eos_token_id
    plans = {"g-0-t0": Plan([*enc(tok, "8"), eos])}
    plans.update({f"g-{i}-t1": Plan([*enc(tok, "9"), eos]) for i in range(3)})
    fake.script = scripted(plans)
    factory, _ = forking_factory(["higher"], broken=(1,))
    before = env_errors("tree-broken", "error")

    outcome = await run_tree_group(
        pool,
        tok,
        factory,
        TASK,
        settings(tok),
        group_size=3,
        group_id="g",
        env_name="tree-broken",
        branch_turn=1,
    )

    assert [e.finish_reason for e in outcome.episodes] == ["stop", "env_error", "stop"]
    failed = outcome.episodes[1]
    assert failed.rows == [] and "env.fork raised EnvError('no space left for a snapshot')" in (
        failed.error or ""
    )
    assert env_errors("tree-broken", "error") == before + 1


async def test_a_tree_needs_at_least_one_shared_turn(pool: EnginePool, tok: Any) -> None:
    factory, _ = forking_factory([])
    with pytest.raises(ValueError, match="branch_turn must be >= 1"):
        await run_tree_group(
            pool, tok, factory, TASK, settings(tok), group_size=2, group_id="g", env_name="x", branch_turn=0
        )


async def test_guess_number_forks_into_independent_games() -> None:
    env = GuessNumberEnv()
    task = next(env.tasks(3))
    await env.reset(task)
    await env.step(Action(text="8"))
    twin = await env.fork()
    assert can_fork(env) and not can_fork(CalculatorEnv())
    secret = env._secret
    solved = await twin.step(Action(text=str(secret)))
    assert solved.done and solved.outcome == 1.0
    other: StepResult = await env.step(Action(text=str(secret + 1 if secret < 16 else secret - 1)))
    assert not other.done  # the twin's win changed nothing here
    assert (env._turns, twin._turns) == (2, 2)
