"""harbor-tasks (envs.ecosystems): the shipped Harbor task set scores 1 with its oracles and 0 with an
empty agent, task directories are read (and refused) with the reason, the turn protocol answers bash
calls and mistakes, a verifier that writes no reward costs the episode, and `env check` passes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from envs.api import Action, EnvError, Task, ToolCall
from envs.checker import check_env
from envs.discovery import resolve_env
from envs.ecosystems.harbor_env import SHIPPED_TASKS, HarborTasksEnv, command_reply, reward_of
from envs.ecosystems.harbor_task_dir import find_task_dirs, read_task
from envs.sandbox.runner import SandboxResult, SandboxUnavailable
from tests.envs.test_sandbox import BWRAP_PROBLEM

needs_bwrap = pytest.mark.skipif(bool(BWRAP_PROBLEM), reason=f"bubblewrap unusable here: {BWRAP_PROBLEM}")
SHIPPED = ["fix-script", "fix-test", "hello-file", "word-count"]


def _task(
    root: Path, name: str, dockerfile: str, toml: str = "", test: str = "echo 1 > /logs/verifier/reward.txt"
) -> Path:
    path = root / name
    (path / "environment").mkdir(parents=True)
    (path / "tests").mkdir()
    (path / "task.toml").write_text(f'[task]\nname = "t/{name}"\n{toml}')
    (path / "instruction.md").write_text(f"Do {name}.\n")
    (path / "environment" / "Dockerfile").write_text(dockerfile)
    (path / "tests" / "test.sh").write_text(f"#!/bin/bash\n{test}\n")
    return path


def test_the_shipped_task_directories_are_read_with_nothing_refused() -> None:
    tasks = [read_task(p) for p in find_task_dirs(SHIPPED_TASKS)]
    assert [t.path.name for t in tasks] == SHIPPED
    assert all(t.problems == () and t.workdir == "/app" and t.solution for t in tasks)
    by_name = {t.path.name: t for t in tasks}
    assert by_name["word-count"].copies == (
        (SHIPPED_TASKS / "word-count/environment/data/notes.txt", "notes.txt"),
    )
    assert sorted(dest for _, dest in by_name["fix-script"].copies) == [
        "backup.sh",
        "data/a.txt",
        "data/b.txt",
        "data/c.log",
    ]
    hello = by_name["hello-file"]
    assert (hello.name, hello.agent_timeout_s, hello.verifier_timeout_s) == (
        "rollwise/hello-file",
        120.0,
        30.0,
    )
    assert (hello.memory_bytes, hello.file_bytes) == (512 * 2**20, 16 * 2**20)
    assert set(by_name["fix-test"].test_files) == {"test.sh", "reference_tests.py"}


def test_what_needs_an_image_or_docker_is_refused_with_the_line(tmp_path: Path) -> None:
    _task(tmp_path, "apt", "FROM debian\nWORKDIR /app\nRUN apt-get install -y \\\n    jq\n")
    _task(tmp_path, "image", "FROM x\nWORKDIR /app\n", toml='[environment]\ndocker_image = "org/img:1"\n')
    _task(tmp_path, "gpu", "FROM x\nWORKDIR /app\n", toml="[environment]\ngpus = 1\n")
    _task(tmp_path, "nowork", "FROM x\nCOPY a /a\n")
    outside = _task(
        tmp_path, "outside", "FROM x\nWORKDIR /app\nCOPY a.txt /etc/a.txt\nCOPY ../secret /app/\n"
    )
    (outside / "environment" / "a.txt").write_text("a")
    compose = _task(tmp_path, "compose", "FROM x\nWORKDIR /app\n")
    (compose / "environment" / "docker-compose.yaml").write_text("services: {}\n")
    problems = {p.name: read_task(p).problems for p in find_task_dirs(tmp_path)}
    assert problems["apt"] == (
        "environment/Dockerfile line 3: `RUN apt-get install -y jq` changes the image; rollwise runs tasks "
        "on the host's userland without building one",
    )
    assert problems["image"] == ("task.toml [environment] docker_image = 'org/img:1': a prebuilt image",)
    assert problems["gpu"] == ("task.toml [environment] gpus = 1: the sandbox has no GPU",)
    assert "COPY before WORKDIR" in problems["nowork"][0] and "no WORKDIR" in problems["nowork"][1]
    assert "COPY to /etc/a.txt leaves WORKDIR /app" in problems["outside"][0]
    assert "COPY source '../secret' is not a file or directory of environment/" in problems["outside"][1]
    assert problems["compose"] == ("environment/docker-compose.yaml: several containers need Docker",)
    with pytest.raises(
        ValueError, match=r"(?s)tasks that cannot run here:.*apt: environment/Dockerfile line 3"
    ):
        HarborTasksEnv(path=str(tmp_path))
    with pytest.raises(ValueError, match="is not a directory"):
        HarborTasksEnv(path=str(tmp_path / "absent"))
    with pytest.raises(SandboxUnavailable, match="harbor-tasks needs bubblewrap"):
        HarborTasksEnv(sandbox={"require": "rlimits", "bwrap": ""})


def test_rewards_come_from_reward_txt_or_json_and_nothing_else() -> None:
    assert reward_of({"reward.txt": b"1\n"}) == (1.0, {"reward": 1.0})
    assert reward_of({"reward.json": b'{"reward": 0.5, "style": 1}'}) == (0.5, {"reward": 0.5, "style": 1.0})
    assert reward_of({"reward.json": b'{"passed": 0.25}'}) == (0.25, {"passed": 0.25})
    for files, match in (
        ({}, "neither /logs/verifier/reward.txt nor reward.json"),
        ({"reward.json": b'{"a": 1, "b": 0}'}, "several rewards and no 'reward'"),
        ({"reward.txt": b"nan"}, "not finite"),
        ({"reward.txt": b"yes"}, "could not convert"),
    ):
        with pytest.raises(ValueError, match=match):
            reward_of(files)


def test_a_commands_reply_keeps_its_head_and_tail() -> None:
    long = SandboxResult("x" * 150 + "y" * 150, "oops\n", 2, False, False, "wall_time", "bwrap", 1.0, 0.0)
    reply = command_reply(long, 100)
    assert reply.startswith("exit code 2 (stopped: wall_time)\n" + "x" * 50 + "\n[... ")
    assert reply.endswith("y" * 35 + "\n[stderr]\noops\n")  # the last 50 characters


@needs_bwrap
@pytest.mark.parametrize("name", SHIPPED)
async def test_each_oracle_scores_1_and_an_empty_agent_0(name: str) -> None:
    for oracle in (True, False):
        env = HarborTasksEnv()
        messages = await env.reset(Task(id=name, seed=0, data={"task": name}))
        assert messages == [{"role": "user", "content": read_task(SHIPPED_TASKS / name).instruction}]
        try:
            if oracle:
                assert env.task is not None and env.task.solution is not None
                ran = await env.step(Action("", (ToolCall("bash", {"command": env.task.solution}),)))
                assert not ran.done and ran.messages[0]["content"].startswith("exit code 0")
            result = await env.step(Action("I am done."))
        finally:
            await env.close()
        assert result.done and not result.truncated
        assert result.outcome == (1.0 if oracle else 0.0), (name, oracle, result.info)


@needs_bwrap
async def test_files_persist_mistakes_are_answered_and_the_turn_limit_still_verifies() -> None:
    env = HarborTasksEnv(max_turns=3, max_calls_per_turn=1)
    await env.reset(Task(id="h", seed=0, data={"task": "hello-file"}))
    try:
        first = await env.step(
            Action(
                "",
                (
                    ToolCall("bash", {"command": "echo 'Hello, rollwise!' > greeting.txt; pwd"}),
                    ToolCall("bash", {"command": "true"}),
                ),
            )
        )
        assert [m["content"] for m in first.messages] == [
            "exit code 0\n/app\n",
            "Only the first 1 tool calls of a turn run.",
        ]
        second = await env.step(
            Action("<tool_call>{bad", (ToolCall("python", {"code": "1"}),), ("invalid JSON in tool call",))
        )
        assert [m["content"] for m in second.messages] == [
            "error: invalid JSON in tool call",
            "error: unknown tool 'python'; the tool is 'bash'",
        ]
        last = await env.step(Action("", (ToolCall("bash", {"command": ""}),)))
        assert last.messages[0]["content"] == 'error: "command" must be a non-empty string of bash'
        assert last.truncated and not last.done and last.outcome == 1.0  # the file was made on turn 1
    finally:
        await env.close()


@needs_bwrap
async def test_a_fork_continues_from_the_same_files_and_never_touches_the_original() -> None:
    env = HarborTasksEnv(max_turns=4)
    await env.reset(Task(id="h", seed=0, data={"task": "hello-file"}))
    twin = None
    try:
        await env.step(Action("", (ToolCall("bash", {"command": "echo draft > notes.txt"}),)))
        twin = await env.fork()
        assert twin.session is not env.session and twin.turns == env.turns == 1
        solve = "cat notes.txt; echo 'Hello, rollwise!' > greeting.txt"
        ran = await twin.step(Action("", (ToolCall("bash", {"command": solve}),)))
        assert ran.messages[0]["content"] == "exit code 0\ndraft\n"  # the trunk's file came along
        seen = await env.step(Action("", (ToolCall("bash", {"command": "ls"}),)))
        assert seen.messages[0]["content"] == "exit code 0\nnotes.txt\n"  # the twin's file did not
        assert (await twin.step(Action("done"))).outcome == 1.0
        assert (await env.step(Action("done"))).outcome == 0.0
    finally:
        await env.close()
        if twin is not None:
            await twin.close()


@needs_bwrap
async def test_a_verifier_that_writes_no_reward_costs_the_episode(tmp_path: Path) -> None:
    shutil.copytree(SHIPPED_TASKS / "hello-file", tmp_path / "hello-file")
    (tmp_path / "hello-file" / "tests" / "test.sh").write_text("#!/bin/bash\necho broken >&2; exit 4\n")
    env = HarborTasksEnv(path=str(tmp_path))
    await env.reset(next(env.tasks(0)))
    try:
        with pytest.raises(
            EnvError, match=r"rollwise/hello-file: the verifier wrote neither .* exit 4: 'broken\\n'"
        ):
            await env.step(Action("done"))
    finally:
        await env.close()


def test_the_task_stream_is_seeded_and_covers_the_set() -> None:
    env = HarborTasksEnv.__new__(HarborTasksEnv)
    env.task_set = tuple(read_task(p) for p in find_task_dirs(SHIPPED_TASKS))
    first = [t.data["task"] for _, t in zip(range(8), env.tasks(3), strict=False)]
    again = [t.data["task"] for _, t in zip(range(8), env.tasks(3), strict=False)]
    assert first == again and sorted(first[:4]) == SHIPPED and sorted(first[4:]) == SHIPPED
    assert first != [t.data["task"] for _, t in zip(range(8), env.tasks(4), strict=False)]


@needs_bwrap
async def test_env_check_passes_on_the_shipped_set() -> None:
    report = await check_env(resolve_env("harbor-tasks"), episodes=4, seed=0)
    assert report.passed, [(c.name, c.detail) for c in report.failures()]
