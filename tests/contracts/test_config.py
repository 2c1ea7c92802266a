import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from pipeline.contracts.config import Config, ConfigError, config_to_toml, load_config, write_resolved
from pipeline.contracts.config_engine import ENGINE_KINDS, FlightTransport
from pipeline.contracts.learner_config import FLAT_KEYS, DecaySchedule


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


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_every_shipped_example_loads_and_roundtrips(example: Path) -> None:
    cfg = load_config(example)
    assert Config.model_validate(tomllib.loads(config_to_toml(cfg))) == cfg


@pytest.mark.parametrize("flat", sorted(FLAT_KEYS))
def test_a_flat_learner_key_from_before_the_tables_is_refused_naming_its_table(flat: str) -> None:
    table, key = FLAT_KEYS[flat]
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"learner.{flat}=1"])
    assert f"learner.{flat} is learner.{table}.{key} now" in str(info.value)


def test_an_old_resolved_config_is_refused_naming_the_new_place(tmp_path: Path) -> None:
    old = tmp_path / "config.toml"
    old.write_text('[learner]\ndtype = "float32"\n')
    with pytest.raises(ConfigError, match=r"learner\.dtype is learner\.precision now"):
        load_config(old)
    old.write_text('[learner]\nloss_level = "sequence"\n')
    with pytest.raises(ConfigError, match=r"learner\.loss_level is learner\.loss\.kind now \(values"):
        load_config(old)


def test_a_decay_needs_its_length_and_a_constant_schedule_has_none() -> None:
    cfg = load_config(None, ['learner.schedule.kind="linear"', "learner.schedule.decay_steps=100"])
    assert isinstance(cfg.learner.schedule, DecaySchedule) and cfg.learner.schedule.decay_steps == 100
    with pytest.raises(ConfigError, match=r"learner\.schedule\.decay_steps: Field required"):
        load_config(None, ['learner.schedule.kind="cosine"'])
    with pytest.raises(ConfigError, match=r"learner\.schedule\.decay_steps: Extra inputs are not permitted"):
        load_config(None, ["learner.schedule.decay_steps=100"])


def test_the_command_line_refuses_a_flat_key_naming_the_new_key(tmp_path: Path) -> None:
    old = tmp_path / "old.toml"
    old.write_text("[learner]\nlr = 0.003\n")
    shown = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "config", "show", "--config", str(old)],
        capture_output=True,
        text=True,
    )
    assert shown.returncode == 2 and "learner.lr is learner.optim.lr now" in shown.stderr


# --- [engine] and [transport]: one model per kind ---------------------------------------------------------
def test_each_engine_kind_loads_its_own_model_and_roundtrips() -> None:
    kinds = {
        "embedded": ["engine.threads=2", "engine.max_batch=8"],
        "sglang": ["engine.tp=2", "engine.mem_fraction_static=0.5", "engine.num_engines=2"],
        "external": ['engine.urls=["http://127.0.0.1:1"]', 'engine.router.kind="sglang-router"'],
    }
    for kind, keys in kinds.items():
        cfg = load_config(None, [f'engine.kind="{kind}"', *keys, 'transport.kind="flight"'])
        assert type(cfg.engine) is ENGINE_KINDS[kind] and isinstance(cfg.transport, FlightTransport)
        shown = config_to_toml(cfg)
        assert "[engine.router]" in shown
        assert Config.model_validate(tomllib.loads(shown)) == cfg


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ['engine.kind="sglang"', "engine.threads=2"],
            "engine.threads is a setting of engine.kind = 'embedded', not 'sglang'",
        ),
        (
            ['engine.urls=["http://h:1"]'],
            "engine.urls is a setting of engine.kind = 'external', not 'embedded'",
        ),
        (
            ['engine.kind="external"', 'engine.urls=["http://h:1"]', "engine.port=1"],
            "engine.port is a setting of engine.kind = 'embedded' or 'sglang', not 'external'",
        ),
        (
            ["transport.flight_port=1"],
            "transport.flight_port is a setting of transport.kind = 'flight', not 'spool'",
        ),
        (['engine.kind="bogus"'], "engine.kind: Input tag 'bogus'"),
        (
            ['engine.kind="sglang"', "engine.tp=0"],
            "engine.tp: Input should be greater than or equal to 1 (engine.kind = 'sglang')",
        ),
        (['engine.router_host="0.0.0.0"'], "engine.router_host is engine.router.host now"),
        (["engine.router_port=1"], "engine.router_port is engine.router.port now"),
        (
            ['engine.router="sglang-router"'],
            "engine.router is a table now: set engine.router.kind = 'sglang-router'",
        ),
        (['engine.router.kind="nginx"'], "engine.router.kind: Input should be 'none' or 'sglang-router'"),
        (['engine.kind="sglang"', 'engine.weight_transport="http"'], "needs engines with a fetcher"),
        (
            ['engine.kind="external"', 'engine.urls=["http://h:1"]', 'engine.fetch_urls=["http://f:1"]'],
            "engine.fetch_urls needs engine.weight_transport = 'http'",
        ),
        (
            ['learner.remote.spool_url="grpc://s:1"'],
            "learner.remote.spool_url reads the spool over Arrow Flight",
        ),
    ],
)
def test_a_key_of_another_kind_or_from_before_the_tables_is_refused_naming_it(
    overrides: list[str], message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert message in str(info.value)


@pytest.mark.parametrize("override", ["engine.kind=[1]", "transport.kind={a=1}", "engine.kind=3"])
def test_a_kind_that_is_not_a_name_is_a_config_error(override: str) -> None:
    with pytest.raises(ConfigError, match=override.split("=")[0].replace(".", r"\.")):
        load_config(None, [override])
