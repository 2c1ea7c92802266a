"""Fixtures shared across test modules: the tiny preset is built once per session (read-only)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from pipeline.tools.fake_sglang import FakeSGLang


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny preset (seed 0) in HF format. Tests read it; none may write into it."""
    from learner.model_init import init_model

    return init_model(tmp_path_factory.mktemp("tiny") / "model", preset="tiny", seed=0)


@pytest.fixture(scope="session")
def moe_tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The moe-tiny preset (Qwen3-MoE, 8 experts, top-2; seed 0) in HF format. Read-only like tiny's."""
    from learner.model_init import init_model

    return init_model(tmp_path_factory.mktemp("moe-tiny") / "model", preset="moe-tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Only the tiny preset's tokenizer files (fast: no model weights)."""
    from learner.model_init import build_tokenizer, vocab_hints, write_tokenizer

    out = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(build_tokenizer(vocab_hints()), out)
    return out


@pytest.fixture(scope="module")
def tok(tiny_tokenizer_dir: Path) -> Any:
    """The tiny preset's tokenizer (one per module: a test may change its settings)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


@pytest.fixture
async def fake() -> AsyncIterator[FakeSGLang]:
    """The SGLang fake with its defaults, serving; a module defines its own `fake` to script it."""
    from pipeline.tools.fake_sglang import FakeSGLang

    server = FakeSGLang()
    await server.start()
    yield server
    await server.stop()


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Tiny matmuls: extra intra-op threads only add contention (10x slower on a busy 2-core machine)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
