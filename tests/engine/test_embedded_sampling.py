"""Pure sampling maths of the embedded engine (pipeline/engine/sampling.py)."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.engine.sampling import (
    RequestSampling,
    batch_sampling,
    draw_uniforms,
    inverse_cdf_choice,
    parse_sampling_params,
    sample_next_tokens,
    scaled_log_softmax,
    truncated_probs,
)

VOCAB = 50


def test_parse_defaults_match_sglang() -> None:
    params = parse_sampling_params({}, vocab_size=VOCAB)
    assert params == RequestSampling()
    assert params.max_new_tokens == 128 and params.top_k == -1 and params.top_p == 1.0
    assert parse_sampling_params(None, vocab_size=VOCAB) == RequestSampling()


def test_parse_reads_every_supported_key() -> None:
    raw = {
        "max_new_tokens": 7,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 3,
        "min_p": 0.1,
        "stop_token_ids": [4, 9],
        "ignore_eos": True,
        "skip_special_tokens": False,
        "no_stop_trim": True,
        "sampling_seed": 42,
        "stop": [],  # no stop strings
        "stop_regex": [],  # neutral value of a known-but-unsupported key is accepted
        "repetition_penalty": 1.0,
    }
    params = parse_sampling_params(raw, vocab_size=VOCAB)
    assert params.max_new_tokens == 7 and params.temperature == 0.5 and params.top_p == 0.9
    assert params.top_k == 3 and params.min_p == 0.1 and params.stop_token_ids == (4, 9)
    assert params.ignore_eos and not params.skip_special_tokens and params.no_stop_trim
    assert params.sampling_seed == 42


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"temperature": -0.1}, "temperature"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"min_p": 1.5}, "min_p"),
        ({"max_new_tokens": "8"}, "max_new_tokens"),
        ({"temperature": True}, "temperature"),
        ({"bogus_key": 1}, "bogus_key"),
        ({"stop": "</s>"}, "skip_tokenizer_init"),  # no tokenizer (no encode): strings cannot match
        ({"stop": [1]}, "stop"),
        ({"stop_regex": "x+"}, "stop_regex"),
        ({"repetition_penalty": 1.2}, "repetition_penalty"),
        ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
        ({"stop_token_ids": 3}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"n": 0}, "n"),
    ],
)
def test_parse_rejects_bad_values_naming_the_key(raw: dict[str, object], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        parse_sampling_params(raw, vocab_size=VOCAB)


def test_stop_strings_become_a_list_and_a_window_in_tokens() -> None:
    def encode(text: str) -> list[int]:
        return [ord(c) for c in text.replace("ab", "X")]  # "ab" is one token

    params = parse_sampling_params({"stop": ["abab", "xyz"]}, vocab_size=VOCAB, encode=encode)
    assert params.stop == ("abab", "xyz") and params.stop_window == 3
    one = parse_sampling_params({"stop": "ab"}, vocab_size=VOCAB, encode=encode)
    assert one.stop == ("ab",) and one.stop_window == 1


def test_parse_rejects_non_object() -> None:
    with pytest.raises(ValueError, match="object"):
        parse_sampling_params([1, 2], vocab_size=VOCAB)


def test_greedy_threshold_and_logprob_temperature() -> None:
    assert RequestSampling(temperature=0.0).greedy
    assert RequestSampling(temperature=5e-7).greedy
    assert not RequestSampling(temperature=1e-5).greedy
    assert RequestSampling(temperature=0.0).logprob_temperature == 1.0
    assert RequestSampling(temperature=0.7).logprob_temperature == 0.7


def test_scaled_log_softmax_matches_definition() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.5, -1.0, 0.0]])
    temperature = torch.tensor([0.5, 2.0])
    got = scaled_log_softmax(logits, temperature)
    for row in range(2):
        z = [x / temperature[row].item() for x in logits[row].tolist()]
        log_norm = math.log(sum(math.exp(v) for v in z))
        for col in range(3):
            assert got[row, col].item() == pytest.approx(z[col] - log_norm, abs=1e-6)


def test_inverse_cdf_choice_picks_first_index_whose_cdf_exceeds_u() -> None:
    weights = torch.tensor([[0.2, 0.0, 0.3, 0.5]] * 5)
    uniforms = torch.tensor([0.0, 0.19, 0.21, 0.49, 0.999])
    assert inverse_cdf_choice(weights, uniforms).tolist() == [0, 0, 2, 2, 3]


def test_inverse_cdf_choice_normalises_and_never_picks_zero_weight() -> None:
    weights = torch.tensor([[0.0, 2.0, 0.0, 2.0, 0.0]] * 4)
    uniforms = torch.tensor([0.0, 0.49, 0.5, 0.9999999])
    assert inverse_cdf_choice(weights, uniforms).tolist() == [1, 1, 3, 3]


def test_truncation_top_k_top_p_min_p() -> None:
    probs = torch.tensor([0.05, 0.4, 0.3, 0.2, 0.05])
    log_probs = probs.log().unsqueeze(0).repeat(3, 1)
    top_k = torch.tensor([2, 5, 5])
    top_p = torch.tensor([1.0, 0.65, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.45])  # keep probs >= 0.45 * 0.4 = 0.18
    kept = truncated_probs(log_probs, top_k, top_p, min_p)
    kept_ids = [(kept[r] > 0).nonzero().flatten().tolist() for r in range(3)]
    # Kept entries keep their probability (no renormalisation here) in vocabulary order.
    assert kept[2].tolist() == pytest.approx([0.0, 0.4, 0.3, 0.2, 0.0], abs=1e-6)
    assert kept_ids[0] == [1, 2]  # two most likely
    assert kept_ids[1] == [1, 2]  # 0.4 + 0.3 >= 0.65: the smallest prefix reaching top_p
    assert kept_ids[2] == [1, 2, 3]


def test_sampling_frequencies_follow_the_distribution() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]])
    probs = torch.softmax(logits[0], dim=-1)
    settings = batch_sampling([RequestSampling(temperature=1.0)], vocab_size=4)
    draws = 2000
    counts = [0] * 4
    for i in range(draws):  # evenly spaced uniforms: counts must equal N * p up to one
        token, _ = sample_next_tokens(logits, settings, torch.tensor([(i + 0.5) / draws]))
        counts[int(token)] += 1
    for token_id in range(4):
        assert abs(counts[token_id] - draws * probs[token_id].item()) <= 1.0


def test_logprob_is_before_truncation_and_temperature_scaled() -> None:
    logits = torch.tensor([[0.1, 2.0, 1.5, -0.3]])
    settings = batch_sampling([RequestSampling(temperature=0.5, top_k=1)], vocab_size=4)
    token, logprob = sample_next_tokens(logits, settings, torch.tensor([0.7]))
    assert int(token) == 1  # top_k=1 leaves only the argmax
    expected = torch.log_softmax(logits / 0.5, dim=-1)[0, 1].item()
    assert logprob.item() == pytest.approx(expected, abs=1e-6)
    assert logprob.item() < -1e-3  # not renormalised over the truncated support (which would give 0)


def test_greedy_rows_take_argmax_and_report_untempered_logprob() -> None:
    logits = torch.tensor([[0.3, 0.2, 0.9], [0.0, 5.0, 1.0]])
    settings = batch_sampling(
        [RequestSampling(temperature=0.0), RequestSampling(temperature=0.0, top_p=0.5)], vocab_size=3
    )
    tokens, logprobs = sample_next_tokens(logits, settings, torch.tensor([0.99, 0.0]))
    assert tokens.tolist() == [2, 1]
    expected = torch.log_softmax(logits, dim=-1)
    assert logprobs.tolist() == pytest.approx([expected[0, 2].item(), expected[1, 1].item()], abs=1e-6)


def test_mixed_batch_rows_are_independent() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 20)
    params = [
        RequestSampling(temperature=0.8),
        RequestSampling(temperature=1.3, top_p=0.7),
        RequestSampling(),
    ]
    uniforms = torch.tensor([0.31, 0.62, 0.05])
    tokens, logprobs = sample_next_tokens(logits, batch_sampling(params, 20), uniforms)
    for row in range(3):
        alone_t, alone_lp = sample_next_tokens(
            logits[row : row + 1], batch_sampling([params[row]], 20), uniforms[row : row + 1]
        )
        assert int(alone_t) == int(tokens[row])
        assert alone_lp.item() == pytest.approx(logprobs[row].item(), abs=1e-6)


def test_draw_uniforms_depend_only_on_each_generator() -> None:
    def gen(seed: int) -> torch.Generator:
        return torch.Generator().manual_seed(seed)

    alone = draw_uniforms([gen(7)])
    together = draw_uniforms([gen(3), gen(7), gen(11)])
    assert together[1].item() == alone[0].item()
    assert together[0].item() != together[1].item()
    assert all(0.0 <= u < 1.0 for u in together.tolist())
