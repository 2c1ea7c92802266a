"""The first program of an agent-process episode, inside the sandbox (process_agent.py sends this file's
source as the sandbox's main.py): it relays 127.0.0.1:<port> to the endpoint's Unix socket, runs
the agent's command, and reports how it ended as ONE JSON line on its stdout.

Why a relay: under bubblewrap the sandbox has its own network namespace (loopback only), so neither the
host's endpoint nor any other address is reachable; the endpoint's Unix socket is the one way out, bind-
mounted in. Agents only know HTTP base URLs, so this process listens on the sandbox's own loopback and
copies bytes both ways. With rlimits only (no namespace) there is nothing to relay: the agent gets the
endpoint's TCP address and ``relay_port`` is 0.

Reads ``rollwise_agent.json`` from the working directory: ``argv`` (the command), ``env`` (variables
added to the sandbox's), ``socket`` and ``relay_port`` (the relay; none when 0), ``outcome_file``,
``max_stdout`` (bytes of the agent's stdout kept). The agent's stdin is this process's (the task JSON),
its stderr goes to the sandbox's, its stdout to a file; the report: ``{"exit": <code or -signal>,
"stdout": <its stdout, cut at max_stdout>, "outcome_file": <that file's text or null>}``, or
``{"error": "..."}`` when the command could not start.

Only the standard library, and syntax any Python 3.9+ understands.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable
    from typing import Any

CONFIG_FILE = "rollwise_agent.json"
STDOUT_FILE = ".rollwise_agent_stdout"
CHUNK = 1 << 16


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            data = await reader.read(CHUNK)
            if not data:
                break
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        try:  # noqa: SIM105  (contextlib costs this process a start-up import for nothing)
            writer.close()
        except (ConnectionError, OSError):
            pass


def _relay(socket_path: str) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
    async def connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            upstream_reader, upstream_writer = await asyncio.open_unix_connection(socket_path)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, upstream_writer), _pipe(upstream_reader, writer))

    return connect


def _read(path: str, limit: int) -> str | None:
    try:
        with open(path, "rb") as handle:
            return handle.read(limit).decode("utf-8", "replace")
    except OSError:
        return None


async def main() -> None:
    with open(CONFIG_FILE) as handle:  # noqa: ASYNC230  (nothing else runs yet)
        config = json.load(handle)
    server: Any = None
    if config["relay_port"]:
        server = await asyncio.start_server(_relay(config["socket"]), "127.0.0.1", config["relay_port"])
    env = dict(os.environ)
    env.update(config["env"])
    try:
        with open(STDOUT_FILE, "wb") as out:  # noqa: ASYNC230  (an open, no I/O)
            proc = await asyncio.create_subprocess_exec(*config["argv"], stdout=out, env=env)
            code = await proc.wait()
    except OSError as exc:
        report: dict[str, Any] = {"error": "the command could not start: " + str(exc)}
    else:
        report = {
            "exit": code,
            "stdout": _read(STDOUT_FILE, config["max_stdout"]) or "",
            "outcome_file": _read(config["outcome_file"], config["max_stdout"]),
        }
    if server is not None:
        server.close()
    sys.stdout.write("\n" + json.dumps(report) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    asyncio.run(main())
