"""Where the ecosystem libraries' interpreters live: one virtualenv per library, outside rollwise's own.

OpenEnv, verifiers and Harbor cannot share rollwise's interpreter (their pins conflict with rollwise's
and with each other; Harbor needs Python 3.12), so each runs in a process of its own, started with the
interpreter of its venv (docs/design/env_ecosystems.md). `make env-<name>` builds the venv from
``envs/ecosystems/requirements-<name>.txt`` under ``venvs_root()``; an adapter asks
``venv_python(name)`` for the interpreter, and a user who keeps the library elsewhere names it with the
environment's ``python`` option.

Rule: a missing interpreter is a configuration error that names the make target, raised before anything
starts, never an ImportError from deep inside an episode.
"""

from __future__ import annotations

import os
from pathlib import Path

ECOSYSTEMS = ("openenv", "verifiers", "harbor")


class EcosystemMissing(ValueError):
    """The library's venv (or the interpreter named by ``python``) is not there; the message says how."""


ROOT_VENVS = Path("/opt/rollwise/venvs")


def venvs_root() -> Path:
    """``$ROLLWISE_ECOSYSTEM_VENVS``, else /opt/rollwise/venvs for root, else ~/.cache/rollwise/venvs.

    Under root the sandboxes run as unprivileged uids, which cannot enter root's home: a venv whose code
    runs in a sandbox (verifiers) must live where every user can read it, on a system interpreter
    (`make env-verifiers` picks /usr/bin/python3 for root)."""
    root = os.environ.get("ROLLWISE_ECOSYSTEM_VENVS")
    if root:
        return Path(root).expanduser()
    return ROOT_VENVS if os.geteuid() == 0 else Path.home() / ".cache" / "rollwise" / "venvs"


def venv_python(name: str, python: str | None = None) -> Path:
    """The interpreter that runs ``name``'s library: ``python`` when given, else its venv's.

    Raises EcosystemMissing naming ``make env-<name>`` (or the ``python`` option) when it is absent.
    """
    if name not in ECOSYSTEMS:
        raise ValueError(f"unknown ecosystem {name!r}; known: {', '.join(ECOSYSTEMS)}")
    if python is not None:
        path = Path(python).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise EcosystemMissing(f"env.options.python = {python!r} is not an executable file")
        return path
    path = venvs_root() / name / "bin" / "python"
    if not path.exists():
        raise EcosystemMissing(
            f"{name}'s virtualenv is missing ({path}): run `make env-{name}` in a rollwise checkout, "
            f"or set env.options.python to an interpreter that has {name} installed"
        )
    return path
