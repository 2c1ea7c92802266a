"""What the fake generates and how long it takes: plans (ids, log-probs, finish), the log-probs of the
weights it serves, and a GPU-like latency model. Pure functions of their inputs: a test can predict
every answer."""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipeline.tools.fake_sglang.sglang_rules import dumps


@dataclass
class GenerateCall:
    """What a script sees for one sample: the prompt, its sampling params and the sample's rid."""

    input_ids: list[int]
    sampling_params: dict[str, Any]
    rid: str
    sample_index: int
    logprob_start_len: int = -1
    identity: str | None = None  # the weights it is served with (None: the fake's served weights)
    routed_experts_start_len: int | None = None  # the request asked for routed experts from here


@dataclass
class Plan:
    """The completion to emit. `finish` applies when every id was emitted (unless aborted first);
    `matched` is the stop token for finish "stop" (defaults to the last id). A scripted plan is
    emitted as given, even beyond the request's max_new_tokens: the script is the ground truth."""

    output_ids: list[int]
    logprobs: list[float] | None = None
    finish: str = "stop"
    matched: int | str | None = None


Script = Callable[[GenerateCall], Plan]


def default_plan(
    input_ids: list[int], sampling: dict[str, Any], *, vocab_size: int, eos_token_id: int | None, salt: int
) -> Plan:
    """Deterministic completion seeded by the prompt and the sample index (SGLang's CPU backend does not
    honour sampling_seed, so neither does the fake): ids in [0, vocab_size), log-probs in (-5, -0.01);
    each step stops with probability 0.1 on a stop token."""
    seed_src = dumps([input_ids, salt]).encode()
    rng = random.Random(int.from_bytes(hashlib.blake2b(seed_src, digest_size=8).digest(), "big"))
    stops = [int(t) for t in sampling.get("stop_token_ids") or []]
    if eos_token_id is not None and not sampling.get("ignore_eos"):
        stops.append(eos_token_id)
    max_new = int(sampling.get("max_new_tokens", 128))
    ids: list[int] = []
    logprobs: list[float] = []
    for _ in range(max_new):
        if stops and rng.random() < 0.1:
            ids.append(rng.choice(stops))
            logprobs.append(-rng.uniform(0.01, 1.0))
            return Plan(ids, logprobs, "stop", ids[-1])
        token = rng.randrange(vocab_size)
        while token in stops:
            token = rng.randrange(vocab_size)
        ids.append(token)
        logprobs.append(-rng.uniform(0.01, 5.0))
    return Plan(ids, logprobs, "length")


def prompt_logprobs(identity: str, ids: list[int], *, noise: float = 0.0) -> list[float]:
    """The fake's log P(ids[i + 1] | ids[: i + 1]) under the weights named `identity` (a path).

    `noise` > 0 adds the engine's numerical floor: a deviation of mean absolute size `noise` nats that
    depends on the position and token but not on the weights, as a bf16 or fp16 kernel differs from an
    fp32 learner whatever weights it runs (observed on SGLang's CPU backend: 0.149 nats per token in
    fp16, 0.0012 in bf16)."""
    values = []
    for i in range(1, len(ids)):
        digest = hashlib.blake2b(dumps([identity, ids[: i + 1]]).encode(), digest_size=4).digest()
        value = -0.05 - int.from_bytes(digest, "big") % 5000 / 1000.0
        if noise > 0.0:
            wobble = hashlib.blake2b(dumps([i, ids[i]]).encode(), digest_size=4).digest()
            u = int.from_bytes(wobble, "big") / 2**32  # uniform in [0, 1): mean |2u - 1| = 1/2
            value += noise * 2.0 * (2.0 * u - 1.0)
        values.append(value)
    return values


def routed_experts(
    identity: str, ids: list[int], start: int, *, layers: int, topk: int, num_experts: int
) -> list[int]:
    """The fake's routed experts of positions [start, len(ids) - 1) of the sequence `ids` under the weights
    `identity`: per position and layer, `topk` distinct expert ids in [0, num_experts), flattened C-order.
    A pure function of (identity, position, the token there, layer), so two requests over the same prefix
    report the same routing for it, as a real engine with the same weights does."""
    values: list[int] = []
    for position in range(start, len(ids) - 1):
        for layer in range(layers):
            digest = hashlib.blake2b(
                dumps([identity, position, ids[position], layer]).encode(), digest_size=8
            )
            pick = random.Random(int.from_bytes(digest.digest(), "big")).sample(range(num_experts), topk)
            values.extend(pick)
    return values


@dataclass(frozen=True)
class LatencyModel:
    """A GPU-like engine far from saturation: `prefill_s` before the first token, then `per_token_s` per
    token, decoded in chunks of `chunk_tokens` (asyncio.sleep: it costs no CPU, and it does not depend
    on how many requests run at once). `load_s` is a weight update's load time."""

    per_token_s: float = 0.002
    prefill_s: float = 0.02
    chunk_tokens: int = 8
    load_s: float = 0.05


def lognormal_script(
    *, median_tokens: float, sigma: float, seed: int, alphabet: range = range(97, 123)
) -> Script:
    """Plans whose lengths are lognormal(median_tokens, sigma) (a long tail), capped by max_new_tokens, a
    function of the rid and `seed`; ids from `alphabet`, ending on the first stop token when the length
    falls short of the cap."""

    def plan(call: GenerateCall) -> Plan:
        cap = int(call.sampling_params.get("max_new_tokens", 128))
        stops = [int(t) for t in call.sampling_params.get("stop_token_ids") or []]
        digest = hashlib.blake2b(f"{seed}:{call.rid}".encode(), digest_size=8).digest()
        rng = random.Random(int.from_bytes(digest, "big"))
        n = max(1, min(cap, round(median_tokens * math.exp(rng.gauss(0.0, sigma)))))
        stopped = n < cap and bool(stops)
        ids = [rng.choice(alphabet) for _ in range(n - 1 if stopped else n)]
        if stopped:
            ids.append(stops[0])
        return Plan(ids, [-1.0] * len(ids), "stop" if stopped else "length", ids[-1] if stopped else None)

    return plan
