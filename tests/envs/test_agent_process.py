"""Agent-process environments (envs/agent_process/): a command in the sandbox and its episode's endpoint.

The agents here are small programs in other forms than a Python function: a stdlib-only Python script
that speaks HTTP itself, and shell one-liners. The SGLang fake answers with scripted tokens (decoded by the
tiny tokenizer), so every recorded turn is checked exactly. Under bubblewrap the agent must reach its
endpoint and nothing else: not the host's loopback (the endpoint's own TCP port included), not another
port a test server listens on.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from envs.agent_process import AgentProcessEnvironment
from envs.api import Task
from envs.sandbox import Sandbox, SandboxConfig, SandboxUnavailable
from pipeline.supervisor.actors.agent_api.openai_endpoint import OpenAIEndpoint
from pipeline.supervisor.actors.rollout import EpisodeOutcome, RolloutSettings
from pipeline.supervisor.engines.client import EngineClient
from pipeline.supervisor.engines.pool import EnginePool
from pipeline.supervisor.engines.protocol import SamplingParams
from pipeline.supervisor.observability.metrics import REGISTRY
from pipeline.tools.fake_sglang import FakeSGLang, Plan

TASK = Task(id="t7", seed=7, data={"question": "What is 2 + 3?", "answer": 5})
ENV_NAME = "agent-process-test"

# A stdlib-only agent: the task from stdin, one chat completion and one Anthropic message through the
# endpoint, then reachability probes (PROBE_PORTS); it prints its outcome as the last line of stdout.
AGENT = r"""
import json, os, socket, sys, urllib.request

task = json.load(sys.stdin)
assert json.load(open(os.environ["ROLLWISE_TASK_FILE"])) == task

def post(url, body, headers):
    headers = {"content-type": "application/json", **headers}
    request = urllib.request.Request(url, json.dumps(body).encode(), headers)
    with urllib.request.urlopen(request, timeout=30) as reply:
        return json.load(reply)

question = [{"role": "user", "content": task["data"]["question"]}]
chat = post(os.environ["OPENAI_BASE_URL"] + "/chat/completions",
            {"model": os.environ["ROLLWISE_MODEL"], "messages": question},
            {"authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
claude = post(os.environ["ANTHROPIC_BASE_URL"] + "/v1/messages",
              {"model": os.environ["ROLLWISE_MODEL"], "max_tokens": 16, "messages": question},
              {"x-api-key": os.environ["ANTHROPIC_API_KEY"], "anthropic-version": "2023-06-01"})

def reachable(port):
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        return True
    except OSError:
        return False

probes = {str(p): reachable(p) for p in json.loads(os.environ["PROBE_PORTS"])}
print("log lines before the outcome are fine", file=sys.stdout)
text = chat["choices"][0]["message"]["content"] + "|" + claude["content"][0]["text"]
print(json.dumps({"outcome": 1.0 if "5" in text else 0.0, "turn_rewards": [0.25],
                  "info": {"probes": probes, "text": text}}))
"""


def bwrap_sandbox() -> Sandbox:
    try:
        sandbox = Sandbox(SandboxConfig(require="bwrap"))
    except SandboxUnavailable as exc:
        pytest.skip(f"bubblewrap isolation is not available here: {exc}")
    return sandbox


def say(tok: Any, text: str) -> Plan:
    ids = [*tok.encode(text, add_special_tokens=False), tok.eos_token_id]
    return Plan(ids, [-0.2 - 0.01 * i for i in range(len(ids))])


@pytest.fixture
async def fake(tok: Any) -> AsyncIterator[FakeSGLang]:
    server = FakeSGLang(tokenizer=tok, script=lambda call: say(tok, "It is 5."))
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
async def endpoint(fake: FakeSGLang, tok: Any) -> AsyncIterator[OpenAIEndpoint]:
    pool = EnginePool([EngineClient(fake.base_url, retries=0)])
    settings = RolloutSettings(sampling=SamplingParams(max_new_tokens=32), max_context_tokens=1024)
    server = OpenAIEndpoint(engine=pool, tokenizer=tok, settings=settings)
    await server.start()
    yield server
    await server.close()
    await pool.close()


def tasks(seed: int) -> Iterator[Task]:
    while True:
        yield TASK


def counter(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def play(endpoint: OpenAIEndpoint, env: AgentProcessEnvironment) -> EpisodeOutcome:
    return await endpoint.run_agent_episode(env, TASK, episode_id="pe", group_id="g", env_name=ENV_NAME)


async def test_a_process_agent_reaches_its_endpoint_and_nothing_else_under_bubblewrap(
    endpoint: OpenAIEndpoint, fake: FakeSGLang, tok: Any, tmp_path: Path
) -> None:
    bwrap_sandbox()
    agent = tmp_path / "agent.py"
    agent.write_text(AGENT)
    env = AgentProcessEnvironment(
        ["python3", "agent.py"],
        tasks,
        files={"agent.py": str(agent)},
        env={"PROBE_PORTS": "[]"},
        episode_timeout_s=60.0,
    )
    result = await play(endpoint, env)
    assert (result.finish_reason, result.error) == ("stop", None), result.error
    assert result.outcome == 1.0 and result.turn_rewards == [0.25, 0.0]
    assert result.num_turns == 2
    [row] = result.rows[:1]
    generated = [t for t, m in zip(row.token_ids, row.loss_mask, strict=True) if m]
    assert generated == say(tok, "It is 5.").output_ids
    sent = fake.generate_requests()
    assert len(sent) == 2 and all(s["sampling_params"]["max_new_tokens"] <= 32 for s in sent)


async def test_the_sandboxed_agent_sees_only_the_relay(
    endpoint: OpenAIEndpoint, fake: FakeSGLang, tok: Any, tmp_path: Path
) -> None:
    bwrap_sandbox()
    script = (
        "import json, os, socket\n"
        "def ok(port):\n"
        "    try:\n"
        "        socket.create_connection(('127.0.0.1', port), timeout=2).close(); return True\n"
        "    except OSError:\n"
        "        return False\n"
        "ports = json.loads(os.environ['PROBE_PORTS'])\n"
        "print(json.dumps({'outcome': 1.0, 'info': {str(p): ok(p) for p in ports}}))\n"
    )
    (tmp_path / "probe.py").write_text(script)
    other = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    other_port = other.sockets[0].getsockname()[1]
    seen: dict[str, Any] = {}
    env = AgentProcessEnvironment(
        ["python3", "probe.py"],
        tasks,
        files={"probe.py": str(tmp_path / "probe.py")},
        env={"PROBE_PORTS": json.dumps([endpoint.port, other_port, 8731])},
        episode_timeout_s=60.0,
    )
    original = env.play

    async def spy(episode: Any, task: Task) -> object:
        value = await original(episode, task)
        seen["info"] = getattr(value, "info", None)
        return value

    env.play = spy  # type: ignore[method-assign]
    try:
        await play(endpoint, env)
    finally:
        other.close()
        await other.wait_closed()
    assert seen["info"] == {str(endpoint.port): False, str(other_port): False, "8731": True}


@pytest.mark.parametrize(
    ("command", "reason", "finish", "sandbox", "says"),
    [
        ("echo 'went wrong' >&2; exit 3", "exit", "env_error", {}, "went wrong"),
        ("kill -9 $$", "signal", "env_error", {}, ""),
        ("echo 'no json here'", "bad_output", "env_error", {}, "not JSON"),
        ('echo \'{"outcome": "high"}\'', "bad_output", "env_error", {}, "expected a number"),
        ("sleep 30", "wall_time", "timeout", {}, ""),
        # The memory limit: the agent's allocation fails (RLIMIT_AS), Python exits 1 with MemoryError.
        (
            'python3 -c "bytearray(600 << 20)"',
            "exit",
            "env_error",
            {"memory_bytes": 256 << 20},
            "MemoryError",
        ),
        ("while :; do :; done", "cpu_time", "env_error", {"cpu_time_s": 1.0}, "-24"),
        # Its stdout is a file in the sandbox: the file-size limit stops an endless writer.
        (["yes"], "output_limit", "env_error", {"max_file_bytes": 1 << 20}, "-25"),
    ],
    ids=["exit", "signal", "not-json", "bad-outcome", "wall-time", "memory", "cpu-time", "file-size"],
)
async def test_every_failure_costs_the_episode_counted_with_its_reason(
    endpoint: OpenAIEndpoint,
    command: str | list[str],
    reason: str,
    finish: str,
    sandbox: dict[str, Any],
    says: str,
) -> None:
    bwrap_sandbox()
    before = counter("rollwise_agent_failures_total", env=ENV_NAME, reason=reason)
    timeout = 3.0 if reason == "wall_time" else 30.0
    env = AgentProcessEnvironment(command, tasks, episode_timeout_s=timeout, sandbox=sandbox)
    result = await play(endpoint, env)
    assert result.finish_reason == finish and result.outcome is None, result.error
    assert counter("rollwise_agent_failures_total", env=ENV_NAME, reason=reason) == before + 1
    assert says in (result.error or "")


# A shell agent that retries a request the endpoint refuses (n=3), for ever.
LOOPING = (
    'while :; do curl -s -o /dev/null -H "authorization: Bearer $OPENAI_API_KEY" '
    '-H "content-type: application/json" -d \'{"model": "policy", "n": 3, "messages": '
    '[{"role": "user", "content": "hi"}]}\' "$OPENAI_BASE_URL/chat/completions"; done'
)


async def test_a_process_agent_looping_on_refused_requests_is_stopped_and_counted(
    endpoint: OpenAIEndpoint, fake: FakeSGLang
) -> None:
    bwrap_sandbox()
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    before = counter("rollwise_env_errors_total", env=ENV_NAME, kind="refused")
    env = AgentProcessEnvironment(LOOPING, tasks, episode_timeout_s=60.0, max_refused_requests=4)
    result = await play(endpoint, env)
    # Stopped at the fourth refusal: the process is killed, the episode ends well before its timeout.
    assert result.finish_reason == "env_error" and "refused" in (result.error or ""), result.error
    assert result.duration_s < 15.0 and result.num_turns == 0
    assert counter("rollwise_env_errors_total", env=ENV_NAME, kind="refused") == before + 1
    assert fake.generate_requests() == []


async def test_the_outcome_file_wins_over_stdout_and_a_run_without_a_request_is_invalid(
    endpoint: OpenAIEndpoint, tmp_path: Path
) -> None:
    bwrap_sandbox()
    (tmp_path / "agent.py").write_text(AGENT)
    # A shell pipeline around the Python agent: its stdout says 1.0, the outcome file 0.5.
    command = 'python3 agent.py && echo \'{"outcome": 0.5}\' > "$ROLLWISE_OUTCOME_FILE"'
    files = {"agent.py": str(tmp_path / "agent.py")}
    env = AgentProcessEnvironment(
        command, tasks, files=files, env={"PROBE_PORTS": "[]"}, episode_timeout_s=60.0
    )
    result = await play(endpoint, env)
    assert (result.finish_reason, result.outcome) == ("stop", 0.5), result.error
    silent = AgentProcessEnvironment("cat > /dev/null; echo 1", tasks, episode_timeout_s=30.0)
    idle = await play(endpoint, silent)
    # A valid outcome without a single request: an invalid episode, never a silent score.
    assert idle.finish_reason == "env_error" and "without requesting" in (idle.error or "")


async def test_without_bubblewrap_the_agent_gets_the_tcp_endpoint(
    endpoint: OpenAIEndpoint, fake: FakeSGLang, tmp_path: Path
) -> None:
    (tmp_path / "agent.py").write_text(AGENT)
    env = AgentProcessEnvironment(
        ["python3", "agent.py"],
        tasks,
        files={"agent.py": str(tmp_path / "agent.py")},
        env={"PROBE_PORTS": "[]"},
        sandbox={"require": "rlimits", "bwrap": ""},
        episode_timeout_s=60.0,
    )
    result = await play(endpoint, env)
    assert (result.finish_reason, result.outcome, result.num_turns) == ("stop", 1.0, 2), result.error


def test_bad_options_are_refused_naming_them(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="command"):
        AgentProcessEnvironment([], tasks)
    with pytest.raises(ValueError, match=r"files\.agent\.py"):
        AgentProcessEnvironment("true", tasks, files={"agent.py": str(tmp_path / "missing.py")})
    with pytest.raises(ValueError, match="mounts"):
        AgentProcessEnvironment("true", tasks, mounts=["relative/path"])
    with pytest.raises(ValueError, match="sandbox"):
        AgentProcessEnvironment("true", tasks, sandbox={"memory_bytes": 1})
