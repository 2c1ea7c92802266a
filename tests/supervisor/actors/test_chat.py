"""ChatBuffer: token-in/token-out extension with the real tiny ChatML tokenizer, and segment restarts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from pipeline.contracts.schema import EpisodeSegment, validate_segment
from pipeline.supervisor.actors.chat import ChatBuffer, SegmentBuffer

# Qwen3-style: reasoning inside <think></think> of earlier assistant turns is dropped when rendering.
STRIP_THINK_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{%- set content = message.content %}"
    "{%- if '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

USER = [{"role": "user", "content": "Guess my number from 1 to 16."}]


@pytest.fixture(scope="module")
def tokenizer_dir(tiny_tokenizer_dir: Path) -> Path:
    return tiny_tokenizer_dir


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="module")
def strip_tokenizer(tokenizer_dir: Path) -> Any:
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.chat_template = STRIP_THINK_TEMPLATE
    return tok


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def render(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
    assert isinstance(text, str)
    return text


def generate(chat: ChatBuffer, ids: list[int], turn: int, version: int = 0) -> None:
    logprobs = [-0.25 - 0.01 * i for i in range(len(ids))]
    chat.add_generated(ids, logprobs, [version] * len(ids), turn)


def as_row(seg: SegmentBuffer, num_turns: int, segment: int) -> EpisodeSegment:
    return EpisodeSegment(
        episode_id="e",
        group_id="g",
        task_id="t",
        env="test",
        token_ids=seg.token_ids,
        prompt_len=seg.prompt_len,
        loss_mask=seg.loss_mask,
        logprobs=seg.logprobs,
        turn_index=seg.turn_index,
        versions=seg.versions,
        turn_rewards=[0.0] * num_turns,
        outcome=None,
        num_turns=num_turns,
        finish_reason="stop",
        segment=segment,
    )


def test_first_prompt_is_the_rendered_template_encoded_once(tokenizer: Any) -> None:
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    chat = ChatBuffer(tokenizer, USER, stop_token_ids=[tokenizer.eos_token_id])
    text = "<|im_start|>user\nGuess my number from 1 to 16.<|im_end|>\n<|im_start|>assistant\n"
    assert chat.input_ids == encode(tokenizer, text)
    assert chat.input_ids[0] == im_start and chat.input_ids.count(im_start) == 2  # no extra BOS/specials
    seg = chat.current
    assert seg.prompt_len == len(seg.token_ids)
    assert seg.loss_mask == [0] * seg.prompt_len and seg.turn_index == [-1] * seg.prompt_len


def test_tools_are_rendered_into_the_first_prompt(tokenizer: Any) -> None:
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    chat = ChatBuffer(tokenizer, USER, tools=[tool], stop_token_ids=[tokenizer.eos_token_id])
    assert chat.input_ids == encode(tokenizer, render(tokenizer, USER, tools=[tool]))
    assert '"name": "add"' in tokenizer.decode(chat.input_ids)


def test_three_turns_append_exactly_the_template_suffix(tokenizer: Any) -> None:
    eos = tokenizer.eos_token_id
    chat = ChatBuffer(tokenizer, USER, stop_token_ids=[eos])
    prompt = list(chat.input_ids)
    expected, mask, turns = list(prompt), [0] * len(prompt), [-1] * len(prompt)
    conversation = list(USER)
    for turn, (guess, reply) in enumerate([("8", "higher"), ("12", "lower"), ("10", "correct")]):
        out = [*encode(tokenizer, guess), eos]
        generate(chat, out, turn, version=turn)
        assert chat.finish_turn() == guess
        expected += out
        mask += [1] * len(out)
        turns += [turn] * len(out)
        conversation += [{"role": "assistant", "content": guess}]
        if turn == 2:
            break  # the reply that ends the episode is never appended
        env_ids = encode(tokenizer, f"\n<|im_start|>user\n{reply}<|im_end|>\n<|im_start|>assistant\n")
        user = {"role": "user", "content": reply}
        assert chat.add_env_messages([user], turn, max_tokens=1000) == "appended"
        expected += env_ids
        mask += [0] * len(env_ids)
        turns += [turn] * len(env_ids)
        conversation.append(user)
        # Extension equals a from-scratch encoding of the whole conversation (canonical model output).
        assert chat.input_ids == expected == encode(tokenizer, render(tokenizer, conversation))
    assert len(chat.segments) == 1
    seg = chat.current
    assert seg.token_ids == expected
    assert seg.loss_mask == mask
    assert seg.turn_index == turns
    assert [v for v, m in zip(seg.versions, mask, strict=True) if m] == [0, 0, 1, 1, 2, 2]
    assert all(v == -1 for v, m in zip(seg.versions, mask, strict=True) if not m)
    assert [lp for lp, m in zip(seg.logprobs, mask, strict=True) if m] == [-0.25, -0.26] * 3
    assert validate_segment(as_row(seg, num_turns=3, segment=0)) is None


def test_generated_ids_are_kept_verbatim_even_when_not_canonical(tokenizer: Any) -> None:
    eos = tokenizer.eos_token_id
    chat = ChatBuffer(tokenizer, USER, stop_token_ids=[eos])
    one, two = encode(tokenizer, "1"), encode(tokenizer, "2")
    assert encode(tokenizer, "12") != one + two  # "12" is one token; the model wrote two
    out = [*one, *two, eos]
    generate(chat, out, 0)
    assert chat.finish_turn() == "12"
    start = len(chat.input_ids)
    assert chat.add_env_messages([{"role": "user", "content": "lower"}], 0, max_tokens=1000) == "appended"
    assert chat.input_ids[start - len(out) : start] == out
    assert chat.input_ids[start:] == encode(
        tokenizer, "\n<|im_start|>user\nlower<|im_end|>\n<|im_start|>assistant\n"
    )


def test_turn_cut_by_length_is_closed_with_non_model_end_of_turn(tokenizer: Any) -> None:
    eos = tokenizer.eos_token_id
    chat = ChatBuffer(tokenizer, USER, stop_token_ids=[eos])
    out = encode(tokenizer, "I think 8")  # no stop token: max_new_tokens cut the turn
    generate(chat, out, 0)
    assert chat.finish_turn() == "I think 8"
    start = len(chat.input_ids)
    assert chat.add_env_messages([{"role": "user", "content": "higher"}], 0, max_tokens=1000) == "appended"
    seg = chat.current
    glue = encode(tokenizer, "<|im_end|>\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n")
    assert seg.token_ids[start:] == glue
    assert seg.token_ids[start] == eos
    assert seg.loss_mask[start:] == [0] * len(glue)
    assert seg.versions[start:] == [-1] * len(glue) and seg.logprobs[start:] == [0.0] * len(glue)
    assert seg.turn_index[start:] == [0] * len(glue)


def test_overflow_leaves_the_buffer_unchanged(tokenizer: Any) -> None:
    eos = tokenizer.eos_token_id
    chat = ChatBuffer(tokenizer, USER, stop_token_ids=[eos])
    generate(chat, [*encode(tokenizer, "8"), eos], 0)
    chat.finish_turn()
    before = list(chat.input_ids)
    suffix = encode(tokenizer, "\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n")
    limit = len(before) + len(suffix)  # appending would leave no room for one generated token
    assert chat.add_env_messages([{"role": "user", "content": "higher"}], 0, max_tokens=limit) == "overflow"
    assert chat.input_ids == before
    assert (
        chat.add_env_messages([{"role": "user", "content": "higher"}], 0, max_tokens=limit + 1) == "appended"
    )


def test_template_that_strips_think_blocks_starts_a_new_segment(strip_tokenizer: Any) -> None:
    tok = strip_tokenizer
    eos = tok.eos_token_id
    chat = ChatBuffer(tok, USER, stop_token_ids=[eos])
    first = [*encode(tok, "<think>\nmid is 8\n</think>\n8"), eos]
    generate(chat, first, 0)
    assert chat.finish_turn() == "<think>\nmid is 8\n</think>\n8"
    segment0 = list(chat.input_ids)
    assert chat.add_env_messages([{"role": "user", "content": "higher"}], 0, max_tokens=1000) == "new_segment"
    assert len(chat.segments) == 2
    assert chat.segments[0].token_ids == segment0  # the old row is kept as it was
    restarted = [*USER, {"role": "assistant", "content": "8"}, {"role": "user", "content": "higher"}]
    # The stripped rendering (think block gone) is the new segment's prompt.
    new_prompt = encode(tok, render(tok, restarted))
    assert chat.input_ids == new_prompt and chat.current.prompt_len == len(new_prompt)
    generate(chat, [*encode(tok, "12"), eos], 1, version=1)
    chat.finish_turn()
    rows = [as_row(seg, num_turns=2, segment=i) for i, seg in enumerate(chat.segments)]
    assert [validate_segment(r) for r in rows] == [None, None]
    assert rows[1].turn_index[rows[1].prompt_len :] == [1, 1]


def test_strip_template_without_think_blocks_still_extends(strip_tokenizer: Any) -> None:
    tok = strip_tokenizer
    eos = tok.eos_token_id
    chat = ChatBuffer(tok, USER, stop_token_ids=[eos])
    generate(chat, [*encode(tok, "8"), eos], 0)
    chat.finish_turn()
    assert chat.add_env_messages([{"role": "user", "content": "higher"}], 0, max_tokens=1000) == "appended"
    assert len(chat.segments) == 1


def test_env_messages_before_finish_turn_is_an_error(tokenizer: Any) -> None:
    chat = ChatBuffer(tokenizer, USER, stop_token_ids=[tokenizer.eos_token_id])
    with pytest.raises(RuntimeError, match="before finish_turn"):
        chat.add_env_messages([{"role": "user", "content": "x"}], 0, max_tokens=100)


def test_generated_columns_must_have_equal_lengths() -> None:
    seg = SegmentBuffer.from_prompt([1, 2])
    with pytest.raises(ValueError, match=r"generated ids \(2\), logprobs \(1\) and versions \(2\)"):
        seg.append_generated([3, 4], [-0.1], [0, 0], 0)


class CountingRenders:
    """Wraps a tokenizer's apply_chat_template to count the calls that reach the HF wrapper."""

    def __init__(self, tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        original = tokenizer.apply_chat_template

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(tokenizer, "apply_chat_template", counted)


def fresh_tokenizer(tokenizer_dir: Path, template: str | None = None) -> Any:
    """A tokenizer object no buffer has seen yet: nothing of it is shared from earlier tests."""
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    if template is not None:
        tok.chat_template = template
    return tok


class PlainTokenizer:
    """Not a Hugging Face tokenizer: one character per id, a fixed ChatML-like template; it records
    every text it renders or encodes."""

    def __init__(self, chat_template: str | None = None) -> None:
        self.chat_template = chat_template
        self.renders = 0
        self.encoded: list[str] = []

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> str:
        self.renders += 1
        return "".join(f"<{m['role']}>{m['content']}|" for m in conversation) + "<assistant>"

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        self.encoded.append(text)
        return [ord(c) for c in text]

    def decode(self, token_ids: Any, **kwargs: Any) -> str:
        return "".join(chr(i) for i in token_ids)


def plain_episode(tok: PlainTokenizer, reply: str) -> ChatBuffer:
    """A new buffer for USER, one turn ("8") and the env's reply."""
    chat = ChatBuffer(tok, USER, stop_token_ids=[ord("|")])
    generate(chat, [ord("8"), ord("|")], 0)
    assert chat.finish_turn() == "8"
    assert chat.add_env_messages([{"role": "user", "content": reply}], 0, max_tokens=10**6) == "appended"
    return chat


@pytest.mark.parametrize("template", [None, STRIP_THINK_TEMPLATE], ids=["chatml", "strip-think"])
def test_turns_render_the_compiled_template_directly_with_the_wrappers_text(
    template: str | None, tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tok = fresh_tokenizer(tokenizer_dir, template)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    conversation = [*USER, {"role": "assistant", "content": "8"}, {"role": "user", "content": "up"}]
    expected_ids = encode(tok, render(tok, conversation, tools=tools))
    counter = CountingRenders(tok, monkeypatch)
    chat = ChatBuffer(tok, USER, tools=tools, stop_token_ids=[tok.eos_token_id])
    generate(chat, [*encode(tok, "8"), tok.eos_token_id], 0)
    chat.finish_turn()
    assert chat.add_env_messages([conversation[-1]], 0, max_tokens=1000) == "appended"
    assert counter.calls == 1  # only the first prompt, which the direct render is checked against
    assert chat.input_ids == expected_ids


def test_messages_the_wrapper_normalises_are_rendered_by_the_wrapper(
    tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokenizer = fresh_tokenizer(tokenizer_dir)
    counter = CountingRenders(tokenizer, monkeypatch)
    chat = ChatBuffer(tokenizer, USER, stop_token_ids=[tokenizer.eos_token_id])
    generate(chat, [*encode(tokenizer, "8"), tokenizer.eos_token_id], 0)
    chat.finish_turn()
    # The wrapper drops None-valued keys; the direct render would pass "None" to the template.
    reply = {"role": "user", "content": "up", "name": None}
    assert chat.add_env_messages([reply], 0, max_tokens=1000) == "appended"
    assert counter.calls == 2
    conversation = [*USER, {"role": "assistant", "content": "8"}, {"role": "user", "content": "up"}]
    assert chat.input_ids == encode(tokenizer, render(tokenizer, conversation))


def test_a_tokenizer_without_hf_template_api_renders_through_apply_chat_template() -> None:
    tok = PlainTokenizer()
    chat = plain_episode(tok, "up")
    assert tok.renders == 2
    assert tok.decode(chat.input_ids) == f"<user>{USER[0]['content']}|<assistant>8|<user>up|<assistant>"


# A template that looks message fields up in every way the sandbox resolves `message.name`: a present
# key, a missing key (undefined), a key starting with "_", a key shadowed by a dict method ("items"), a
# dict method, an unsafe attribute (undefined), a str method on a value; and one unsafe call on demand.
ATTRIBUTE_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content }}"
    "{%- if message.tool_calls %}[calls {{ message.tool_calls | length }}]{% endif %}"
    "{%- if message._meta is defined %}[meta {{ message._meta }}]{% endif %}"
    "[items {{ message.items is callable }}][get {{ message.get('role') }}]"
    "[class {{ message.__class__ }}][upper {{ message.role.upper() }}]"
    "{%- if message.content == 'pop' %}{{ message.pop('role') }}{% endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_direct_render_resolves_message_fields_exactly_like_the_wrapper(
    tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tok = fresh_tokenizer(tokenizer_dir, ATTRIBUTE_TEMPLATE)
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 1}}}
    first = [{"role": "user", "content": "hi", "_meta": 1, "items": "shadowed", "tool_calls": [call]}]
    replies = [{"role": "tool", "content": "3", "_meta": "m"}, {"role": "user", "content": "up", "items": 2}]
    conversation = [*first, {"role": "assistant", "content": "8"}, *replies]
    text = render(tok, conversation)
    assert text.startswith(
        "<|im_start|>user\nhi[calls 1][meta 1][items True][get user][class ][upper USER]<|im_end|>\n"
        "<|im_start|>assistant\n8[items True][get assistant][class ][upper ASSISTANT]<|im_end|>\n"
        "<|im_start|>tool\n3[meta m][items True][get tool][class ][upper TOOL]<|im_end|>\n"
    )
    counter = CountingRenders(tok, monkeypatch)
    chat = ChatBuffer(tok, first, stop_token_ids=[tok.eos_token_id])
    generate(chat, [*encode(tok, "8"), tok.eos_token_id], 0)
    chat.finish_turn()
    assert chat.add_env_messages(replies, 0, max_tokens=1000) == "new_segment"  # "[items...]" after "8"
    assert counter.calls == 1  # the later render was the direct one, and it matched the wrapper
    assert chat.input_ids == encode(tok, text)


def test_direct_render_keeps_the_sandbox(tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from jinja2.exceptions import SecurityError

    tok = fresh_tokenizer(tokenizer_dir, ATTRIBUTE_TEMPLATE)
    reply = {"role": "user", "content": "pop"}
    with pytest.raises(SecurityError):  # the wrapper refuses to mutate a message
        render(tok, [*USER, {"role": "assistant", "content": "8"}, reply])
    counter = CountingRenders(tok, monkeypatch)
    chat = ChatBuffer(tok, USER, stop_token_ids=[tok.eos_token_id])
    generate(chat, [*encode(tok, "8"), tok.eos_token_id], 0)
    chat.finish_turn()
    before = list(chat.input_ids)
    with pytest.raises(SecurityError):
        chat.add_env_messages([reply], 0, max_tokens=1000)
    assert counter.calls == 1  # refused by the direct render itself
    assert chat.input_ids == before and len(chat.segments) == 1


@pytest.mark.parametrize("with_tools", [True, False])
def test_direct_render_matches_the_wrapper_on_tool_calls_and_system_messages(
    with_tools: bool, tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tok = fresh_tokenizer(tokenizer_dir)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 1}}}
    first = [
        {"role": "system", "content": "be brief"},
        *USER,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "3"},
        {"role": "assistant", "content": "3"},
        {"role": "user", "content": "again"},
    ]
    reply = {"role": "tool", "content": "7"}
    tool_list = tools if with_tools else None
    conversation = [*first, {"role": "assistant", "content": "4"}, reply]
    expected = encode(tok, render(tok, conversation, tools=tool_list))
    counter = CountingRenders(tok, monkeypatch)
    chat = ChatBuffer(tok, first, tools=tools if with_tools else (), stop_token_ids=[tok.eos_token_id])
    generate(chat, [*encode(tok, "4"), tok.eos_token_id], 0)
    chat.finish_turn()
    assert chat.add_env_messages([reply], 0, max_tokens=1000) == "appended"
    assert counter.calls == 1
    assert chat.input_ids == expected


def test_buffers_with_the_same_first_messages_share_one_render(
    tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokenizer = fresh_tokenizer(tokenizer_dir)
    expected = encode(tokenizer, render(tokenizer, USER))
    counter = CountingRenders(tokenizer, monkeypatch)
    first = ChatBuffer(tokenizer, USER, stop_token_ids=[tokenizer.eos_token_id])
    second = ChatBuffer(tokenizer, USER, stop_token_ids=[tokenizer.eos_token_id])
    assert counter.calls == 1
    assert second.input_ids == first.input_ids == expected
    assert second.input_ids is not first.input_ids
    generate(first, [*encode(tokenizer, "8"), tokenizer.eos_token_id], 0)
    assert len(second.input_ids) == second.current.prompt_len  # no shared state between buffers
    # Other messages, tools or another template are other keys: each renders through the wrapper once.
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    ChatBuffer(tokenizer, [{"role": "user", "content": "Guess my number from 1 to 8."}])
    ChatBuffer(tokenizer, USER, tools=[tool])
    ChatBuffer(tokenizer, [{**USER[0], "n": 1}])  # 1 and 1.0 are different keys (the template may differ)
    ChatBuffer(tokenizer, [{**USER[0], "n": 1.0}])
    assert counter.calls == 5


def test_first_prompts_are_shared_only_for_plain_json_messages_and_a_template_string() -> None:
    with_template = PlainTokenizer(chat_template="fixed")
    for _ in range(2):
        ChatBuffer(with_template, USER)
    assert with_template.renders == 1
    # A tuple is not JSON: no exact key for it, so every buffer renders its own first prompt.
    odd = [{**USER[0], "meta": ("a",)}]
    for _ in range(2):
        assert ChatBuffer(with_template, odd).input_ids == ChatBuffer(PlainTokenizer(), odd).input_ids
    assert with_template.renders == 3
    # Without a template string there is nothing to key the prompt by either.
    without = PlainTokenizer(chat_template=None)
    for _ in range(2):
        ChatBuffer(without, USER)
    assert without.renders == 2


def test_repeated_env_replies_are_encoded_once_and_exactly() -> None:
    tok = PlainTokenizer(chat_template="fixed")
    prompt = f"<user>{USER[0]['content']}|<assistant>"
    suffix = "<user>higher|<assistant>"
    chats = [plain_episode(tok, "higher") for _ in range(3)]
    assert tok.encoded == [prompt, suffix]  # the first episode encoded both; the others reused them
    expected = [ord(c) for c in prompt + "8|" + suffix]
    assert [chat.input_ids for chat in chats] == [expected] * 3


def test_long_texts_are_not_memoised_and_the_oldest_text_is_forgotten_first() -> None:
    tok = PlainTokenizer(chat_template="fixed")
    long_reply = "a" * 5000
    for _ in range(2):
        chat = plain_episode(tok, long_reply)
    assert tok.encoded[1:] == [f"<user>{long_reply}|<assistant>"] * 2  # encoded each time
    assert tok.decode(chat.input_ids).endswith(f"8|<user>{long_reply}|<assistant>")
    # Short texts are remembered up to a bound (4096), the oldest forgotten first.
    tok = PlainTokenizer(chat_template="fixed")
    for i in range(4097):
        plain_episode(tok, f"r{i}")
    assert len(tok.encoded) == 1 + 4097  # the prompt once, every new reply once
    plain_episode(tok, "r1")  # still remembered
    plain_episode(tok, "r4096")
    assert len(tok.encoded) == 1 + 4097
    plain_episode(tok, "r0")  # the oldest, forgotten
    assert tok.encoded[-1] == "<user>r0|<assistant>" and len(tok.encoded) == 1 + 4098


def test_an_unhashable_tokenizer_works_without_a_memo() -> None:
    class Unhashable:
        __hash__ = None  # type: ignore[assignment]

        def apply_chat_template(self, conversation: Any, **kwargs: Any) -> str:
            return "".join(f"<{m['role']}>{m['content']}|" for m in conversation) + "<assistant>"

        def encode(self, text: str, **kwargs: Any) -> list[int]:
            return [ord(c) for c in text]

        def decode(self, token_ids: Any, **kwargs: Any) -> str:
            return "".join(chr(i) for i in token_ids)

    tok = Unhashable()
    chat = ChatBuffer(tok, USER, stop_token_ids=[ord("|")])
    generate(chat, [ord("8"), ord("|")], 0)
    chat.finish_turn()
    assert chat.add_env_messages([{"role": "user", "content": "up"}], 0, max_tokens=1000) == "appended"
    assert tok.decode(chat.input_ids) == f"<user>{USER[0]['content']}|<assistant>8|<user>up|<assistant>"
