import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from pipeline.contracts.config import Config, ConfigError, config_to_toml, load_config, write_resolved


def test_defaults_roundtrip_through_printed_toml() -> None:
    cfg = load_config()
    assert Config.model_validate(tomllib.loads(config_to_toml(cfg))) == cfg


def test_overrides_parse_literals_and_nested_keys() -> None:
    cfg = load_config(
        None,
        [
            "learner.lr=3e-3",
            "async.max_staleness=0",
            "env.options={low=1,high=8}",
            "engine.kind=embedded",
            "run.max_steps=7",
        ],
    )
    assert cfg.learner.lr == 0.003
    assert cfg.async_.max_staleness == 0
    assert cfg.env.options == {"low": 1, "high": 8}
    assert cfg.run.max_steps == 7


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("learner.lrr=1", "learner.lrr: Extra inputs are not permitted"),
        ("async.max_staleness=-1", "async.max_staleness: Input should be greater than or equal to 0"),
        ("sampling.top_p=0", "sampling.top_p: Input should be greater than 0"),
        ("engine.kind=external", "engine.urls must list at least one server"),
        ("learner.loss_level=ppo", "learner.loss_level: Input should be"),
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
        load_config(None, ["learner.lr"])


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
