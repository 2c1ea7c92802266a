"""Where the model's context is known (a preset, model.path's config.json, SGLang's --context-length),
the config check refuses a reply longer than the context and cuts the episode budget to it (issue 33:
972 of 976 episodes ended engine_error once prompt + first reply filled a 1,024-token context)."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import pytest

from pipeline.contracts.config import ConfigError
from pipeline.supervisor.wiring import resolve_config


def _ns(tmp_path: Path, *overrides: str) -> argparse.Namespace:
    return argparse.Namespace(
        config=None, set=list(overrides), run_dir=str(tmp_path / "run"), max_steps=None, log_format=None
    )


def test_a_reply_longer_than_the_presets_context_is_refused_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"sampling\.max_new_tokens: 2000 .* context of 1024 tokens \(the 'tiny'"
    ):
        resolve_config(_ns(tmp_path, "sampling.max_new_tokens=2000"))


def test_a_model_paths_context_and_sglangs_context_length_flag_count(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 512}))
    with pytest.raises(ConfigError, match=rf"context of 512 tokens \({model}/config\.json\)"):
        resolve_config(_ns(tmp_path, f'model.path="{model}"', "sampling.max_new_tokens=600"))
    flag = ['engine.kind="sglang"', 'engine.extra_args=["--context-length", "4096"]']
    assert resolve_config(_ns(tmp_path, f'model.path="{model}"', "sampling.max_new_tokens=600", *flag))
    with pytest.raises(ConfigError, match=r"context of 256 tokens \(engine\.extra_args --context-length\)"):
        resolve_config(
            _ns(tmp_path, "sampling.max_new_tokens=300", 'engine.extra_args=["--context-length", "256"]')
        )


def test_an_episode_budget_beyond_the_context_is_cut_to_it_and_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        cfg = resolve_config(_ns(tmp_path, "env.max_context_tokens=8192", "sampling.max_new_tokens=1024")).cfg
    assert cfg.env.max_context_tokens == 1024
    assert "env.max_context_tokens = 8192 exceeds the model's context of 1024 tokens" in caplog.text
    kept = resolve_config(_ns(tmp_path, "env.max_context_tokens=300", "sampling.max_new_tokens=8")).cfg
    assert kept.env.max_context_tokens == 300
