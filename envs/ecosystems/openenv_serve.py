"""Serve one OpenEnv environment for rollwise. Run as a script by the OpenEnv venv's interpreter
(envs.ecosystems.openenv_server starts it); rollwise's own process never imports it, and it imports
nothing of rollwise (stdlib, uvicorn and openenv only).

    <openenv venv>/bin/python openenv_serve.py APP --ready-file PATH [--sessions N] [--parent-pid PID]

- APP is uvicorn's ``module:attr`` of the environment's FastAPI app (``<module>.server.app:app``), imported
  with the working directory first on ``sys.path`` (the adapter sets it to the environment's ``path``).
- Sessions: an OpenEnv app fixes ``max_concurrent_envs`` in its own code (the ``openenv init`` template
  says 1, and no environment variable changes it), and a ``/ws`` session over the cap is refused with
  CAPACITY_REACHED. So ``HTTPEnvServer.__init__`` (openenv/core/env_server/http_server.py) is wrapped
  before the app is imported: the cap is raised to N when openenv's own rule allows it
  (``_validate_concurrency_safety``: the environment class declares ``SUPPORTS_CONCURRENT_SESSIONS``,
  i.e. each session's instance keeps its own state); an environment that does not declare it keeps the
  cap its app set.
- Web UI: unless ``ENABLE_WEB_INTERFACE`` turns OpenEnv's Gradio interface on, the module that builds it
  (openenv/core/env_server/web_interface.py) is reported missing, the case openenv/core/env_server/
  __init__.py already handles (its ``except ModuleNotFoundError``): importing Gradio is most of a
  server's start time, and rollwise only speaks ``/ws``. An environment that imports Gradio itself
  still gets it.
- Port: binds 127.0.0.1:0 itself and hands the socket to uvicorn (no race for a free port). Once uvicorn
  has started, writes PATH atomically (rename) as JSON: ``port``, ``sessions`` (the cap in force),
  ``declared_sessions`` (the app's own), ``openenv`` (its version), ``pid``.
- Lifetime: stops when its parent (``--parent-pid``) is gone (checked every 0.5 s), and on SIGTERM or
  SIGINT (uvicorn's graceful shutdown, at most 2 s for open sessions).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.abc
import importlib.metadata
import importlib.util
import json
import os
import socket
import sys
from typing import Any

PARENT_CHECK_S = 0.5
WEB_INTERFACE_MODULE = "openenv.core.env_server.web_interface"
GRACEFUL_SHUTDOWN_S = 2


def raise_session_cap(sessions: int, record: dict[str, Any]) -> None:
    """Wrap HTTPEnvServer.__init__ so that a concurrency-safe environment accepts `sessions` sessions;
    `record` receives the declared and the effective cap."""
    http_server = importlib.import_module("openenv.core.env_server.http_server")
    exceptions = importlib.import_module("openenv.core.env_server.exceptions")
    server_class = http_server.HTTPEnvServer
    original = server_class.__init__

    def patched(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        declared = self._max_concurrent_envs
        record["declared_sessions"] = record["sessions"] = declared
        if sessions <= declared:
            return
        config = self._concurrency_config
        self._max_concurrent_envs = sessions
        self._concurrency_config = config.model_copy(update={"max_concurrent_envs": sessions})
        try:
            self._validate_concurrency_safety()
        except exceptions.ConcurrencyConfigurationError:
            self._max_concurrent_envs, self._concurrency_config = declared, config
            return
        record["sessions"] = sessions

    server_class.__init__ = patched


class _NoWebInterface(importlib.abc.MetaPathFinder):
    """Reports OpenEnv's web-interface module as missing (module docstring, "Web UI")."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == WEB_INTERFACE_MODULE:
            raise ModuleNotFoundError(f"No module named {name!r} (rollwise serves /ws only)", name=name)
        return None


def web_interface_wanted() -> bool:
    """OpenEnv's own test of ENABLE_WEB_INTERFACE (create_app in http_server.py)."""
    return os.getenv("ENABLE_WEB_INTERFACE", "false").lower() in ("true", "1", "yes")


def write_ready(path: str, info: dict[str, Any]) -> None:
    partial = f"{path}.partial"
    with open(partial, "w") as handle:
        json.dump(info, handle)
    os.replace(partial, path)


async def serve(server: Any, sock: socket.socket, ready_file: str, info: dict[str, Any], parent: int) -> None:
    serving = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started:
        if serving.done():
            await serving  # startup failed: uvicorn has logged why
            raise SystemExit(3)
        await asyncio.sleep(0.02)
    write_ready(ready_file, info)
    while not serving.done():
        if parent and os.getppid() != parent:
            print(f"openenv_serve: parent {parent} is gone, stopping", file=sys.stderr, flush=True)
            server.should_exit = True
        await asyncio.wait({serving}, timeout=PARENT_CHECK_S)
    await serving


def main() -> None:
    parser = argparse.ArgumentParser(description="Serve one OpenEnv environment on 127.0.0.1 for rollwise.")
    parser.add_argument("app", help="uvicorn import string of the app, e.g. echo_env.server.app:app")
    parser.add_argument("--ready-file", required=True, help="written (JSON) once the server accepts sessions")
    parser.add_argument("--sessions", type=int, default=256, help="session cap for concurrency-safe envs")
    parser.add_argument("--parent-pid", type=int, default=0, help="stop when this process is gone")
    args = parser.parse_args()
    if args.parent_pid and os.getppid() != args.parent_pid:
        raise SystemExit(f"openenv_serve: parent {args.parent_pid} is already gone")
    sys.path[0] = os.getcwd()  # the environment's directory, not this script's (envs/ecosystems)
    package = args.app.partition(":")[0].split(".")[0]
    if importlib.util.find_spec(package) is None:  # fail before the second it takes to import openenv
        missing = f"No module named {package!r} (not installed, not in {os.getcwd()})"
        raise SystemExit(f"ModuleNotFoundError: {missing}")
    if not web_interface_wanted():
        sys.meta_path.insert(0, _NoWebInterface())
    record: dict[str, Any] = {}
    raise_session_cap(args.sessions, record)
    uvicorn = importlib.import_module("uvicorn")
    app = importlib.import_module("uvicorn.importer").import_from_string(args.app)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    server = uvicorn.Server(config)
    info = {
        "port": sock.getsockname()[1],
        "sessions": record.get("sessions"),
        "declared_sessions": record.get("declared_sessions"),
        "openenv": importlib.metadata.version("openenv"),
        "pid": os.getpid(),
    }
    asyncio.run(serve(server, sock, args.ready_file, info, args.parent_pid))


if __name__ == "__main__":
    main()
