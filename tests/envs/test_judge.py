"""The LLM-judge helper: against the embedded engine through the run's OpenAI endpoint (the judge is the
run's own policy), and against a scripted OpenAI-compatible server for the exact retry, timeout,
concurrency and failure rules. A judge failure excludes the episode; it is never scored 0."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from transformers import AutoTokenizer

from envs.api import Action, Environment, EnvSpec, Message, StepResult, Task
from envs.judge import Judge, JudgeConfig, JudgeError, set_run_endpoint, shared_judge
from pipeline.engine.serve import RunningServer, start_server
from pipeline.engine.serve_flags import ServerConfig
from pipeline.supervisor.actors.agent_api.openai_endpoint import OpenAIEndpoint
from pipeline.supervisor.actors.rollout import RolloutSettings, run_group
from pipeline.supervisor.engines.client import EngineClient
from pipeline.supervisor.engines.pool import EnginePool
from pipeline.supervisor.engines.protocol import SamplingParams
from pipeline.supervisor.observability import judge_metrics
from pipeline.supervisor.observability.metrics import REGISTRY

TASK = Task("q0", 0, {"question": "What is 2 + 3?", "reference": "5"})


def counter(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.fixture(autouse=True)
def exported() -> Iterator[None]:
    judge_metrics.install()
    yield
    set_run_endpoint(None)


class JudgedEnv(Environment):
    """One turn: the policy answers, the judge scores the answer; the score is the outcome."""

    def __init__(self, judge: JudgeConfig) -> None:
        self.spec = EnvSpec(name="judged", version="1", max_turns=1, step_timeout_s=60.0)
        self.judge = shared_judge(judge)
        self.task: Task | None = None

    def tasks(self, seed: int) -> Iterator[Task]:
        while True:
            yield TASK

    async def reset(self, task: Task) -> list[Message]:
        self.task = task
        return [{"role": "user", "content": str(task.data["question"])}]

    async def step(self, action: Action) -> StepResult:
        assert self.task is not None
        verdict = await self.judge.score(
            question=str(self.task.data["question"]),
            response=action.text,
            reference=str(self.task.data["reference"]),
        )
        return StepResult([{"role": "user", "content": "scored"}], done=True, outcome=verdict.score)


# ------------------------------------------------------------------------------------- embedded engine
@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
async def run_engines(
    tiny_model_dir: Path, tok: Any, one_torch_thread: None
) -> AsyncIterator[OpenAIEndpoint]:
    """The embedded engine (tiny preset), a pool over it, the run's OpenAI endpoint registered for judges."""
    server: RunningServer = await start_server(
        ServerConfig(model=str(tiny_model_dir), port=0, weight_version="0", seed=0, threads=1)
    )
    pool = EnginePool([EngineClient(server.url, retries=0)])
    settings = RolloutSettings(sampling=SamplingParams(max_new_tokens=8), max_context_tokens=1024)
    endpoint = OpenAIEndpoint(engine=pool, tokenizer=tok, settings=settings)
    await endpoint.start()
    set_run_endpoint(endpoint.base_url, endpoint.service_key)
    try:
        yield endpoint
    finally:
        await endpoint.close()
        await pool.close()
        await server.close()


async def test_judge_scores_with_the_runs_own_engine(run_engines: OpenAIEndpoint) -> None:
    # The tiny random model writes numbers often (its vocabulary is full of them): "any integer in 0..40".
    config = JudgeConfig(
        score_pattern=r"(\d+)",
        max_score=40,
        temperature=1.0,
        seed=0,
        max_tokens=48,
        retries=3,
        name="judge-run",
    )
    judge = Judge(config)
    ok_before = counter("rollwise_judge_requests_total", judge="judge-run", status="ok")
    latency_before = counter("rollwise_judge_request_duration_seconds_count", judge="judge-run")

    verdict = await judge.score(question="What is 2 + 3?", response="5", reference="5")

    assert verdict.raw == judge.parse(verdict.text) and 0.0 <= verdict.score <= 1.0
    assert verdict.score == pytest.approx(verdict.raw / 40)
    assert counter("rollwise_judge_requests_total", judge="judge-run", status="ok") == ok_before + 1
    assert (
        counter("rollwise_judge_request_duration_seconds_count", judge="judge-run")
        == latency_before + verdict.attempts
    )
    # It went through the endpoint's service route: not recorded as an episode's turn.
    assert (
        counter("rollwise_openai_requests_total", route="service", api="chat", status="ok")
        >= verdict.attempts
    )


async def test_a_judge_failure_excludes_the_episode_and_is_counted(
    run_engines: OpenAIEndpoint, tok: Any
) -> None:
    config = JudgeConfig(
        score_pattern=r"NEVER(\d)", retries=1, backoff_s=0.0, max_tokens=8, name="judge-never"
    )
    before = {
        "env": counter("rollwise_env_errors_total", env="judged-never", kind="judge"),
        "failures": counter("rollwise_judge_failures_total", judge="judge-never", reason="parse"),
        "parse": counter("rollwise_judge_requests_total", judge="judge-never", status="parse"),
    }
    group = await run_group(
        run_engines.engine,
        tok,
        lambda: JudgedEnv(config),
        TASK,
        run_engines.settings,
        group_size=3,
        group_id="g",
        env_name="judged-never",
    )
    assert [ep.finish_reason for ep in group.episodes] == ["env_error"] * 3
    assert all(ep.outcome is None and not ep.trainable for ep in group.episodes)  # excluded, never 0
    assert "judge 'judge-never' failed after 2 attempt(s)" in (group.episodes[0].error or "")
    assert counter("rollwise_env_errors_total", env="judged-never", kind="judge") == before["env"] + 3
    assert (
        counter("rollwise_judge_failures_total", judge="judge-never", reason="parse")
        == before["failures"] + 3
    )
    assert (
        counter("rollwise_judge_requests_total", judge="judge-never", status="parse") == before["parse"] + 6
    )


# ------------------------------------------------------------------------------------- scripted server
class ScriptedJudge:
    """An OpenAI-compatible /v1/chat/completions whose replies a test scripts (text, status or delay)."""

    def __init__(self) -> None:
        self.replies: list[tuple[int, str, float]] = []  # (status, content, delay_s), used in order
        self.bodies: list[dict[str, Any]] = []
        self.in_flight = 0
        self.peak = 0
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        return f"http://127.0.0.1:{self.port}/v1"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _chat(self, request: web.Request) -> web.Response:
        self.bodies.append(await request.json())
        status, content, delay = self.replies.pop(0) if self.replies else (200, "Score: 7", 0.0)
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            await asyncio.sleep(delay)
        finally:
            self.in_flight -= 1
        if status != 200:
            return web.json_response({"error": {"message": content}}, status=status)
        message = {"role": "assistant", "content": content}
        return web.json_response({"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]})


@pytest.fixture
async def scripted() -> AsyncIterator[tuple[ScriptedJudge, str]]:
    server = ScriptedJudge()
    url = await server.start()
    yield server, url
    await server.stop()


async def test_rubric_score_and_request_shape(
    scripted: tuple[ScriptedJudge, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, url = scripted
    monkeypatch.setenv("MY_JUDGE_KEY", "sk-test")
    judge = Judge(
        JudgeConfig(base_url=url, model="big-judge", api_key_env="MY_JUDGE_KEY", system_prompt="Be strict.")
    )
    server.replies = [(200, "The answer is right.\nScore: 3\nScore: 8", 0.0)]
    verdict = await judge.score(question="2+3?", response="5", reference="5")
    assert (verdict.raw, verdict.score, verdict.attempts) == (8.0, 0.8, 1)  # the last "Score:" counts
    [body] = server.bodies
    assert body["model"] == "big-judge" and body["temperature"] == 0.0 and body["max_tokens"] == 256
    assert body["messages"][0] == {"role": "system", "content": "Be strict."}
    assert (
        "2+3?" in body["messages"][1]["content"] and "from 0 (wrong) to 10" in body["messages"][1]["content"]
    )


async def test_retries_on_parse_5xx_and_timeout_then_scores(scripted: tuple[ScriptedJudge, str]) -> None:
    server, url = scripted
    judge = Judge(JudgeConfig(base_url=url, retries=3, backoff_s=0.0, timeout_s=0.5, name="judge-retry"))
    server.replies = [
        (200, "no idea", 0.0),
        (503, "busy", 0.0),
        (200, "Score: 9", 5.0),
        (200, "Score: 4", 0.0),
    ]
    before = {
        s: counter("rollwise_judge_requests_total", judge="judge-retry", status=s)
        for s in ("parse", "http", "timeout", "ok")
    }
    verdict = await judge.score(response="x")
    assert (verdict.raw, verdict.attempts) == (4.0, 4)
    after = {s: counter("rollwise_judge_requests_total", judge="judge-retry", status=s) for s in before}
    assert {s: after[s] - before[s] for s in before} == {"parse": 1, "http": 1, "timeout": 1, "ok": 1}


async def test_a_client_error_is_not_retried(scripted: tuple[ScriptedJudge, str]) -> None:
    server, url = scripted
    judge = Judge(JudgeConfig(base_url=url, retries=3, backoff_s=0.0, name="judge-400"))
    server.replies = [(400, "unknown model", 0.0)]
    with pytest.raises(JudgeError, match="HTTP 400") as caught:
        await judge.score(response="x")
    assert caught.value.reason == "http" and caught.value.kind == "judge" and len(server.bodies) == 1


async def test_concurrency_is_bounded_across_episodes_sharing_a_judge(
    scripted: tuple[ScriptedJudge, str],
) -> None:
    server, url = scripted
    config = JudgeConfig(base_url=url, max_concurrency=2, name="judge-shared")
    server.replies = [(200, "Score: 5", 0.05)] * 8
    judges = [shared_judge(config) for _ in range(8)]  # one per episode, as environments make them
    assert all(j is judges[0] for j in judges)
    verdicts = await asyncio.gather(*(j.score(response=str(i)) for i, j in enumerate(judges)))
    assert [v.raw for v in verdicts] == [5.0] * 8 and server.peak == 2


async def test_judged_env_episodes_take_the_judges_score_as_outcome(
    scripted: tuple[ScriptedJudge, str], tiny_tokenizer_dir: Path
) -> None:
    from pipeline.tools.fake_sglang import FakeSGLang

    server, url = scripted
    server.replies = [(200, "Score: 7", 0.0), (200, "Score: 2", 0.0)]
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    fake = FakeSGLang()
    await fake.start()
    pool = EnginePool([EngineClient(fake.base_url, retries=0)])
    try:
        group = await run_group(
            pool,
            tok,
            lambda: JudgedEnv(JudgeConfig(base_url=url, max_concurrency=1, name="judge-env")),
            TASK,
            RolloutSettings(sampling=SamplingParams(max_new_tokens=4), max_context_tokens=256),
            group_size=2,
            group_id="g",
            env_name="judged",
        )
    finally:
        await pool.close()
        await fake.stop()
    assert sorted(ep.outcome or 0.0 for ep in group.episodes) == [0.2, 0.7]
    assert all(ep.trainable for ep in group.episodes)  # the fake's random answers may be cut: "length"
    sent = [json.dumps(b["messages"]) for b in server.bodies]
    assert all("What is 2 + 3?" in s for s in sent)


def test_bad_judge_configs_are_refused() -> None:
    with pytest.raises(ValueError, match="exactly one group"):
        JudgeConfig(score_pattern=r"\d+")
    with pytest.raises(ValueError, match="max_score"):
        JudgeConfig(min_score=5, max_score=5)
    with pytest.raises(ValueError, match="rubric"):
        JudgeConfig(rubric="Grade {answer}")


async def test_without_a_base_url_or_a_run_the_judge_fails_with_a_config_reason() -> None:
    set_run_endpoint(None)
    before = counter("rollwise_judge_failures_total", judge="judge-nowhere", reason="config")
    with pytest.raises(JudgeError, match="no rollwise run") as caught:
        await Judge(JudgeConfig(name="judge-nowhere")).score(response="x")
    assert caught.value.reason == "config"
    assert counter("rollwise_judge_failures_total", judge="judge-nowhere", reason="config") == before + 1
