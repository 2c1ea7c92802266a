import json
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path
from typing import Any

import pytest

from pipeline.contracts.config import Config, ConfigError, config_to_toml, load_config, write_resolved
from pipeline.contracts.learner_config import FLAT_KEYS, LOSS_LEVELS, DecaySchedule, DeprecatedConfigKey


def test_defaults_roundtrip_through_printed_toml() -> None:
    cfg = load_config()
    assert Config.model_validate(tomllib.loads(config_to_toml(cfg))) == cfg


def test_overrides_parse_literals_and_nested_keys() -> None:
    cfg = load_config(
        None,
        [
            "learner.optim.lr=3e-3",
            "async.max_staleness=0",
            "env.options={low=1,high=8}",
            "engine.kind=embedded",
            "run.max_steps=7",
        ],
    )
    assert cfg.learner.optim.lr == 0.003
    assert cfg.async_.max_staleness == 0
    assert cfg.env.options == {"low": 1, "high": 8}
    assert cfg.run.max_steps == 7


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("learner.lrr=1", "learner.lrr: Extra inputs are not permitted"),
        ("async.max_staleness=-1", "async.max_staleness: Input should be greater than or equal to 0"),
        ("async.cut_late_groups=1.5", "async.cut_late_groups: Input should be less than or equal to 1"),
        ("sampling.top_p=0", "sampling.top_p: Input should be greater than 0"),
        ("engine.kind=external", "engine.urls must list at least one server"),
        ("learner.loss.kind=ppo", "learner.loss.kind: Input should be"),
        ("nosection.x=1", "nosection: Extra inputs are not permitted"),
    ],
)
def test_bad_values_name_the_key(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert message in str(err.value)


def test_bad_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[learner\nlr=1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="expected key=value"):
        load_config(None, ["learner.optim.lr"])


def test_write_resolved_is_loadable(tmp_path: Path) -> None:
    cfg = load_config(None, ["learner.batch_groups=3"])
    path = write_resolved(cfg, tmp_path / "run")
    assert load_config(path) == cfg


def test_config_show_is_fast_and_imports_no_torch() -> None:
    code = (
        "import sys; from pipeline.cli import main; main(['config','show']); "
        "assert 'torch' not in sys.modules"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "[learner]" in out.stdout and "clip_low = 0.0003" in out.stdout


def test_cli_rejects_bad_config_with_exit_2() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "config", "show", "--set", "learner.bogus=1"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and "learner.bogus" in out.stderr


# --- the learner's tables and the flat keys they replaced ---------------------------------------------------
EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.toml"))


def flat_learner(tree: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """`tree` with [learner]'s tables written as the flat keys of before (the inverse of the migration),
    and the new keys that moved."""
    inverse = {(table, key): flat for flat, (table, key) in FLAT_KEYS.items()}
    levels = LOSS_LEVELS
    learner = dict(tree.get("learner", {}))
    moved = []
    for table in {table for table, _ in FLAT_KEYS.values()}:
        for key, value in learner.pop(table, {}).items():
            flat = inverse[(table, key)]
            learner[flat] = levels[value] if flat == "loss_level" else value
            moved.append(f"learner.{table}.{key}")
    return {**tree, "learner": learner}, moved


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_every_shipped_example_in_the_old_flat_form_loads_the_same_with_a_warning_per_key(
    example: Path, tmp_path: Path
) -> None:
    tree = tomllib.loads(example.read_text())
    old_tree, moved = flat_learner(tree)
    old = tmp_path / "old.toml"
    old.write_text(_toml(old_tree))
    assert moved, f"{example.name} sets no key of the learner's tables"
    with pytest.warns(DeprecatedConfigKey) as caught:
        migrated = load_config(old)
    assert migrated == load_config(example)
    messages = [str(w.message) for w in caught]
    assert sorted(m.split(": use ")[1].split(" ")[0] for m in messages) == sorted(moved)
    assert all(" is deprecated: use learner." in m for m in messages)
    # `config show` prints the new form, which loads without a warning.
    shown = config_to_toml(migrated)
    assert "[learner.optim]" in shown and "\nlr = " not in shown.split("[learner.optim]")[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecatedConfigKey)
        assert Config.model_validate(tomllib.loads(shown)) == migrated


def test_an_old_resolved_config_with_every_flat_key_spelled_out_resumes(tmp_path: Path) -> None:
    """The run directory's config.toml of an older rollwise spells out every key, the constant schedule's
    unused decay keys included: it must resume as the same config."""
    tree = tomllib.loads(config_to_toml(load_config()))
    old_tree, _ = flat_learner(tree)
    old_tree["learner"] |= {"lr_schedule": "constant", "lr_decay_steps": 0, "lr_min_ratio": 0.0}
    old_tree["learner"]["dtype"] = old_tree["learner"].pop("precision")
    (tmp_path / "config.toml").write_text(_toml(old_tree))
    with pytest.warns(DeprecatedConfigKey):
        assert load_config(tmp_path / "config.toml") == load_config()


def test_a_key_given_both_flat_and_in_its_table_is_refused_naming_both() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, ["learner.lr=1e-3", "learner.optim.lr=2e-3"])
    assert "learner.lr and learner.optim.lr are the same setting" in str(info.value)


def test_a_decay_needs_its_length_and_a_constant_schedule_has_none() -> None:
    cfg = load_config(None, ['learner.schedule.kind="linear"', "learner.schedule.decay_steps=100"])
    assert isinstance(cfg.learner.schedule, DecaySchedule) and cfg.learner.schedule.decay_steps == 100
    with pytest.raises(ConfigError, match=r"learner\.schedule\.decay_steps: Field required"):
        load_config(None, ['learner.schedule.kind="cosine"'])
    with pytest.raises(ConfigError, match=r"learner\.schedule\.decay_steps: Extra inputs are not permitted"):
        load_config(None, ["learner.schedule.decay_steps=100"])


def test_the_command_line_shows_a_deprecated_key_as_one_line_naming_the_new_key(tmp_path: Path) -> None:
    old = tmp_path / "old.toml"
    old.write_text("[learner]\nlr = 0.003\n")
    shown = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "config", "show", "--config", str(old)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert shown.stderr == (
        "rollwise: warning: learner.lr is deprecated: use learner.optim.lr (the old key is read until "
        "rollwise 0.3)\n"
    )
    assert "[learner.optim]\n# AdamW learning rate" in shown.stdout and "lr = 0.003" in shown.stdout


def _toml(tree: dict[str, Any]) -> str:
    """A config tree as TOML (tables of scalars, lists and inline tables; what configs hold)."""
    out: list[str] = []

    def table(name: str, node: dict[str, Any]) -> None:
        out.append(f"[{name}]")
        subtables = {k: v for k, v in node.items() if isinstance(v, dict) and k not in ("options",)}
        for key, value in node.items():
            if key not in subtables:
                out.append(f"{key} = {_value(value)}")
        for key, value in subtables.items():
            table(f"{name}.{key}", value)

    for name, node in tree.items():
        table(name, node)
    return "\n".join(out) + "\n"


def _value(value: Any) -> str:
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_value(v)}" for k, v in value.items()) + " }"
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    return json.dumps(value)
