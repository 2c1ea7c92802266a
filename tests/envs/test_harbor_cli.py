"""Harbor's own CLI on rollwise's bubblewrap runtime (envs/ecosystems/harbor_bwrap_runtime.py).

Real Harbor (its venv, `make env-harbor`) and real bubblewrap, no fakes. One `harbor run` (through
envs/ecosystems/harbor-run.sh) plays the `oracle` and `nop` agents on a dataset made of the four
shipped tasks, a task whose Dockerfile needs an image (refused with the reason) and a task whose oracle
leaves a background process and a /tmp file for its verifier (the namespace persists between commands).
One script in Harbor's interpreter then drives the runtime class directly for what the CLI cannot
show: limits, network, transfers, users, timeouts, clean-up.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import tempfile
import textwrap
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest

from envs.ecosystems.ecosystem_venvs import EcosystemMissing, venv_python
from envs.ecosystems.harbor_env import SHIPPED_TASKS
from tests.envs.test_sandbox import BWRAP_PROBLEM

REPO = Path(__file__).resolve().parents[2]
HARBOR_RUN = REPO / "envs" / "ecosystems" / "harbor-run.sh"
SHIPPED = ["fix-script", "fix-test", "hello-file", "word-count"]
CLI_TIMEOUT_S = 240


def _harbor_python() -> Path | None:
    try:
        return venv_python("harbor")
    except EcosystemMissing:
        return None


HARBOR_PYTHON = _harbor_python()
pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        HARBOR_PYTHON is None, reason="Harbor's venv is missing: run `make env-harbor` (Python 3.12)"
    ),
    pytest.mark.skipif(bool(BWRAP_PROBLEM), reason=f"bubblewrap unusable here: {BWRAP_PROBLEM}"),
]


def _write_task(
    root: Path, name: str, dockerfile: str, solve: str, test: str, toml: str = "", internet: bool = False
) -> Path:
    path = root / name
    for sub in ("environment", "solution", "tests"):
        (path / sub).mkdir(parents=True)
    (path / "task.toml").write_text(
        f'schema_version = "1.1"\n[task]\nname = "rollwise-test/{name}"\n'
        "[verifier]\ntimeout_sec = 30.0\n[agent]\ntimeout_sec = 60.0\n"
        f"[environment]\ncpus = 1\nallow_internet = {str(internet).lower()}\n{toml}"
    )
    (path / "instruction.md").write_text(f"Solve {name}.\n")
    (path / "environment" / "Dockerfile").write_text(dockerfile)
    (path / "solution" / "solve.sh").write_text(f"#!/bin/bash\n{solve}\n")
    (path / "tests" / "test.sh").write_text(f"#!/bin/bash\n{test}\n")
    return path


def _process_lines(marker: str) -> list[str]:
    """Live processes whose command line carries `marker`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmdline and state != "Z":
            found.append(f"{pid}: {cmdline[:120]}")
    return found


class ScriptedEndpoint:
    """An OpenAI-compatible chat endpoint on 127.0.0.1 that plays terminus-2's JSON protocol: on
    hello-file's first turn it types the answer into the terminal, on every other turn it declares the
    task complete (terminus-2 asks for that twice). Counts the requests it answered."""

    ANSWER: ClassVar[dict[str, Any]] = {
        "analysis": "The file does not exist yet.",
        "plan": "Write the greeting.",
        "commands": [{"keystrokes": "echo 'Hello, rollwise!' > /app/greeting.txt\n", "duration": 0.1}],
        "task_complete": False,
    }
    COMPLETE: ClassVar[dict[str, Any]] = {
        "analysis": "Done.",
        "plan": "Nothing left.",
        "commands": [],
        "task_complete": True,
    }

    def __init__(self) -> None:
        self.requests = 0
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                endpoint.requests += 1
                messages = body["messages"]
                first_turn = not any(m["role"] == "assistant" for m in messages)
                answer = first_turn and "greeting.txt" in json.dumps(messages)
                content = json.dumps(ScriptedEndpoint.ANSWER if answer else ScriptedEndpoint.COMPLETE)
                choice = {
                    "index": 0,
                    "message": {"role": "assistant", "content": content},
                    "finish_reason": "stop",
                }
                reply = json.dumps(
                    {
                        "id": f"scripted-{endpoint.requests}",
                        "object": "chat.completion",
                        "created": 0,
                        "model": body.get("model", "scripted"),
                        "choices": [choice],
                        "usage": {"prompt_tokens": 10, "completion_tokens": 10, "total_tokens": 20},
                    }
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> dict[str, Any]:
    """One `harbor run` of oracle and nop over the dataset (module docstring): the trials' results by
    (agent, task directory), the sandboxes' temporary directory and the background process's marker."""
    base = tmp_path_factory.mktemp("harbor-cli")
    dataset = base / "dataset"
    for name in SHIPPED:
        shutil.copytree(SHIPPED_TASKS / name, dataset / name)
    _write_task(
        dataset,
        "needs-image",
        "FROM debian:bookworm-slim\nWORKDIR /app\nRUN apt-get install -y cowsay\n",
        "cowsay hi > /app/said.txt",
        "echo 1 > /logs/verifier/reward.txt",
    )
    marker = f"{random.randint(100, 999)}.{random.randint(10**6, 10**7)}"
    _write_task(
        dataset,
        "keeps-state",
        "FROM debian:bookworm-slim\nWORKDIR /app\n",
        # No redirection: the background process keeps the command's output open.
        f"sleep {marker} &\necho $! > /tmp/keeper.pid\necho kept > /tmp/note.txt",
        'pid="$(cat /tmp/keeper.pid 2>/dev/null)"\n'
        'if [ -n "$pid" ] && kill -0 "$pid" && [ "$(cat /tmp/note.txt)" = kept ]; then\n'
        "  echo 1 > /logs/verifier/reward.txt\nelse\n  echo 0 > /logs/verifier/reward.txt\nfi",
    )
    endpoint = ScriptedEndpoint()
    request.addfinalizer(endpoint.close)
    terminus = {
        "name": "terminus-2",
        "model_name": "hosted_vllm/scripted",
        "kwargs": {
            "api_base": f"http://127.0.0.1:{endpoint.port}/v1",
            "record_terminal_session": False,  # asciinema would be installed from the network
            "model_info": {
                "max_input_tokens": 32768,
                "max_output_tokens": 4096,
                "input_cost_per_token": 0.0,
                "output_cost_per_token": 0.0,
            },
        },
    }
    config = base / "job.json"
    agents = [{"name": "oracle"}, {"name": "nop"}, terminus]
    config.write_text(json.dumps({"agents": agents, "n_concurrent_trials": 18}))
    # The sandboxes' directories, where the namespace's uid (65534 under root) reaches them.
    sandboxes = Path(tempfile.mkdtemp(prefix="rollwise-test-harbor-cli-", dir="/tmp"))
    os.chmod(sandboxes, 0o711)
    request.addfinalizer(lambda: shutil.rmtree(sandboxes, ignore_errors=True))
    jobs = base / "jobs"
    environment = {**os.environ, "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}
    environment.pop("PYTHONPATH", None)
    argv = [str(HARBOR_RUN), "-c", str(config), "-p", str(dataset), "-o", str(jobs), "-y", "-q"]
    done = subprocess.run(
        [*argv, "--ek", f"sandbox_dir={sandboxes}"],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        env=environment,
        cwd=base,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    trials: dict[tuple[str, str], dict[str, Any]] = {}
    for result_file in jobs.glob("*/*/result.json"):
        result = json.loads(result_file.read_text())
        task = result_file.parent.name.split("__")[0]
        trials[(result["agent_info"]["name"], task)] = result
    return {"trials": trials, "sandboxes": sandboxes, "marker": marker, "requests": endpoint.requests}


def _reward(result: dict[str, Any]) -> float | None:
    verifier = result.get("verifier_result") or {}
    rewards = verifier.get("rewards") or {}
    value = rewards.get("reward")
    return None if value is None else float(value)


def test_harbor_cli_oracle_scores_1_on_every_shipped_task(cli_run: dict[str, Any]) -> None:
    trials = cli_run["trials"]
    assert {task: _reward(trials["oracle", task]) for task in SHIPPED} == dict.fromkeys(SHIPPED, 1.0)
    assert all(trials["oracle", task]["exception_info"] is None for task in SHIPPED)


def test_harbor_cli_nop_agent_scores_0_on_every_shipped_task(cli_run: dict[str, Any]) -> None:
    trials = cli_run["trials"]
    assert {task: _reward(trials["nop", task]) for task in SHIPPED} == dict.fromkeys(SHIPPED, 0.0)
    assert all(trials["nop", task]["exception_info"] is None for task in SHIPPED)


def test_harbor_cli_refuses_a_task_that_needs_an_image_with_the_reason(cli_run: dict[str, Any]) -> None:
    for agent in ("oracle", "nop", "terminus-2"):
        result = cli_run["trials"][agent, "needs-image"]
        assert _reward(result) is None
        error = result["exception_info"]
        assert error["exception_type"] == "SandboxBuildFailedError"
        assert (
            "needs-image cannot run on the bubblewrap runtime: environment/Dockerfile line 3: "
            "`RUN apt-get install -y cowsay` changes the image" in error["exception_message"]
        )


def test_harbor_cli_trial_keeps_processes_and_files_between_commands(cli_run: dict[str, Any]) -> None:
    # The oracle's command and the verifier's are two execs: the verifier sees the oracle's background
    # process alive and its /tmp file; without the oracle there is neither.
    assert _reward(cli_run["trials"]["oracle", "keeps-state"]) == 1.0
    assert _reward(cli_run["trials"]["nop", "keeps-state"]) == 0.0


def test_harbor_cli_terminus_2_on_a_scripted_endpoint_solves_hello_file(cli_run: dict[str, Any]) -> None:
    # terminus-2 (Harbor's LLM agent, on the host) keeps a tmux server in the namespace across execs:
    # the keystrokes of its first turn write the file. Elsewhere it only declares the task complete.
    trials = cli_run["trials"]
    expected = {task: 1.0 if task == "hello-file" else 0.0 for task in [*SHIPPED, "keeps-state"]}
    assert {task: _reward(trials["terminus-2", task]) for task in expected} == expected
    assert all(trials["terminus-2", task]["exception_info"] is None for task in expected)
    assert cli_run["requests"] >= 2 * len(expected)


def test_harbor_cli_leaves_no_sandbox_behind(cli_run: dict[str, Any]) -> None:
    assert _process_lines(f"sleep {cli_run['marker']}") == []
    assert list(cli_run["sandboxes"].glob("rollwise-harbor-*")) == []


PROBE = textwrap.dedent(
    """
    import asyncio, json, os, socket, sys
    from pathlib import Path

    from harbor.models.task.task import Task
    from harbor.models.trial.paths import TrialPaths

    from envs.ecosystems.harbor_bwrap_runtime import BwrapEnvironment

    def environment(task_dir, out, **options):
        task = Task(Path(task_dir))
        paths = TrialPaths(Path(out))
        paths.mkdir()
        return BwrapEnvironment(
            environment_dir=task.paths.environment_dir,
            environment_name=task.name,
            session_id=f"{task.name}__env",
            trial_paths=paths,
            task_env_config=task.config.environment,
            **options,
        )

    def alive(marker):  # whether a live process carries `marker` in its command line
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                line = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\\0", b" ").decode()
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if marker in line and state != "Z":
                return True
        return False

    def connect_command(port):
        return f"python3 -c 'import socket; socket.create_connection((\\"127.0.0.1\\", {port}), 2)'"

    async def main(task_dir, open_task_dir, out, secret, marker):
        env = environment(task_dir, Path(out) / "trial")
        seen = {}

        async def run(name, command, **options):
            try:
                result = await env.exec(command, **options)
                seen[name] = [result.return_code, result.stdout, result.stderr]
            except Exception as exc:
                seen[name] = [type(exc).__name__, str(exc)]

        await env.start(force_build=False)
        trial_dir = env._trial_dir
        try:
            await run("first", "pwd; cat data.txt; echo $GREETING; id -u; ls -d /logs/*")
            await run("background", f"sleep {marker} & echo $! > /tmp/bg.pid; echo kept > /tmp/note")
            await run("second", 'kill -0 "$(cat /tmp/bg.pid)" && cat /tmp/note && pwd', cwd="/tmp")
            await run("timeout", f"sleep {marker}1", timeout_sec=1)
            seen["timeout_leftover"] = alive(f"sleep {marker}1")
            await run("other_user", "true", user="nobody")
            await run("memory", "python3 -c 'bytearray(1 << 30)'")
            await run("file_size", "head -c 3000000 /dev/zero > big.bin")
            listener = socket.socket()
            listener.bind(("127.0.0.1", 0))
            listener.listen()
            port = listener.getsockname()[1]
            await run("network", connect_command(port))
            await run("links", f"ln -s {secret} /work/link && mkdir -p /logs/agent/sub && "
                      f"ln -s {secret} /logs/agent/sub/link && echo inside > /logs/agent/sub/ok.txt")
            try:
                await env.download_file("/work/link", Path(out) / "link")
                seen["download_link"] = (Path(out) / "link").read_text()
            except RuntimeError as exc:
                seen["download_link"] = ["RuntimeError", str(exc)]
            await env.download_dir("/logs/agent", Path(out) / "agent")
            seen["downloaded"] = sorted(
                str(p.relative_to(Path(out) / "agent")) for p in (Path(out) / "agent").rglob("*")
            )
            (Path(out) / "up").mkdir()
            (Path(out) / "up" / "x.sh").write_text("echo uploaded")
            (Path(out) / "up" / "x.sh").chmod(0o755)
            await env.upload_dir(Path(out) / "up", "/work/up")
            await env.upload_file(Path(out) / "up" / "x.sh", "sub/y.sh")
            await run("uploaded", "/work/up/x.sh && sub/y.sh && stat -c %u up/x.sh")
            seen["host_owner"] = os.stat(trial_dir / "root" / "work" / "up" / "x.sh").st_uid
        finally:
            await env.stop(delete=True)
        open_env = environment(open_task_dir, Path(out) / "open-trial")
        await open_env.start(force_build=False)
        try:
            result = await open_env.exec(connect_command(port))
            seen["open_network"] = [result.return_code, result.stdout, result.stderr]
        finally:
            await open_env.stop(delete=True)
            listener.close()
        seen["removed"] = not trial_dir.exists()
        seen["leftover"] = alive(f"sleep {marker}")
        if os.geteuid() == 0:  # the namespace's uid (65534) cannot reach a 0700 directory of root's
            (Path(out) / "closed").mkdir(mode=0o700)
            closed = environment(task_dir, Path(out) / "closed-trial", sandbox_dir=str(Path(out) / "closed"))
            try:
                await closed.start(force_build=False)
                seen["closed"] = "started"
            except RuntimeError as exc:
                seen["closed"] = str(exc)
            finally:
                await closed.stop(delete=True)
        print(json.dumps(seen))

    asyncio.run(main(*sys.argv[1:]))
    """
)


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The runtime class driven directly in Harbor's interpreter (PROBE), on a task with a WORKDIR, a
    COPY, an ENV, 256 MB of memory and 1 MB files."""
    base = tmp_path_factory.mktemp("harbor-runtime")
    task = _write_task(
        base,
        "probe",
        "FROM debian:bookworm-slim\nWORKDIR /work\nCOPY data.txt /work/data.txt\nENV GREETING=hello\n",
        "true",
        "echo 1 > /logs/verifier/reward.txt",
        toml="memory_mb = 256\nstorage_mb = 1\n",
    )
    (task / "environment" / "data.txt").write_text("copied\n")
    open_task = _write_task(
        base, "open", "FROM debian:bookworm-slim\nWORKDIR /app\n", "true", "true", internet=True
    )
    secret = base / "host-secret.txt"
    secret.write_text("host only\n")
    out = base / "out"
    out.mkdir()
    marker = f"{random.randint(100, 999)}.{random.randint(10**6, 10**7)}"
    environment = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [str(HARBOR_PYTHON), "-c", PROBE, str(task), str(open_task), str(out), str(secret), marker],
        capture_output=True,
        text=True,
        timeout=120,
        env=environment,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def test_runtime_starts_in_the_workdir_with_copy_env_and_output_dirs(probe: dict[str, Any]) -> None:
    assert probe["first"] == [
        0,
        "/work\ncopied\nhello\n0\n/logs/agent\n/logs/artifacts\n/logs/verifier\n",
        None,
    ]


def test_runtime_namespace_keeps_background_processes_and_tmp(probe: dict[str, Any]) -> None:
    assert probe["background"] == [0, None, None]
    assert probe["second"] == [0, "kept\n/tmp\n", None]


def test_runtime_command_past_its_timeout_is_killed_with_an_error(probe: dict[str, Any]) -> None:
    assert probe["timeout"] == ["RuntimeError", "Command timed out after 1 seconds"]
    assert probe["timeout_leftover"] is False


def test_runtime_refuses_a_user_other_than_root(probe: dict[str, Any]) -> None:
    assert probe["other_user"][0] == "RuntimeError"
    assert "user 'nobody' does not exist there" in probe["other_user"][1]


def test_runtime_applies_memory_and_file_size_limits_of_task_toml(probe: dict[str, Any]) -> None:
    code, _, stderr = probe["memory"]
    assert code == 1 and stderr.rstrip().endswith("MemoryError")
    assert probe["file_size"][0] == 128 + 25  # SIGXFSZ: the 3 MB file passes storage_mb = 1


def test_runtime_without_allow_internet_reaches_no_host_port(probe: dict[str, Any]) -> None:
    code, _, stderr = probe["network"]
    assert code == 1 and "ConnectionRefusedError" in stderr


def test_runtime_of_a_public_network_task_shares_the_hosts_network(probe: dict[str, Any]) -> None:
    assert probe["open_network"] == [0, None, None]


def test_runtime_transfers_never_follow_a_link_to_a_host_file(probe: dict[str, Any]) -> None:
    # Inside the sandbox the host path does not exist; the absolute link is not extracted on the host.
    assert probe["download_link"][0] == "RuntimeError"
    assert "No such file or directory" in probe["download_link"][1]
    assert probe["downloaded"] == ["sub", "sub/ok.txt"]


def test_runtime_uploads_keep_modes_and_belong_to_the_sandbox(probe: dict[str, Any]) -> None:
    assert probe["uploaded"] == [0, "uploaded\nuploaded\n0\n", None]
    assert probe["host_owner"] == (65534 if os.geteuid() == 0 else os.geteuid())


def test_runtime_stop_kills_the_namespace_and_removes_its_directory(probe: dict[str, Any]) -> None:
    assert probe["removed"] is True
    assert probe["leftover"] is False


@pytest.mark.skipif(os.geteuid() != 0, reason="the namespace runs as another uid only under root")
def test_runtime_refuses_a_sandbox_dir_its_uid_cannot_reach(probe: dict[str, Any]) -> None:
    assert probe["closed"].endswith(
        "closed is not reachable by uid 65534, the sandbox's: name a directory that is "
        "(--ek sandbox_dir=/tmp, or TMPDIR)"
    )
