"""openenv/<name> (envs/ecosystems/openenv_*.py): OpenEnv environments played over their /ws session.

Everything is real: the servers are OpenEnv 0.10's own, run by the OpenEnv venv's interpreter
(`make env-openenv`). The environments are the echo environment of `openenv init`'s template (installed
into the venv as openenv-echo_env by envs/ecosystems/after-install-openenv.sh) and two written for these
tests in tests/envs/openenv_fixtures: guess_env (guess 1..8 in three turns with higher/lower feedback)
and guess_tools_env (the same game behind an MCP tool, its score in the state field `score`).
Starting a server costs seconds, so the module starts each once (`servers`) and every test shares them;
the restart and capacity tests start their own.

Skipped, naming `make env-openenv`, where the OpenEnv venv is absent.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from envs.api import FORMAT_ERROR, Action, Task, ToolCall
from envs.checker import check_env
from envs.discovery import resolve_env
from envs.ecosystems.ecosystem_venvs import EcosystemMissing, venv_python
from envs.ecosystems.openenv_env import (
    OpenEnvEnvironment,
    OpenEnvError,
    observation_text,
    tool_result_text,
)
from envs.ecosystems.openenv_family import installed_environments, members
from envs.ecosystems.openenv_server import LocalServer, stop_all
from envs.ecosystems.openenv_wire import ServerRefused, WsSession, ws_url

FIXTURES = str(Path(__file__).with_name("openenv_fixtures"))
GUESS = {"path": FIXTURES, "action_field": "guess"}
TOOLS = {"path": FIXTURES, "reward_from": "score"}
INTRO = "I picked a whole number from 1 to 8. Guess it: reply with the number only. You have 3 guesses."
SEED = 3  # guess_env's target for reset seed 3
TARGET = random.Random(SEED).randint(1, 8)

try:
    venv_python("openenv")
    VENV_MISSING = ""
except EcosystemMissing as exc:
    VENV_MISSING = str(exc)
needs_venv = pytest.mark.skipif(bool(VENV_MISSING), reason=f"OpenEnv venv missing: {VENV_MISSING}")


def guess_env(**options: Any) -> OpenEnvEnvironment:
    return OpenEnvEnvironment("guess_env", **{**GUESS, **options})


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, OpenEnvEnvironment]]:
    """One instance per environment, built at once (each construction starts and reads its server)."""
    if VENV_MISSING:
        pytest.skip(f"OpenEnv venv missing: {VENV_MISSING}")
    if "echo_env" not in installed_environments():
        pytest.skip("the OpenEnv venv lacks openenv-echo_env: rebuild it with `make env-openenv`")
    builders = {
        "guess": guess_env,
        "echo": lambda: OpenEnvEnvironment("echo_env"),
        "tools": lambda: OpenEnvEnvironment("guess_tools_env", **TOOLS),
    }
    with ThreadPoolExecutor(len(builders)) as pool:
        futures = {name: pool.submit(build) for name, build in builders.items()}
        built = {name: future.result() for name, future in futures.items()}
    yield built
    stop_all(keep_failure_logs=False)


# ---------------------------------------------------------------------------------------- the wire
@needs_venv
async def test_the_ws_messages_are_openenvs_own(servers: dict[str, OpenEnvEnvironment]) -> None:
    server = servers["guess"].server
    base_url, _ = await server.ensure_running()
    session = WsSession(base_url, 10.0)
    await session.connect()
    try:
        reset = await session.send({"type": "reset", "data": {"seed": SEED}})
        assert reset == {"observation": {"metadata": {}, "feedback": INTRO}, "reward": 0.0, "done": False}
        step = await session.send({"type": "step", "data": {"guess": str(TARGET)}})
        assert step == {
            "observation": {"metadata": {"guesses": 1}, "feedback": "Correct!"},
            "reward": 1.0,
            "done": True,
            "metadata": {"guesses": 1},
        }
        state = await session.send({"type": "state"})
        assert state == {"episode_id": None, "step_count": 1, "target": TARGET, "solved": True, "coin": False}
        with pytest.raises(ServerRefused) as refused:
            await session.send({"type": "step", "data": {"guess": 4}})
        assert refused.value.code == "VALIDATION_ERROR"
        assert [e["loc"] for e in refused.value.data["errors"]] == [["guess"]]
        with pytest.raises(ServerRefused, match="UNKNOWN_TYPE: Unknown message type: act"):
            await session.send({"type": "act"})
    finally:
        await session.close()


def test_urls_observations_and_tool_results_are_rendered_by_rule() -> None:
    assert ws_url("http://127.0.0.1:8000/") == "ws://127.0.0.1:8000/ws"
    assert ws_url("https://env.example/x") == "wss://env.example/x/ws"
    with pytest.raises(ValueError, match="'localhost:8000' is not an http:// or https:// URL"):
        ws_url("localhost:8000")
    one = {"observation": {"metadata": {"a": 1}, "feedback": "Higher."}}
    assert observation_text(one) == "Higher."
    two = {"observation": {"metadata": {}, "echoed_message": "hi", "message_length": 2}}
    assert observation_text(two) == '{"echoed_message": "hi", "message_length": 2}'
    assert observation_text(two, "echoed_message") == "hi"
    assert observation_text({"observation": {"metadata": {"message": "Go."}}}) == "Go."
    text = {"type": "text", "text": "lower"}
    assert tool_result_text({"observation": {"result": {"content": [text], "is_error": False}}}) == "lower"
    error = {"error_type": "tool_not_found", "message": "Unknown tool: 'x'"}
    assert tool_result_text({"observation": {"result": None, "error": error}}) == "error: Unknown tool: 'x'"


# ------------------------------------------------------------------------------- plain environments
@needs_venv
@pytest.mark.parametrize(
    ("rule", "turn_rewards", "outcome"),
    [("sum", (0.0, 0.0), 1.5), ("last", (0.0, 0.0), 1.0), ("none", (0.5, 1.0), None)],
)
async def test_the_echo_template_pays_a_tenth_per_character_into_one_reward_channel(
    servers: dict[str, OpenEnvEnvironment],
    rule: str,
    turn_rewards: tuple[float, float],
    outcome: float | None,
) -> None:
    env = OpenEnvEnvironment("echo_env", max_turns=2, outcome=rule)
    assert env.spec.name == "openenv/echo_env" and env.text_field == "message" and env.spec.tools == ()
    first = await env.reset(Task("t", SEED, {}))
    ready = '{"echoed_message": "Echo Env environment ready!", "message_length": 0}'
    assert first == [{"role": "user", "content": ready}]
    hello = await env.step(Action("hello"))
    assert hello.messages == [{"role": "user", "content": '{"echoed_message": "hello", "message_length": 5}'}]
    assert (hello.reward, hello.done, hello.truncated, hello.outcome) == (turn_rewards[0], False, False, None)
    assert hello.info == {"metadata": {"original_message": "hello", "step": 1}, "env_reward": 0.5}
    long = await env.step(Action("twelve chars"))  # 12 characters: capped at 1.0
    assert (long.reward, long.truncated, long.outcome, long.info["env_reward"]) == (
        turn_rewards[1],
        True,
        outcome,
        1.0,
    )
    await env.close()
    await env.close()


@needs_venv
async def test_guess_feedback_keeps_the_episodes_state_across_turns(
    servers: dict[str, OpenEnvEnvironment],
) -> None:
    env = guess_env(observation_field="feedback", prompt="Play fair.")
    assert await env.reset(Task("t", SEED, {})) == [{"role": "user", "content": f"Play fair.\n\n{INTRO}"}]
    low, high = await env.step(Action(str(TARGET - 1))), await env.step(Action(str(TARGET + 1)))
    assert [low.messages[0]["content"], high.messages[0]["content"]] == ["Higher.", "Lower."]
    assert (low.reward, low.done, high.reward, high.done) == (0.0, False, 0.0, False)
    right = await env.step(Action(str(TARGET)))
    assert (right.messages[0]["content"], right.reward, right.done, right.outcome) == (
        "Correct!",
        0.0,  # the environment's 1.0 is the outcome: rollwise adds turn rewards and outcome
        True,
        1.0,
    )
    await env.close()


@needs_venv
async def test_json_actions_and_what_the_server_rejects_are_the_agents_mistakes(
    servers: dict[str, OpenEnvEnvironment],
) -> None:
    env = OpenEnvEnvironment("guess_env", path=FIXTURES, max_turns=3)  # two fields: JSON replies
    assert env.text_field is None
    await env.reset(Task("t", SEED, {}))
    prose = await env.step(Action("four"))
    wanted = "Reply with a JSON object of the action's fields: guess (string), note (string)."
    assert (prose.messages, prose.reward, prose.done, prose.info) == (
        [{"role": "user", "content": wanted}],
        0.0,
        False,
        {FORMAT_ERROR: wanted},
    )
    wrong_type = await env.step(Action('{"guess": 4}'))
    rejected = "That action is not valid: guess: Input should be a valid string"
    assert wrong_type.messages == [{"role": "user", "content": rejected}]
    assert wrong_type.info == {FORMAT_ERROR: rejected}
    fenced = await env.step(Action(f'```json\n{{"guess": "{TARGET}", "note": "a hunch"}}\n```'))
    assert (fenced.messages[0]["content"], fenced.done, fenced.outcome) == ("Correct!", True, 1.0)
    await env.close()


# --------------------------------------------------------------------------------- MCP environments
@needs_venv
async def test_mcp_tools_are_offered_called_and_scored_from_the_state(
    servers: dict[str, OpenEnvEnvironment],
) -> None:
    env = OpenEnvEnvironment("guess_tools_env", **TOOLS)
    assert env.info.mcp and env.spec.tools == (
        {
            "type": "function",
            "function": {
                "name": "guess",
                "description": 'Guess the hidden number; the answer is "higher", "lower" or "correct".',
                "parameters": {
                    "additionalProperties": False,
                    "properties": {"n": {"type": "integer"}},
                    "required": ["n"],
                    "type": "object",
                },
            },
        },
    )
    assert await env.reset(Task("t", SEED, {})) == [
        {"role": "user", "content": "Find the number from 1 to 8 with the guess tool."}
    ]
    calls = (ToolCall("guess", {"n": TARGET - 1}), ToolCall("nope", {}), ToolCall("guess", {"n": "x"}))
    first = await env.step(Action("...", calls, ("tool call 4 is not valid JSON",)))
    contents = [m["content"] for m in first.messages]
    assert contents[:3] == ["error: tool call 4 is not valid JSON", "higher", "error: Unknown tool: 'nope'"]
    assert contents[3].startswith("error: 1 validation error for call[guess]")
    assert [m["role"] for m in first.messages] == ["tool"] * 4
    assert (first.reward, first.done) == (0.0, False)
    found = await env.step(Action("...", (ToolCall("guess", {"n": TARGET}),)))
    assert (found.messages, found.info, found.done) == (
        [{"role": "tool", "name": "guess", "content": "correct"}],
        {"env_reward": 1.0},  # the score went 0 -> 1
        False,
    )
    final = await env.step(Action("It is found."))
    assert (final.messages, final.reward, final.done, final.outcome) == ([], 0.0, True, 1.0)
    await env.close()


# ---------------------------------------------------------------------------------- failure paths
@needs_venv
async def test_a_killed_server_costs_its_episode_and_the_next_episode_restarts_it(
    servers: dict[str, OpenEnvEnvironment],
) -> None:
    env = guess_env()
    await env.reset(Task("t", SEED, {}))
    server = env.server
    assert isinstance(server, LocalServer) and server.launch is not None
    pid = server.launch.proc.pid
    os.killpg(pid, signal.SIGKILL)
    with pytest.raises(OpenEnvError) as failed:
        await env.step(Action("1"))
    message = str(failed.value)
    assert message.startswith(
        f"openenv/guess_env: step: OpenEnv server guess_env.server.app:app (pid {pid}, "
    )
    assert "killed by signal 9 while serving; its log" in message
    await env.close()
    started = time.monotonic()
    again = guess_env()
    assert await again.reset(Task("t", SEED, {})) == [{"role": "user", "content": INTRO}]
    assert server.launch is not None and server.launch.proc.pid != pid
    assert (await again.step(Action(str(TARGET)))).outcome == 1.0
    await again.close()
    assert time.monotonic() - started < 30


@needs_venv
async def test_a_session_over_an_unsafe_environments_cap_costs_its_episode(
    servers: dict[str, OpenEnvEnvironment],
) -> None:
    safe = [guess_env() for _ in range(3)]  # its app says 1 session; it declares itself concurrency-safe
    await asyncio.gather(*(env.reset(Task("t", SEED, {})) for env in safe))
    for env in safe:
        await env.close()
    single = [guess_env(server_env={"GUESS_ENV_SINGLE": "1"}) for _ in range(2)]
    await single[0].reset(Task("t", SEED, {}))
    with pytest.raises(OpenEnvError, match=r"refused the session \(Server at capacity: 1/1 sessions active"):
        await single[1].reset(Task("t", SEED, {}))
    for env in single:
        await env.close()


def test_a_missing_venv_names_the_make_target(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLWISE_ECOSYSTEM_VENVS", str(tmp_path))
    with pytest.raises(EcosystemMissing, match=r"openenv's virtualenv is missing .*run `make env-openenv`"):
        resolve_env("openenv/echo_env")()
    with pytest.raises(ImportError, match="run `make env-openenv`"):
        members()


@needs_venv
def test_a_bad_base_url_or_a_module_that_does_not_import_stops_construction() -> None:
    with pytest.raises(ValueError, match="'localhost:8000' is not an http:// or https:// URL"):
        OpenEnvEnvironment("remote", base_url="localhost:8000")
    with pytest.raises(
        ValueError,
        match=r"openenv/remote: OpenEnv server at http://127.0.0.1:9: GET http://127.0.0.1:9/schema failed",
    ):
        OpenEnvEnvironment("remote", base_url="http://127.0.0.1:9", step_timeout_s=2.0)
    with pytest.raises(ValueError) as missing:
        OpenEnvEnvironment("no_such_env", path=FIXTURES)
    text = str(missing.value)
    assert "exited with code 1 before serving" in text
    assert "ModuleNotFoundError: No module named 'no_such_env'" in text
    assert "give the directory above its module as env.options.path" in text
    with pytest.raises(ValueError, match="'no such' is not an OpenEnv environment name"):
        OpenEnvEnvironment("no such")


@needs_venv
async def test_base_url_plays_a_server_the_user_runs(servers: dict[str, OpenEnvEnvironment]) -> None:
    base_url, _ = await servers["guess"].server.ensure_running()
    env = OpenEnvEnvironment("mine", base_url=base_url, action_field="guess")
    assert env.spec.name == "openenv/mine"
    assert await env.reset(Task("t", SEED, {})) == [{"role": "user", "content": INTRO}]
    assert (await env.step(Action(str(TARGET)))).outcome == 1.0
    await env.close()


# ------------------------------------------------------------------------------ tasks, family, check
@needs_venv
def test_tasks_are_seeded_and_a_split_covers_every_index(servers: dict[str, OpenEnvEnvironment]) -> None:
    env = servers["guess"]
    first = [t.seed for _, t in zip(range(4), env.tasks(7), strict=False)]
    assert first == [t.seed for _, t in zip(range(4), env.tasks(7), strict=False)] and len(set(first)) == 4
    split = guess_env(split="test", num_tasks=3)
    tasks = [t for _, t in zip(range(6), split.tasks(1), strict=False)]
    assert (
        sorted(t.data["index"] for t in tasks[:3]) == [0, 1, 2] == sorted(t.data["index"] for t in tasks[3:])
    )
    assert {t.data["split"] for t in tasks} == {"test"} and tasks[0].id.endswith("#0")


@needs_venv
def test_the_family_lists_the_venvs_openenv_distributions(servers: dict[str, OpenEnvEnvironment]) -> None:
    listed = {m.name: m.note for m in members()}
    assert listed["echo_env"] == "openenv-echo_env 0.1.0" and "core" not in listed
    with pytest.raises(Exception, match="is not an OpenEnv environment name or a dotted Python module path"):
        resolve_env("openenv/1abc")


@needs_venv
@pytest.mark.parametrize(
    ("name", "options"),
    [("openenv/guess_env", GUESS), ("openenv/guess_tools_env", TOOLS)],
)
async def test_env_check_passes(
    servers: dict[str, OpenEnvEnvironment], name: str, options: dict[str, Any]
) -> None:
    report = await check_env(resolve_env(name), episodes=4, seed=0, options=dict(options))
    assert report.passed, [(c.name, c.detail) for c in report.failures()]
