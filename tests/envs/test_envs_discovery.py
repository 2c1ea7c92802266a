"""Discovery: entry points by name (lazily), module:attr paths, collisions, the plugin template."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from envs import discovery
from envs.api import Action, EnvSpec, Message, StepResult, Task
from envs.discovery import EnvDiscoveryError, EnvInfo, list_envs, main_list, resolve_env
from envs.grid_nav import GridNavEnv
from envs.guess_number import GuessNumberEnv
from envs.sync_adapter import AsyncAdapter, SyncEnvironment

REPO = Path(__file__).resolve().parents[2]
BUILTIN_NAMES = {"guess-number", "calculator", "grid-nav", "word-guess"}

NOT_A_FACTORY = 42


def _fake_entry_points(*rows: tuple[str, str, str]) -> list[tuple[EntryPoint, str, str]]:
    """(name, value, distribution) rows as the discovery module's listing function returns them."""
    return [(EntryPoint(name, value, discovery.ENTRY_POINT_GROUP), dist, "1.0") for name, value, dist in rows]


def test_builtins_are_listed_with_their_distribution() -> None:
    infos = {info.name: info for info in list_envs()}
    assert set(infos) >= BUILTIN_NAMES
    assert infos["guess-number"] == EnvInfo(
        "guess-number", "envs.guess_number:GuessNumberEnv", "rollwise", infos["guess-number"].version
    )
    assert [info.name for info in list_envs()] == sorted(info.name for info in list_envs())


def test_resolve_by_entry_point_name() -> None:
    assert resolve_env("guess-number") is GuessNumberEnv


def test_resolve_by_module_path() -> None:
    assert resolve_env("envs.grid_nav:GridNavEnv") is GridNavEnv
    assert resolve_env("envs.grid_nav:GridNavEnv.gold_action") is GridNavEnv.gold_action


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("no_such_module_xyz:Env", "cannot import module 'no_such_module_xyz'"),
        ("envs.grid_nav:NoSuchEnv", "has no attribute 'NoSuchEnv'"),
        ("envs.grid_nav:", "not a 'module:attr' path"),
        (f"{__name__}:NOT_A_FACTORY", "not a factory"),
    ],
)
def test_bad_module_paths_are_explained(path: str, message: str) -> None:
    with pytest.raises(EnvDiscoveryError, match=message):
        resolve_env(path)


def test_unknown_name_lists_the_available_ones() -> None:
    with pytest.raises(EnvDiscoveryError, match="no environment named 'nope'") as caught:
        resolve_env("nope")
    for name in BUILTIN_NAMES:
        assert name in str(caught.value)


def test_name_collision_names_both_distributions(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = _fake_entry_points(
        ("dup", "envs.guess_number:GuessNumberEnv", "pkg-alpha"),
        ("dup", "envs.grid_nav:GridNavEnv", "pkg-beta"),
        ("solo", "envs.grid_nav:GridNavEnv", "pkg-beta"),
    )
    monkeypatch.setattr(discovery, "_group_entry_points", lambda: rows)
    monkeypatch.setattr(discovery, "_family_entry_points", list)
    with pytest.raises(EnvDiscoveryError, match="declared by several distributions") as caught:
        resolve_env("dup")
    assert "pkg-alpha" in str(caught.value) and "pkg-beta" in str(caught.value)
    assert resolve_env("solo") is GridNavEnv
    assert [(i.name, i.distribution) for i in list_envs()] == [
        ("dup", "pkg-alpha"),
        ("dup", "pkg-beta"),
        ("solo", "pkg-beta"),
    ]


def test_same_distribution_seen_twice_is_not_a_collision(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = _fake_entry_points(
        ("twice", "envs.grid_nav:GridNavEnv", "rollwise"), ("twice", "envs.grid_nav:GridNavEnv", "rollwise")
    )
    monkeypatch.setattr(discovery, "_group_entry_points", lambda: rows)
    assert resolve_env("twice") is GridNavEnv


def test_entry_point_that_fails_to_load_is_explained(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = _fake_entry_points(("broken", "no_such_module_xyz:Env", "pkg-broken"))
    monkeypatch.setattr(discovery, "_group_entry_points", lambda: rows)
    with pytest.raises(EnvDiscoveryError, match=r"cannot load environment 'broken'.*pkg-broken"):
        resolve_env("broken")


class EchoSync(SyncEnvironment):
    def __init__(self, word: str = "hi") -> None:
        self.spec = EnvSpec(name="echo-sync", version="1", max_turns=1)
        self.word = word

    def tasks(self, seed: int) -> Iterator[Task]:
        return (Task(str(i), i, {}) for i in itertools.count())

    def reset(self, task: Task) -> list[Message]:
        return [{"role": "user", "content": self.word}]

    def step(self, action: Action) -> StepResult:
        return StepResult([], done=True, outcome=1.0)


async def test_sync_environment_class_is_wrapped_in_the_adapter() -> None:
    env = resolve_env(f"{__name__}:EchoSync")(word="yo")
    assert isinstance(env, AsyncAdapter)
    assert await env.reset(Task("t", 0, {})) == [{"role": "user", "content": "yo"}]


def test_main_list_prints_table_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main_list([]) == 0
    table = capsys.readouterr().out
    assert table.splitlines()[0].split() == ["NAME", "VERSION", "DISTRIBUTION", "FACTORY"]
    assert "envs.word_guess:WordGuessEnv" in table
    assert main_list(["--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {row["name"] for row in rows} >= BUILTIN_NAMES
    assert set(rows[0]) == {"name", "value", "distribution", "version", "note", "import_error"}
    assert all(row["import_error"] is None for row in rows if row["name"] in BUILTIN_NAMES)


def test_main_list_marks_an_environment_whose_import_fails(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = _fake_entry_points(
        ("fine", "envs.guess_number:GuessNumberEnv", "pkg-fine"),
        ("broken", "no_such_module_xyz:Env", "pkg-broken"),
    )
    monkeypatch.setattr(discovery, "_group_entry_points", lambda: rows)
    monkeypatch.setattr(discovery, "_family_entry_points", list)
    assert main_list([]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert "IMPORT FAILS: ModuleNotFoundError: No module named 'no_such_module_xyz'" in lines["broken"]
    assert "IMPORT FAILS" not in lines["fine"]
    assert main_list(["--json"]) == 0
    listed = {row["name"]: row["import_error"] for row in json.loads(capsys.readouterr().out)}
    assert listed == {"broken": "ModuleNotFoundError: No module named 'no_such_module_xyz'", "fine": None}
    assert main_list(["--no-import"]) == 0
    assert "IMPORT FAILS" not in capsys.readouterr().out


def test_main_list_with_nothing_installed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(discovery, "_group_entry_points", list)
    monkeypatch.setattr(discovery, "_family_entry_points", list)
    assert main_list([]) == 0
    assert "no environments installed" in capsys.readouterr().out
    with pytest.raises(EnvDiscoveryError, match="available: none installed"):
        resolve_env("guess-number")


def _run_python(code: str, extra_path: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if extra_path is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(extra_path), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=120,
        check=False,
    )


def test_resolving_one_name_imports_no_other_environment() -> None:
    code = (
        "import sys\n"
        "from envs.discovery import list_envs, resolve_env\n"
        "list_envs()\n"
        "after_list = sorted(m for m in sys.modules if m.startswith('envs.'))\n"
        "resolve_env('grid-nav')\n"
        "after_resolve = sorted(m for m in sys.modules if m.startswith('envs.'))\n"
        "print(after_list, after_resolve, sep='\\n')\n"
    )
    done = _run_python(code)
    assert done.returncode == 0, done.stderr
    after_list, after_resolve = done.stdout.strip().splitlines()
    assert after_list == "['envs.api', 'envs.discovery', 'envs.sync_adapter']"
    assert after_resolve == "['envs.api', 'envs.discovery', 'envs.grid_nav', 'envs.sync_adapter']"


def test_plugin_template_installs_and_is_discovered(tmp_path: Path) -> None:
    source = tmp_path / "plugin-template"
    shutil.copytree(REPO / "examples" / "plugin-template", source)  # builds never litter the repo
    target = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "--no-cache-dir", "--target", str(target), str(source)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert install.returncode == 0, install.stderr
    code = (
        "import json, sys\n"
        "from envs.discovery import list_envs, resolve_env\n"
        "from envs.checker import main\n"
        "info = [i for i in list_envs() if i.name == 'echo-count']\n"
        "print(json.dumps([i.distribution for i in info]))\n"
        "print(resolve_env('echo-count').__module__)\n"
        "sys.exit(main(['echo-count', '--episodes', '4', '--json']))\n"
    )
    done = _run_python(code, extra_path=target)
    assert done.returncode == 0, done.stdout + done.stderr
    distributions, module, *report_lines = done.stdout.splitlines()
    assert json.loads(distributions) == ["rollwise-echo"]
    assert module == "rollwise_echo.env"
    report = json.loads("\n".join(report_lines))
    assert report["passed"] is True
    assert report["stats"]["gold_mean_outcome"] == 1.0
