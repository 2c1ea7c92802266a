"""The episode and group runners against the SGLang fake over real HTTP (EngineClient + EnginePool),
with the real tiny ChatML tokenizer."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from envs.api import Action, EnvError, Environment, EnvSpec, Message, StepResult, Task, ToolCall
from pipeline.contracts.schema import batch_to_segments, validate_segment
from pipeline.supervisor.actors.episode_metrics import budget_cut
from pipeline.supervisor.actors.rollout import (
    EpisodeOutcome,
    GroupOutcome,
    RolloutSettings,
    run_episode,
    run_group,
)
from pipeline.supervisor.engines.client import EngineClient
from pipeline.supervisor.engines.pool import EnginePool
from pipeline.supervisor.engines.protocol import GenerateResult, SamplingParams
from pipeline.supervisor.observability.metrics import REGISTRY
from pipeline.tools.fake_sglang import FakeSGLang, GenerateCall, Plan

# Qwen3-style: earlier assistant turns lose their <think></think> block when the history is rendered.
STRIP_THINK_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- set content = message.content %}"
    "{%- if message.role == 'assistant' and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
TASK = Task(id="task-0", seed=7, data={})
FIRST_USER = "Guess my number from 1 to 16."


@pytest.fixture(scope="module")
def tokenizer_dir(tiny_tokenizer_dir: Path) -> Path:
    return tiny_tokenizer_dir


@pytest.fixture
async def pool(fake: FakeSGLang) -> AsyncIterator[EnginePool]:
    engines = EnginePool([EngineClient(fake.base_url, retries=0)])
    yield engines
    await engines.close()


def enc(tok: Any, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def reply_ids(tok: Any, text: str) -> list[int]:
    """The tokens ChatML appends after an assistant turn that ended with <|im_end|>."""
    return enc(tok, f"\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")


def scripted(plans: dict[str, Plan], on_call: Callable[[GenerateCall], None] | None = None) -> Any:
    def script(call: GenerateCall) -> Plan:
        if on_call is not None:
            on_call(call)
        if call.rid not in plans:
            raise AssertionError(f"no scripted plan for rid {call.rid!r}")
        return plans[call.rid]

    return script


def settings(tok: Any, **kwargs: Any) -> RolloutSettings:
    sampling = SamplingParams(max_new_tokens=kwargs.pop("max_new_tokens", 16))
    return RolloutSettings(
        sampling=sampling, max_context_tokens=kwargs.pop("max_context_tokens", 512), **kwargs
    )


def episodes_counter(env: str, reason: str) -> float:
    return REGISTRY.get_sample_value("rollwise_episodes_total", {"env": env, "reason": reason}) or 0.0


def env_errors(env: str, kind: str) -> float:
    return REGISTRY.get_sample_value("rollwise_env_errors_total", {"env": env, "kind": kind}) or 0.0


def engine_errors(kind: str) -> float:
    return REGISTRY.get_sample_value("rollwise_engine_errors_total", {"engine": "pool", "kind": kind}) or 0.0


class ScriptedEnv(Environment):
    """Answers step k with replies[k] (a user message, reward rewards[k]); the step after the last reply
    ends the episode (done, outcome 1.0) unless `truncate_at_end`. Hooks make it slow or failing."""

    def __init__(
        self,
        replies: list[str],
        *,
        rewards: list[float] | None = None,
        max_turns: int = 8,
        step_timeout_s: float = 5.0,
        episode_timeout_s: float = 30.0,
        step_delay_s: float = 0.0,
        fail_on_step: int | None = None,
        fail_on_reset: bool = False,
        truncate_at_end: bool = False,
        tools: tuple[dict[str, Any], ...] = (),
    ) -> None:
        self.spec = EnvSpec(
            name="scripted",
            version="1",
            max_turns=max_turns,
            step_timeout_s=step_timeout_s,
            episode_timeout_s=episode_timeout_s,
            tools=tools,
        )
        self.replies = replies
        self.rewards = rewards or [0.0] * (len(replies) + 1)
        self.step_delay_s = step_delay_s
        self.fail_on_step = fail_on_step
        self.fail_on_reset = fail_on_reset
        self.truncate_at_end = truncate_at_end
        self.actions: list[Action] = []
        self.stepping = asyncio.Event()
        self.closed = 0

    def tasks(self, seed: int) -> Iterator[Task]:
        yield TASK

    async def reset(self, task: Task) -> list[Message]:
        if self.fail_on_reset:
            raise EnvError("reset failed on purpose")
        return [{"role": "user", "content": FIRST_USER}]

    async def step(self, action: Action) -> StepResult:
        k = len(self.actions)
        self.actions.append(action)
        self.stepping.set()
        if self.step_delay_s:
            await asyncio.sleep(self.step_delay_s)
        if k == self.fail_on_step:
            raise EnvError(f"step {k} failed on purpose")
        reward = self.rewards[k]
        if k < len(self.replies):
            return StepResult([{"role": "user", "content": self.replies[k]}], reward=reward)
        if self.truncate_at_end:
            return StepResult(
                [{"role": "user", "content": "out of turns"}], reward, truncated=True, outcome=0.0
            )
        return StepResult([{"role": "user", "content": "correct"}], reward=reward, done=True, outcome=1.0)

    async def close(self) -> None:
        self.closed += 1


async def play(
    pool: EnginePool, tok: Any, env: Environment, rollout: RolloutSettings, env_name: str = "scripted"
) -> EpisodeOutcome:
    return await run_episode(pool, tok, env, TASK, rollout, episode_id="ep", group_id="g", env_name=env_name)


async def test_three_turn_episode_keeps_an_exact_token_buffer(
    fake: FakeSGLang, pool: EnginePool, tok: Any
) -> None:
    eos = tok.eos_token_id
    outs = [[*enc(tok, "8"), eos], [*enc(tok, "I say 12"), eos], [*enc(tok, "10"), eos]]
    lps = [[-0.5, -0.25], [-1.0, -0.5, -0.125, -0.75, -0.375], [-2.0, -0.0625]]
    assert [len(o) for o in outs] == [len(lp) for lp in lps]
    fake.script = scripted({f"ep-t{k}": Plan(outs[k], lps[k]) for k in range(3)})
    env = ScriptedEnv(["higher", "lower"], rewards=[0.0, -0.5, 1.0])
    before = episodes_counter("scripted-exact", "stop")

    result = await play(pool, tok, env, settings(tok), env_name="scripted-exact")

    assert result.finish_reason == "stop" and result.error is None
    assert result.turn_rewards == [0.0, -0.5, 1.0] and result.outcome == 1.0
    prompt = enc(tok, f"<|im_start|>user\n{FIRST_USER}<|im_end|>\n<|im_start|>assistant\n")
    env1, env2 = reply_ids(tok, "higher"), reply_ids(tok, "lower")
    [row] = result.rows
    assert row.token_ids == prompt + outs[0] + env1 + outs[1] + env2 + outs[2]
    assert row.prompt_len == len(prompt)
    pieces: list[tuple[list[int], int, int]] = [  # (ids, mask, turn)
        (prompt, 0, -1),
        (outs[0], 1, 0),
        (env1, 0, 0),
        (outs[1], 1, 1),
        (env2, 0, 1),
        (outs[2], 1, 2),
    ]
    assert row.loss_mask == [m for ids, m, _ in pieces for _ in ids]
    assert row.turn_index == [t for ids, _, t in pieces for _ in ids]
    gen_logprobs = [lp for turn in lps for lp in turn]
    assert [lp for lp, m in zip(row.logprobs, row.loss_mask, strict=True) if m] == gen_logprobs
    assert all(lp == 0.0 for lp, m in zip(row.logprobs, row.loss_mask, strict=True) if not m)
    assert row.versions == [0 if m else -1 for m in row.loss_mask]
    assert (row.num_turns, row.segment, row.finish_reason) == (3, 0, "stop")
    assert validate_segment(row) is None
    assert [a.text for a in env.actions] == ["8", "I say 12", "10"]  # stop token removed
    assert env.closed == 1
    # Every request sent exactly the buffer so far, with the episode's rid and stop token.
    sent = fake.generate_requests()
    assert [r["rid"] for r in sent] == ["ep-t0", "ep-t1", "ep-t2"]
    assert sent[0]["input_ids"] == prompt
    assert sent[1]["input_ids"] == prompt + outs[0] + env1
    assert sent[2]["input_ids"] == prompt + outs[0] + env1 + outs[1] + env2
    assert all(r["sampling_params"]["stop_token_ids"] == [eos] for r in sent)
    assert all(r["sampling_params"]["max_new_tokens"] == 16 for r in sent)
    assert episodes_counter("scripted-exact", "stop") == before + 1
    assert len(result.turn_seconds) == len(result.engine_seconds) == 3
    # Prefill books: every turn sends its whole context; the engine's radix cache holds what it saw
    # (prompt and reply) the turn before, so only the env's reply and the new prompt are prefilled.
    labels = {"env": "scripted-exact"}
    assert REGISTRY.get_sample_value("rollwise_prompt_tokens_total", labels) == sum(
        len(r["input_ids"]) for r in sent
    )
    cached = 0 + len(prompt + outs[0]) + len(prompt + outs[0] + env1 + outs[1])
    assert REGISTRY.get_sample_value("rollwise_prompt_tokens_cached_total", labels) == cached


async def test_tokens_carry_the_weight_version_that_produced_them(
    fake: FakeSGLang, pool: EnginePool, tok: Any
) -> None:
    eos = tok.eos_token_id
    outs = {f"ep-t{k}": Plan([*enc(tok, str(k + 5)), eos]) for k in range(3)}

    def update_before_turn_1(call: GenerateCall) -> None:
        if call.rid == "ep-t1":
            fake.weight_version = "3"  # a weight update landed between turn 0 and turn 1

    fake.script = scripted(outs, update_before_turn_1)
    result = await play(pool, tok, ScriptedEnv(["higher", "lower"]), settings(tok))
    [row] = result.rows
    by_turn = {
        t: {v for v, tt, m in zip(row.versions, row.turn_index, row.loss_mask, strict=True) if tt == t and m}
        for t in range(3)
    }
    assert by_turn == {0: {0}, 1: {3}, 2: {3}}
    assert validate_segment(row) is None


async def test_per_token_versions_are_used_when_the_engine_reports_them(
    fake: FakeSGLang, pool: EnginePool, tok: Any
) -> None:
    eos = tok.eos_token_id
    out = [*enc(tok, "I say 12 or 13"), eos]
    fake.script = scripted({"ep-t0": Plan(out)})
    fake.report_token_versions, fake.token_delay_s = True, 0.05
    episode = asyncio.create_task(play(pool, tok, ScriptedEnv([]), settings(tok)))
    await fake.wait_running(1)
    await asyncio.sleep(0.12)  # an in-place weight update lands while the turn is being decoded
    fake.weight_version = "2"
    result = await episode
    [row] = result.rows
    generated = [v for v, m in zip(row.versions, row.loss_mask, strict=True) if m]
    assert len(generated) == len(out) and generated == sorted(generated)
    assert generated[0] == 0 and generated[-1] == 2


async def test_template_that_rewrites_history_starts_a_new_segment(
    fake: FakeSGLang, pool: EnginePool, tokenizer_dir: Path
) -> None:
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.chat_template = STRIP_THINK_TEMPLATE
    eos = tok.eos_token_id
    first = [*enc(tok, "<think>\nhalf of 16\n</think>\n8"), eos]
    second = [*enc(tok, "12"), eos]
    fake.script = scripted({"ep-t0": Plan(first), "ep-t1": Plan(second)})
    result = await play(pool, tok, ScriptedEnv(["higher"]), settings(tok))

    assert result.finish_reason == "stop" and result.num_segments == 2
    seg0, seg1 = result.rows
    prompt = enc(tok, f"<|im_start|>user\n{FIRST_USER}<|im_end|>\n<|im_start|>assistant\n")
    assert seg0.token_ids == prompt + first  # kept, never rewritten
    restarted = enc(
        tok,
        f"<|im_start|>user\n{FIRST_USER}<|im_end|>\n<|im_start|>assistant\n8<|im_end|>\n"
        "<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n",
    )
    assert fake.generate_requests()[1]["input_ids"] == restarted
    assert seg1.token_ids == restarted + second and seg1.prompt_len == len(restarted)
    assert (seg0.segment, seg1.segment) == (0, 1)
    assert seg0.turn_rewards == seg1.turn_rewards and seg0.num_turns == seg1.num_turns == 2
    assert [validate_segment(r) for r in result.rows] == [None, None]
    group = GroupOutcome(group_id="g", task_id=TASK.id, env="scripted", episodes=[result])
    episodes, rejected = batch_to_segments(group.to_record_batch())  # both rows travel in one batch
    assert rejected == [] and [e.segment for e in episodes] == [0, 1]


async def test_tool_calls_reach_the_env_parsed(fake: FakeSGLang, pool: EnginePool, tok: Any) -> None:
    eos = tok.eos_token_id
    call_text = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    out = [*enc(tok, call_text), eos]
    assert enc(tok, "<tool_call>")[0] in out  # the tag is one added token
    fake.script = scripted({"ep-t0": Plan(out)})
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    env = ScriptedEnv([], tools=(tool,))
    result = await play(pool, tok, env, settings(tok))
    assert result.finish_reason == "stop"
    assert env.actions == [Action(text=call_text, tool_calls=(ToolCall("add", {"a": 1, "b": 2}),))]
    assert '"name": "add"' in tok.decode(fake.generate_requests()[0]["input_ids"])  # tools in the prompt


async def test_none_parser_and_system_prompt(fake: FakeSGLang, pool: EnginePool, tok: Any) -> None:
    eos = tok.eos_token_id
    call_text = '<tool_call>{"name": "add", "arguments": {}}</tool_call>'
    fake.script = scripted({"ep-t0": Plan([*enc(tok, call_text), eos])})
    env = ScriptedEnv([])
    await play(pool, tok, env, settings(tok, tool_parser="none", system_prompt="Be brief."))
    assert env.actions == [Action(text=call_text)]
    prompt = fake.generate_requests()[0]["input_ids"]
    assert prompt == enc(
        tok,
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        f"<|im_start|>user\n{FIRST_USER}<|im_end|>\n<|im_start|>assistant\n",
    )


def test_unknown_tool_parser_is_a_settings_error(tok: Any) -> None:
    with pytest.raises(ValueError, match="unknown tool-call parser 'json'"):
        settings(tok, tool_parser="json")


async def test_step_timeout_ends_the_episode_as_timeout(fake: FakeSGLang, pool: EnginePool, tok: Any) -> None:
    eos = tok.eos_token_id
    fake.script = scripted({"ep-t0": Plan([*enc(tok, "8"), eos])})
    env = ScriptedEnv(["higher"], step_timeout_s=0.05, step_delay_s=5.0)
    before = env_errors("scripted-slow", "timeout")
    result = await play(pool, tok, env, settings(tok), env_name="scripted-slow")
    assert result.finish_reason == "timeout"
    assert "step_timeout_s=0.05" in (result.error or "")
    assert env.closed == 1
    assert env_errors("scripted-slow", "timeout") == before + 1
    [row] = result.rows
    assert row.num_turns == 1 and row.turn_rewards == [0.0] and validate_segment(row) is None


async def test_episode_timeout_ends_the_episode_as_timeout(
    fake: FakeSGLang, pool: EnginePool, tok: Any
) -> None:
    eos = tok.eos_token_id
    fake.script = scripted({f"ep-t{k}": Plan([*enc(tok, "8"), eos]) for k in range(20)})
    env = ScriptedEnv(["higher"] * 19, max_turns=20, episode_timeout_s=0.2, step_delay_s=0.05)
    result = await play(pool, tok, env, settings(tok))
    assert result.finish_reason == "timeout"
    assert "episode_timeout_s=0.2" in (result.error or "")
    assert env.closed == 1
    assert 1 <= result.num_turns < 20
    assert all(validate_segment(r) is None for r in result.rows)


async def test_an_episode_that_times_out_mid_generation_aborts_its_engine_request(
    fake: FakeSGLang, pool: EnginePool, tok: Any
) -> None:
    # A long generation (1000 tokens, 10 ms each) cut by the episode timeout: the server must be told to
    # stop decoding that rid, not left to finish ten seconds of work for nobody.
    fake.script = scripted({"ep-t0": Plan(list(range(10, 1010)), finish="length")})
    fake.token_delay_s = 0.01
    env = ScriptedEnv(["higher"], episode_timeout_s=0.3)
    aborts_before = REGISTRY.get_sample_value("rollwise_engine_aborts_total", {"reason": "cancelled"}) or 0.0
    result = await play(pool, tok, env, settings(tok, max_new_tokens=1000))
    assert result.finish_reason == "timeout"
    await fake.wait_idle(5.0)
    assert fake.running_rids == [], "the engine still decodes the timed-out episode's request"
    aborts = [r.json() for r in fake.requests if r.path == "/abort_request"]
    assert aborts == [{"rid": "ep-t0"}]
    after = REGISTRY.get_sample_value("rollwise_engine_aborts_total", {"reason": "cancelled"})
    assert after == aborts_before + 1


async def test_env_raising_gives_env_error_and_close_is_awaited(
    fake: FakeSGLang, pool: EnginePool, tok: Any
) -> None:
    eos = tok.eos_token_id
    fake.script = scripted({f"ep-t{k}": Plan([*enc(tok, "8"), eos]) for k in range(2)})
    env = ScriptedEnv(["higher", "lower"], fail_on_step=1)
    before = env_errors("scripted-err", "error")
    in_flight = REGISTRY.get_sample_value("rollwise_episodes_in_flight")
    result = await play(pool, tok, env, settings(tok), env_name="scripted-err")
    assert REGISTRY.get_sample_value("rollwise_episodes_in_flight") == in_flight
    assert result.finish_reason == "env_error"
    assert "step 1 failed on purpose" in (result.error or "")
    assert env.closed == 1 and env_errors("scripted-err", "error") == before + 1
    [row] = result.rows
    assert row.num_turns == 2 and validate_segment(row) is None and not result.trainable


class BadReplyEnv(ScriptedEnv):
    """Replies once with `reply` (a StepResult field set to something the runner must reject)."""

    def __init__(self, **fields: Any) -> None:
        super().__init__(["higher"])
        self.fields = fields

    async def step(self, action: Action) -> StepResult:
        result = await super().step(action)
        for name, value in self.fields.items():
            setattr(result, name, value)
        return result


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"reward": float("nan")}, "reward nan"),
        ({"outcome": float("inf")}, "outcome inf"),
        ({"messages": [{"role": "robot", "content": "beep"}]}, "cannot render env.step's messages"),
    ],
)
async def test_invalid_env_reply_gives_env_error(
    fake: FakeSGLang, pool: EnginePool, tok: Any, fields: dict[str, Any], message: str
) -> None:
    eos = tok.eos_token_id
    fake.script = scripted({"ep-t0": Plan([*enc(tok, "8"), eos])})
    env = BadReplyEnv(**fields)
    before = env_errors("scripted-bad", "invalid")
    result = await play(pool, tok, env, settings(tok), env_name="scripted-bad")
    assert result.finish_reason == "env_error" and message in (result.error or "")
    assert env_errors("scripted-bad", "invalid") == before + 1 and env.closed == 1
    assert all(validate_segment(r) is None for r in result.rows)


async def test_reset_failure_gives_env_error_without_rows(
    fake: FakeSGLang, pool: EnginePool, tok: Any
) -> None:
    env = ScriptedEnv([], fail_on_reset=True)
    result = await play(pool, tok, env, settings(tok))
    assert (result.finish_reason, result.rows, env.closed) == ("env_error", [], 1)
    assert fake.generate_requests() == []


@pytest.mark.parametrize(
    ("fault", "kind"), [("nan_logprob", "protocol"), ("wrong_rid", "protocol"), ("http_500", "http")]
)
async def test_bad_engine_response_gives_engine_error(
    fake: FakeSGLang, pool: EnginePool, tok: Any, fault: str, kind: str
) -> None:
    eos = tok.eos_token_id
    fake.script = scripted({"ep-t0": Plan([*enc(tok, "8"), eos])})
    fake.queue_faults(fault)
    env = ScriptedEnv(["higher"])
    before = engine_errors(kind)
    result = await play(pool, tok, env, settings(tok))
    assert result.finish_reason == "engine_error" and env.closed == 1
    assert engine_errors(kind) == before + 1
    [row] = result.rows  # the prompt alone, written for accounting
    assert row.num_turns == 0 and row.prompt_len == len(row.token_ids) and validate_segment(row) is None


async def test_unreachable_engine_gives_engine_error(tok: Any, unused_tcp_port: int) -> None:
    engines = EnginePool([EngineClient(f"http://127.0.0.1:{unused_tcp_port}", retries=0)])
    try:
        before = engine_errors("unavailable")
        result = await play(engines, tok, ScriptedEnv([]), settings(tok))
    finally:
        await engines.close()
    assert result.finish_reason == "engine_error" and engine_errors("unavailable") == before + 1


async def test_context_budget_caps_max_new_tokens_then_truncates(
    fake: FakeSGLang, pool: EnginePool, tok: Any
) -> None:
    eos = tok.eos_token_id
    prompt_len = len(enc(tok, f"<|im_start|>user\n{FIRST_USER}<|im_end|>\n<|im_start|>assistant\n"))
    fake.script = scripted({"ep-t0": Plan([*enc(tok, "8"), eos])})
    env = ScriptedEnv(["higher"])
    # Room for 3 new tokens: the 2-token answer fits, the reply after it does not.
    result = await play(pool, tok, env, settings(tok, max_context_tokens=prompt_len + 3))
    assert fake.generate_requests()[0]["sampling_params"]["max_new_tokens"] == 3
    assert result.finish_reason == "truncated" and result.num_turns == 1
    [row] = result.rows
    assert len(row.token_ids) == prompt_len + 2  # the reply that did not fit was not appended
    assert validate_segment(row) is None


async def test_prompt_over_budget_truncates_without_a_request(
    fake: FakeSGLang, pool: EnginePool, tok: Any
) -> None:
    result = await play(pool, tok, ScriptedEnv([]), settings(tok, max_context_tokens=4))
    assert result.finish_reason == "truncated" and result.num_turns == 0
    assert fake.generate_requests() == []
    assert all(validate_segment(r) is None for r in result.rows)


async def test_finish_reason_length_truncated_and_turn_cap(
    fake: FakeSGLang, pool: EnginePool, tok: Any
) -> None:
    cut = enc(tok, "I think it is")
    fake.script = scripted({"ep-t0": Plan(cut, finish="length")})
    length = await play(pool, tok, ScriptedEnv([]), settings(tok, max_new_tokens=len(cut)))
    assert length.finish_reason == "length" and length.outcome == 1.0

    eos = tok.eos_token_id
    fake.script = scripted({f"ep-t{k}": Plan([*enc(tok, "8"), eos]) for k in range(3)})
    truncated = await play(pool, tok, ScriptedEnv(["higher"], truncate_at_end=True), settings(tok))
    assert truncated.finish_reason == "truncated" and truncated.outcome == 0.0 and truncated.num_turns == 2

    capped = await play(pool, tok, ScriptedEnv(["higher"] * 5, max_turns=3), settings(tok))
    assert capped.finish_reason == "truncated" and capped.num_turns == 3


def _turns(counter: str) -> float:
    return REGISTRY.get_sample_value(f"rollwise_{counter}_total", {"env": "scripted"}) or 0.0


async def test_turns_the_budget_cut_short_are_counted(fake: FakeSGLang, pool: EnginePool, tok: Any) -> None:
    cut = enc(tok, "I think it is")
    eos = tok.eos_token_id
    fake.script = scripted({"ep-t0": Plan(cut, finish="length")})
    turns, cuts = _turns("turns"), _turns("turns_cut")
    await play(pool, tok, ScriptedEnv([]), settings(tok, max_new_tokens=len(cut)))
    assert (_turns("turns") - turns, _turns("turns_cut") - cuts) == (1, 1)

    fake.script = scripted({"ep-t0": Plan([*enc(tok, "8"), eos])})  # closed by the policy: not cut
    await play(pool, tok, ScriptedEnv([]), settings(tok))
    assert (_turns("turns") - turns, _turns("turns_cut") - cuts) == (2, 1)

    hinted = ScriptedEnv([])
    hinted.spec = dataclasses.replace(hinted.spec, action_hints=("8", "12"))
    for reply, counted in (("8", 0), ("I think it is", 0), ("1", 1)):
        # A whole answer that fills the budget; a wrong answer; the beginning of "12", cut.
        ids = enc(tok, reply)
        fake.script = scripted({"ep-t0": Plan(ids, finish="length")})
        await play(pool, tok, hinted, settings(tok, max_new_tokens=len(ids)))
        cuts += counted
        assert _turns("turns_cut") - cuts == 1, reply
    assert _turns("turns") - turns == 5


def test_a_reply_is_cut_short_when_it_begins_an_answer_and_is_none() -> None:
    assert budget_cut("anything", ())  # no list of answers: every turn the budget ended
    assert not budget_cut(" 12 ", ("8", "12"))
    assert budget_cut("1", ("8", "12")) and budget_cut("  ", ("8", "12"))
    assert not budget_cut("7", ("8", "12"))


async def test_aborted_generation_is_resubmitted_with_its_partial_output(
    fake: FakeSGLang, pool: EnginePool, tok: Any
) -> None:
    eos = tok.eos_token_id
    answer = [*enc(tok, "I say 12"), eos]
    partial, rest = answer[:2], answer[2:]

    def update_on_resubmit(call: GenerateCall) -> None:
        if call.rid == "ep-t0-r1":
            fake.weight_version = "1"  # abort-mode weight sync: the continuation uses new weights

    plans = {"ep-t0": Plan(partial, [-0.5, -0.25], finish="abort"), "ep-t0-r1": Plan(rest)}
    fake.script = scripted(plans, update_on_resubmit)
    result = await play(pool, tok, ScriptedEnv([]), settings(tok, retry_aborted=True))

    assert result.finish_reason == "stop"
    first, second = fake.generate_requests()
    assert second["input_ids"] == first["input_ids"] + partial
    assert second["sampling_params"]["max_new_tokens"] == 16 - len(partial)
    [row] = result.rows
    assert row.token_ids == first["input_ids"] + answer
    generated_versions = [v for v, m in zip(row.versions, row.loss_mask, strict=True) if m]
    assert generated_versions == [0] * len(partial) + [1] * len(rest)
    assert row.logprobs[row.prompt_len : row.prompt_len + 2] == [-0.5, -0.25]
    assert result.num_turns == 1 and validate_segment(row) is None


async def test_abort_without_retry_or_without_progress_is_an_engine_error(
    fake: FakeSGLang, pool: EnginePool, tok: Any
) -> None:
    fake.script = lambda call: Plan([], finish="abort")  # aborted in the queue, again and again
    before = engine_errors("abort")
    no_retry = await play(pool, tok, ScriptedEnv([]), settings(tok))
    assert no_retry.finish_reason == "engine_error" and len(fake.generate_requests()) == 1

    bounded = await play(pool, tok, ScriptedEnv([]), settings(tok, retry_aborted=True, max_abort_retries=2))
    assert bounded.finish_reason == "engine_error"
    assert len(fake.generate_requests()) == 1 + 3  # the first play; then a try + 2 fruitless retries
    assert engine_errors("abort") == before + 2


async def test_a_turn_aborted_in_the_waiting_queue_is_resubmitted_not_an_engine_error(
    fake: FakeSGLang, pool: EnginePool, tok: Any
) -> None:
    """Issue 29, problem 4: SGLang's reply to a request aborted before it ran has no prompt_tokens and no
    cached_tokens; it was counted as a protocol error and its turn lost (49 of 64 in a repro)."""
    eos = tok.eos_token_id
    answers = iter([Plan([], finish="abort"), Plan([*enc(tok, "8"), eos])])
    fake.script = lambda call: next(answers)
    outcome = await play(pool, tok, ScriptedEnv([]), settings(tok, retry_aborted=True))
    assert outcome.finish_reason == "stop" and len(fake.generate_requests()) == 2
    assert [r["rid"] for r in fake.generate_requests()] == ["ep-t0", "ep-t0-r1"]


async def test_an_aborted_turn_is_resubmitted_as_long_as_each_try_keeps_new_tokens(
    fake: FakeSGLang, pool: EnginePool, tok: Any
) -> None:
    """Weight syncs in abort mode may cut one long turn many times: it goes on while it progresses."""
    partial = enc(tok, "I say")
    fake.script = lambda call: Plan(partial, finish="abort")
    max_new = 6 * len(partial)
    outcome = await play(
        pool,
        tok,
        ScriptedEnv([]),
        settings(tok, retry_aborted=True, max_abort_retries=1, max_new_tokens=max_new),
    )
    [row] = outcome.rows
    generated = [t for t, m in zip(row.token_ids, row.loss_mask, strict=True) if m]
    assert generated == partial * 6  # every kept token, in order
    assert len(fake.generate_requests()) == 6


async def test_cancelled_episode_cancels_the_step_in_progress_and_closes_its_env(
    fake: FakeSGLang, pool: EnginePool, tok: Any
) -> None:
    eos = tok.eos_token_id
    fake.script = scripted({"ep-t0": Plan([*enc(tok, "8"), eos])})
    env = SlowStepEnv(busy_s=0.0, sleep_s=30.0, step_timeout_s=60.0)
    running = asyncio.create_task(play(pool, tok, env, settings(tok)))
    await asyncio.wait_for(env.stepping.wait(), 5.0)
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    assert env.events == ["cancelled", "finally"]  # the step itself was cancelled, not left running
    assert env.closed == 1


class BarrierEnv(ScriptedEnv):
    """Every episode of the group waits at reset for all the others: proves they run concurrently."""

    def __init__(self, barrier: asyncio.Barrier) -> None:
        super().__init__(["higher", "lower"])
        self.barrier = barrier

    async def reset(self, task: Task) -> list[Message]:
        async with asyncio.timeout(5.0):
            await self.barrier.wait()
        return await super().reset(task)


async def test_group_runs_concurrently_and_becomes_one_valid_batch(
    fake: FakeSGLang, pool: EnginePool, tok: Any
) -> None:
    fake.vocab_size, fake.eos_token_id = len(tok), tok.eos_token_id  # default pseudo-random plans
    group_size = 4
    barrier = asyncio.Barrier(group_size)
    envs: list[BarrierEnv] = []

    def factory(**options: Any) -> BarrierEnv:
        assert options == {"level": 2}
        envs.append(BarrierEnv(barrier))
        return envs[-1]

    group = await run_group(
        pool,
        tok,
        factory,
        TASK,
        settings(tok, max_new_tokens=6),
        group_size=group_size,
        group_id="g7",
        env_name="scripted",
        env_options={"level": 2},
    )
    assert [e.episode_id for e in group.episodes] == ["g7-0", "g7-1", "g7-2", "g7-3"]
    assert all(e.finish_reason in ("stop", "length") for e in group.episodes)
    assert [env.closed for env in envs] == [1] * group_size
    batch = group.to_record_batch()
    assert batch.num_rows == group_size
    episodes, rejected = batch_to_segments(batch)
    assert rejected == []
    assert {e.group_id for e in episodes} == {"g7"} and {e.task_id for e in episodes} == {TASK.id}
    # Every turn of an episode was routed by its own rid.
    rids = {r["rid"] for r in fake.generate_requests()}
    assert {f"g7-{i}-t0" for i in range(group_size)} <= rids


async def test_group_member_whose_factory_fails_is_an_env_error(
    fake: FakeSGLang, pool: EnginePool, tok: Any
) -> None:
    eos = tok.eos_token_id
    fake.script = lambda call: Plan([*enc(tok, "8"), eos])
    made: list[int] = []

    def factory() -> ScriptedEnv:
        made.append(1)
        if len(made) == 2:
            raise RuntimeError("no sandbox left")
        return ScriptedEnv([])

    group = await run_group(pool, tok, factory, TASK, settings(tok), group_size=3, group_id="g", env_name="x")
    assert [e.finish_reason for e in group.episodes] == ["stop", "env_error", "stop"]
    assert "no sandbox left" in (group.episodes[1].error or "")
    assert group.to_record_batch().num_rows == 2


# ---------------------------------------------------------------------------- bounded env calls


async def test_env_calls_that_never_suspend_finish_under_any_step_timeout(
    fake: FakeSGLang, pool: EnginePool, tok: Any
) -> None:
    # reset, step and close return without yielding to the event loop: no timer can fire in between,
    # however short the bound (asyncio.timeout around such a call would not fire either).
    eos = tok.eos_token_id
    fake.script = scripted({f"ep-t{k}": Plan([*enc(tok, "8"), eos]) for k in range(2)})
    env = ScriptedEnv(["higher"], rewards=[0.25, 1.0], step_timeout_s=1e-9)
    before = env_errors("scripted-instant", "timeout")
    result = await play(pool, tok, env, settings(tok), env_name="scripted-instant")
    assert (result.finish_reason, result.error, result.turn_rewards) == ("stop", None, [0.25, 1.0])
    assert [a.text for a in env.actions] == ["8", "8"] and env.closed == 1
    assert env_errors("scripted-instant", "timeout") == before


class SuspendingEnv(ScriptedEnv):
    """Each step suspends several times before it answers: on a future resolved later by the loop, on a
    wait_for of its own that times out (and is caught), and optionally it then raises."""

    def __init__(self, raise_after: BaseException | None = None) -> None:
        super().__init__([])
        self.raise_after = raise_after
        self.seen: list[str] = []

    async def step(self, action: Action) -> StepResult:
        loop = asyncio.get_running_loop()
        await asyncio.sleep(0)
        future: asyncio.Future[str] = loop.create_future()
        loop.call_later(0.01, future.set_result, "sent")
        value = await future
        try:
            await asyncio.wait_for(asyncio.sleep(5), 0.01)
        except TimeoutError:
            self.seen.append("inner timeout")
        if self.raise_after is not None:
            raise self.raise_after
        self.actions.append(action)
        done = len(self.actions) == 2
        return StepResult([{"role": "user", "content": value + "!"}], reward=0.5, done=done, outcome=1.0)


class FutureStepEnv(ScriptedEnv):
    """`step` is a plain method that returns an awaitable (a Task), not a coroutine."""

    def step(self, action: Action) -> Any:  # type: ignore[override]
        return asyncio.ensure_future(super().step(action))


async def test_env_calls_that_suspend_pass_their_values_and_exceptions_through(
    fake: FakeSGLang, pool: EnginePool, tok: Any
) -> None:
    eos = tok.eos_token_id
    outs = [[*enc(tok, "8"), eos], [*enc(tok, "9"), eos]]
    fake.script = scripted({"ep-t0": Plan(outs[0]), "ep-t1": Plan(outs[1])})
    env = SuspendingEnv()
    result = await play(pool, tok, env, settings(tok), env_name="scripted-suspends")
    assert (result.finish_reason, result.error, result.turn_rewards) == ("stop", None, [0.5, 0.5])
    assert env.seen == ["inner timeout", "inner timeout"]  # the env's own timeouts stay its own
    [row] = result.rows
    prompt = enc(tok, f"<|im_start|>user\n{FIRST_USER}<|im_end|>\n<|im_start|>assistant\n")
    assert row.token_ids == prompt + outs[0] + reply_ids(tok, "sent!") + outs[1]

    fake.script = scripted({"ep-t0": Plan(outs[0])})
    failing = SuspendingEnv(raise_after=ValueError("boom"))
    before = env_errors("scripted-suspends", "error")
    failed = await play(pool, tok, failing, settings(tok), env_name="scripted-suspends")
    assert failed.finish_reason == "env_error" and failed.error == "env.step raised ValueError('boom')"
    assert env_errors("scripted-suspends", "error") == before + 1 and failing.closed == 1

    fake.script = scripted({"ep-t0": Plan(outs[0]), "ep-t1": Plan(outs[1])})
    awaitable = FutureStepEnv(["higher"])
    via_task = await play(pool, tok, awaitable, settings(tok), env_name="scripted-suspends")
    assert (via_task.finish_reason, via_task.num_turns, via_task.outcome) == ("stop", 2, 1.0)
    assert [a.text for a in awaitable.actions] == ["8", "9"]


class SlowStepEnv(ScriptedEnv):
    """A step that first computes synchronously for `busy_s`, then waits `sleep_s` (cleaning up after)."""

    def __init__(self, busy_s: float, sleep_s: float, step_timeout_s: float) -> None:
        super().__init__(["higher"], step_timeout_s=step_timeout_s)
        self.busy_s, self.sleep_s = busy_s, sleep_s
        self.events: list[str] = []

    async def step(self, action: Action) -> StepResult:
        self.stepping.set()
        deadline = time.monotonic() + self.busy_s
        while time.monotonic() < deadline:
            pass
        try:
            await asyncio.sleep(self.sleep_s)
        except asyncio.CancelledError:
            self.events.append("cancelled")
            raise
        finally:
            self.events.append("finally")
        return await super().step(action)


@pytest.mark.parametrize(
    ("busy_s", "sleep_s"),
    [(0.0, 5.0), (0.05, 0.0)],  # waits past the bound; computes past it before its first suspension
)
async def test_env_step_past_its_bound_is_cancelled_and_ends_the_episode_as_timeout(
    fake: FakeSGLang, pool: EnginePool, tok: Any, busy_s: float, sleep_s: float
) -> None:
    fake.script = scripted({"ep-t0": Plan([*enc(tok, "8"), tok.eos_token_id])})
    env = SlowStepEnv(busy_s, sleep_s, step_timeout_s=0.02)
    before = env_errors("scripted-overrun", "timeout")
    started = time.monotonic()
    result = await play(pool, tok, env, settings(tok), env_name="scripted-overrun")
    assert time.monotonic() - started < 2.0
    assert result.finish_reason == "timeout"
    assert result.error == "env.step exceeded step_timeout_s=0.02"
    assert env.events == ["cancelled", "finally"] and env.closed == 1
    assert env_errors("scripted-overrun", "timeout") == before + 1
    assert result.turn_rewards == [0.0] and env.actions == []  # the step never answered


class OwnTimeoutEnv(ScriptedEnv):
    async def step(self, action: Action) -> StepResult:
        await asyncio.sleep(0)
        raise TimeoutError("the backend timed out")


async def test_env_raising_its_own_timeout_error_is_an_env_error(
    fake: FakeSGLang, pool: EnginePool, tok: Any
) -> None:
    fake.script = scripted({"ep-t0": Plan([*enc(tok, "8"), tok.eos_token_id])})
    env = OwnTimeoutEnv(["higher"])
    before = env_errors("scripted-own-timeout", "error")
    result = await play(pool, tok, env, settings(tok), env_name="scripted-own-timeout")
    assert result.finish_reason == "env_error" and "the backend timed out" in (result.error or "")
    assert env_errors("scripted-own-timeout", "error") == before + 1 and env.closed == 1


class VersionedEngine:
    """An engine that answers the k-th call with turns[k]: the output ids and each token's weight version."""

    def __init__(self, turns: list[tuple[list[int], list[str]]]) -> None:
        self.turns = turns
        self.calls = 0

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, rid: str, *, affinity_key: str
    ) -> GenerateResult:
        ids, versions = self.turns[self.calls]
        self.calls += 1
        return GenerateResult(
            rid=rid,
            output_ids=ids,
            logprobs=[-0.5] * len(ids),
            finish_reason="stop",
            weight_version=versions[-1],
            token_versions=versions,
            prompt_tokens=len(input_ids),
            completion_tokens=len(ids),
            cached_tokens=0,
        )


async def test_token_versions_become_ints_whether_uniform_or_mixed(tok: Any) -> None:
    eos = tok.eos_token_id
    outs = [[*enc(tok, "8"), eos], [*enc(tok, "I say 12"), eos], [*enc(tok, "10"), eos]]
    mixed = ["3"] * (len(outs[1]) - 2) + ["4", "4"]  # an in-place update landed mid-turn
    engine = VersionedEngine(
        [(outs[0], ["default"] * len(outs[0])), (outs[1], mixed), (outs[2], ["4"] * len(outs[2]))]
    )
    env = ScriptedEnv(["higher", "lower"])
    result = await run_episode(
        engine, tok, env, TASK, settings(tok), episode_id="ep", group_id="g", env_name="x"
    )
    assert result.finish_reason == "stop" and engine.calls == 3
    [row] = result.rows
    generated = [v for v, m in zip(row.versions, row.loss_mask, strict=True) if m]
    assert generated == [0] * len(outs[0]) + [int(v) for v in mixed] + [4] * len(outs[2])
    assert validate_segment(row) is None


@pytest.mark.parametrize("versions", [["v2", "v2"], ["3", "v2"]], ids=["uniform", "mixed"])
async def test_a_token_version_that_is_not_a_number_is_an_engine_protocol_error(
    tok: Any, versions: list[str]
) -> None:
    engine = VersionedEngine([([*enc(tok, "8"), tok.eos_token_id], versions)])
    env = ScriptedEnv(["higher"])
    before = engine_errors("protocol")
    result = await run_episode(
        engine, tok, env, TASK, settings(tok), episode_id="ep", group_id="g", env_name="x"
    )
    assert result.finish_reason == "engine_error"
    assert (result.error or "").endswith(
        "broke the protocol: weight_version 'v2' is neither 'default' nor a decimal integer"
    )
    assert engine_errors("protocol") == before + 1 and env.closed == 1
    [row] = result.rows  # the prompt alone: the reply with the bad version was not appended
    assert row.num_turns == 0 and row.prompt_len == len(row.token_ids)


# ------------------------------------------------------------------------- routed experts (MoE)
MOE = (2, 2, 8)  # layers, top-k, experts: what the fake's MoE server routes


async def test_each_turn_asks_for_the_routing_its_segment_lacks_and_the_row_holds_all_of_it(
    fake: FakeSGLang, pool: EnginePool, tok: Any
) -> None:
    from pipeline.tools.fake_sglang.generation_plans import routed_experts

    fake.routed_experts = MOE
    eos = tok.eos_token_id
    outs = [[*enc(tok, "8"), eos], [*enc(tok, "12"), eos], [*enc(tok, "10"), eos]]
    fake.script = scripted({f"ep-t{k}": Plan(outs[k], [-0.5] * len(outs[k])) for k in range(3)})
    result = await play(pool, tok, ScriptedEnv(["higher", "lower"]), settings(tok, routed_experts=MOE))

    assert result.finish_reason == "stop" and result.error is None
    [row] = result.rows
    record = row.routed_experts
    assert record is not None and (record.layers, record.topk, record.width) == (2, 2, 1)
    assert record.positions == len(row.token_ids) - 1  # the last sampled token was never forwarded
    expected = routed_experts(fake.served_weights, row.token_ids, 0, layers=2, topk=2, num_experts=8)
    assert record.values() == expected
    asked = [(r["return_routed_experts"], r["routed_experts_start_len"]) for r in fake.generate_requests()]
    ends = [len(r["input_ids"]) + len(outs[k]) - 1 for k, r in enumerate(fake.generate_requests())]
    assert asked == [(True, 0), (True, ends[0]), (True, ends[1])]
    assert fake.ignored_fields == []


async def test_an_engine_that_returns_no_routing_ends_the_episode_naming_the_launch_flag(
    fake: FakeSGLang, pool: EnginePool, tok: Any
) -> None:
    fake.script = scripted({"ep-t0": Plan([*enc(tok, "8"), tok.eos_token_id])})
    before = engine_errors("protocol")
    result = await play(pool, tok, ScriptedEnv([]), settings(tok, routed_experts=MOE))
    assert result.finish_reason == "engine_error"
    assert "--enable-return-routed-experts" in (result.error or "")
    assert engine_errors("protocol") == before + 1


async def test_an_expert_id_beyond_the_models_ends_the_episode(
    fake: FakeSGLang, pool: EnginePool, tok: Any
) -> None:
    fake.routed_experts = (2, 2, 16)  # the engine routes over 16 experts, the runner's model has 8
    fake.script = scripted({"ep-t0": Plan([*enc(tok, "8"), *enc(tok, "9"), tok.eos_token_id])})
    result = await play(pool, tok, ScriptedEnv([]), settings(tok, routed_experts=MOE))
    assert result.finish_reason == "engine_error"
    assert "names an expert >= the model's 8" in (result.error or "")


async def test_without_routed_experts_requests_carry_no_routing_fields(
    fake: FakeSGLang, pool: EnginePool, tok: Any
) -> None:
    fake.routed_experts = MOE
    fake.script = scripted({"ep-t0": Plan([*enc(tok, "8"), tok.eos_token_id])})
    result = await play(pool, tok, ScriptedEnv([]), settings(tok))
    assert result.rows[0].routed_experts is None
    assert "return_routed_experts" not in fake.generate_requests()[0]
