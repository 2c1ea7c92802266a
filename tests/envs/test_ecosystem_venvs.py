"""Where the ecosystem libraries' interpreters are found (envs.ecosystems.ecosystem_venvs)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from envs.ecosystems.ecosystem_venvs import EcosystemMissing, venv_python, venvs_root


def test_the_venv_under_the_root_or_the_named_interpreter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ROLLWISE_ECOSYSTEM_VENVS", str(tmp_path))
    assert venvs_root() == tmp_path
    python = tmp_path / "openenv" / "bin" / "python"
    with pytest.raises(EcosystemMissing, match=r"openenv's virtualenv is missing .*run `make env-openenv`"):
        venv_python("openenv")
    python.parent.mkdir(parents=True)
    python.symlink_to(sys.executable)
    assert venv_python("openenv") == python
    assert venv_python("verifiers", python=sys.executable) == Path(sys.executable)


def test_a_wrong_name_or_interpreter_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown ecosystem 'gym'; known: openenv, verifiers, harbor"):
        venv_python("gym")
    with pytest.raises(EcosystemMissing, match=r"env.options.python = '.*nope' is not an executable file"):
        venv_python("harbor", python=str(tmp_path / "nope"))


def test_the_default_root_is_the_users_cache_and_for_root_one_every_sandbox_can_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("ROLLWISE_ECOSYSTEM_VENVS", raising=False)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert venvs_root() == Path.home() / ".cache" / "rollwise" / "venvs"
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert venvs_root() == Path("/opt/rollwise/venvs")
