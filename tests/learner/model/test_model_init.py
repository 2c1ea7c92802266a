"""The embedded default model preset: files, determinism, tokenizer coverage, chat template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from envs import builtin_vocab_hints
from learner.model.model_init import (
    CHAT_TEMPLATE,
    ENDOFTEXT,
    IM_END,
    IM_START,
    PRESETS,
    build_model,
    count_parameters,
    init_model,
    main,
)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("tiny") / "model", preset="tiny", seed=0)


@pytest.fixture(scope="module")
def tokenizer(tiny_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_dir)


def _tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


def test_writes_every_hf_file(tiny_dir: Path) -> None:
    names = {p.name for p in tiny_dir.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    } <= names


def test_same_seed_gives_identical_files_and_other_seed_differs(tiny_dir: Path, tmp_path: Path) -> None:
    again = init_model(tmp_path / "again", preset="tiny", seed=0)
    other = init_model(tmp_path / "other", preset="tiny", seed=1)
    first, second, third = _tensors(tiny_dir), _tensors(again), _tensors(other)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert any(not torch.equal(first[k], third[k]) for k in first if first[k].ndim == 2)
    assert (tiny_dir / "tokenizer.json").read_bytes() == (again / "tokenizer.json").read_bytes()
    assert (tiny_dir / "config.json").read_text() == (again / "config.json").read_text()


def test_transformers_loads_it_without_extra_code(tiny_dir: Path, tokenizer: Any) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.config.tie_word_embeddings is True
    assert model.config.max_position_embeddings == 1024
    assert model.config.vocab_size == len(tokenizer)
    ids = torch.tensor([tokenizer.encode("Guess my number from 1 to 16.")])
    logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()


def test_tiny_preset_size_is_small(tiny_dir: Path, tokenizer: Any) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert 200_000 <= count_parameters(model) <= 2_000_000
    assert 256 + 5 <= len(tokenizer) <= 2048


def test_small_preset_size() -> None:
    model = build_model(PRESETS["small"], 1000, eos_id=2, pad_id=0, seed=0)
    assert 5_000_000 <= count_parameters(model) <= 20_000_000


def test_special_tokens_and_generation_config(tiny_dir: Path, tokenizer: Any) -> None:
    tok = tokenizer
    im_end = tok.convert_tokens_to_ids(IM_END)
    assert tok.eos_token == IM_END and tok.eos_token_id == im_end
    assert tok.pad_token == ENDOFTEXT
    for special in (ENDOFTEXT, IM_START, IM_END, "<tool_call>", "</tool_call>"):
        assert len(tok.encode(f"a{special}b")) == 3, special
    # The tool-call tags survive skip_special_tokens so a parser can see them; ChatML markers do not.
    ids = tok.encode(f"{IM_START}<tool_call>x</tool_call>{IM_END}")
    assert tok.decode(ids, skip_special_tokens=True) == "<tool_call>x</tool_call>"
    generation = json.loads((tiny_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == im_end
    assert generation["do_sample"] is True
    assert generation["temperature"] == 1.0 and generation["top_p"] == 1.0
    assert "top_k" not in generation  # SGLang rejects top_k=0; absent means "full vocabulary" everywhere
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["eos_token_id"] == im_end


@pytest.mark.parametrize("text", ["12", " 12", "16", " 1", "higher", " higher", "lower", " lower", "correct"])
def test_environment_words_are_single_tokens(tokenizer: Any, text: str) -> None:
    assert len(tokenizer.encode(text)) == 1


def test_every_builtin_hint_word_is_one_token_alone_and_after_a_space(tokenizer: Any) -> None:
    pre = tokenizer.backend_tokenizer.pre_tokenizer
    special = {ENDOFTEXT, IM_START, IM_END, "<tool_call>", "</tool_call>"}
    checked = 0
    for hint in builtin_vocab_hints():
        if hint in special:
            continue
        for text in (hint, " " + hint):
            for _, (start, end) in pre.pre_tokenize_str(text):
                piece = text[start:end]
                assert len(tokenizer.encode(piece)) == 1, repr(piece)
                checked += 1
    assert checked >= 2 * 20


def test_numbers_and_feedback_are_single_tokens_inside_the_chat_template(tokenizer: Any) -> None:
    messages = [
        {"role": "user", "content": "Guess my number from 1 to 16."},
        {"role": "assistant", "content": "12"},
        {"role": "user", "content": "higher"},
    ]
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    pieces = [tokenizer.decode([i]) for i in ids]
    assert pieces == [
        IM_START, "user", "\n", "Guess", " my", " number", " from", " 1", " to", " 16", ".", IM_END, "\n",
        IM_START, "assistant", "\n", "12", IM_END, "\n",
        IM_START, "user", "\n", "higher", IM_END, "\n",
        IM_START, "assistant", "\n",
    ]  # fmt: skip


@pytest.mark.parametrize(
    "text", ["héllo wörld", "🌍 中文 \t\n  x", "\x00\x7f", "naïve café 12345678901234567890"]
)
def test_any_utf8_text_round_trips(tokenizer: Any, text: str) -> None:
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text


def test_chat_template_renders_chatml_with_tools_and_tool_responses(tokenizer: Any) -> None:
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 7 + 12?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "calculator", "arguments": {"expression": "7 + 12"}},
                }
            ],
        },
        {"role": "tool", "content": "19"},
        {"role": "tool", "content": "ok"},
        {"role": "assistant", "content": "19"},
    ]
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert (
        '\n{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}\n'
        in text
    )
    assert text.endswith(
        "<|im_start|>user\nWhat is 7 + 12?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "7 + 12"}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n19\n</tool_response>\n<tool_response>\nok\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n19<|im_end|>\n"
    )
    assert text.count("<|im_start|>system") == 1


def test_chat_template_without_tools_or_system(tokenizer: Any) -> None:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_cli_main_writes_a_loadable_model(tmp_path: Path) -> None:
    assert main(["--out", str(tmp_path / "m"), "--preset", "tiny", "--seed", "3"]) == 0
    config = json.loads((tmp_path / "m" / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE
    assert config["eos_token"] == IM_END


def test_unknown_preset_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        init_model(tmp_path, preset="huge")
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path), "--preset", "huge"])
