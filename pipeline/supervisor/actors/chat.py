"""The token buffer of one multi-turn conversation: token-in/token-out across chat turns.

The engine sees only token ids. The first prompt is the tokenizer's chat template rendered as text
(`add_generation_prompt=True`) and encoded once without adding special tokens again. After that the
buffer only grows:

- the engine's `output_ids` are appended VERBATIM (loss mask 1, with their log-probs and versions);
  they are decoded for the environment and the template, never re-encoded;
- after the environment answers, the whole conversation is rendered again (the assistant message's
  content = decode of the turn's generated ids minus a trailing stop token) with the new messages and
  the generation prompt. When the text rendered before, followed by the decoded generated ids, is an
  exact prefix of the new rendering, only the rest is encoded and appended (loss mask 0);
- when it is not (a template that rewrites history, e.g. drops earlier `<think>` blocks, or trims
  what the model wrote), the buffer cannot be extended without corrupting the sequence, so a new
  *segment* starts: its token ids are the full new rendering (all of it prompt, loss mask 0). The
  finished segment is kept as its own row.

Boundary: the engine stops on a stop token that it returns (`no_stop_trim`), e.g. `<|im_end|>`, and
ChatML renders `content + "<|im_end|>\\n"`; the decoded stop token then matches the template's own
end-of-turn text and only `"\\n<|im_start|>user..."` is appended. A turn cut by `max_new_tokens` has no
stop token: whatever the template writes after the content (`<|im_end|>\\n...`) is appended as
context, so the turn is closed the way the template expects, with those ids marked as NOT generated.

A stop token that the template does not write after assistant content (e.g. `<|endoftext|>` when the
template closes turns with `<|im_end|>`) breaks the prefix check too and so starts a new segment:
correct, but configure `stop_token_ids` to the template's end-of-turn token to avoid it.

The environment's final reply (the one that ends the episode) is never appended: the engine never
saw it, and the row holds exactly what the engine saw and produced.

Rendering: one full template render per turn (linear in the conversation), which makes the
history-rewrite check exact for any template. For a Hugging Face tokenizer the render calls the compiled
Jinja template directly (`_FastRenderer`), in a sandbox whose `message.key` lookup on a plain dict skips
the exception the stock sandbox raises and catches (`dict_fast_getattr`, same result). The template is
compiled by transformers' private `_compile_jinja_template`, so filters, globals and extensions are
those of `apply_chat_template`; the fast render is checked against `apply_chat_template` on each
buffer's first prompt and used only for messages of plain JSON values: if the private function moves or
renders differently, the public wrapper renders. Results that are pure functions of the tokenizer and
exact inputs are shared by its buffers (`_TokenizerMemo`): first prompts and short appended texts.
"""

from __future__ import annotations

import copy
import json
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Literal, Protocol

Message = dict[str, Any]
ExtendOutcome = Literal["appended", "new_segment", "overflow"]


class ChatTokenizer(Protocol):
    """The part of a Hugging Face tokenizer the buffer uses."""

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def encode(self, text: str, **kwargs: Any) -> list[int]: ...

    def decode(self, token_ids: Any, **kwargs: Any) -> str: ...


@dataclass
class SegmentBuffer:
    """Per-token columns of one segment (see pipeline.contracts.schema.EpisodeSegment); all lists have
    equal length.

    `prompt_len` tokens open the segment (turn_index -1); every later token belongs to a turn.
    """

    token_ids: list[int]
    prompt_len: int
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turn_index: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    # MoE routing record (RolloutSettings.routed_experts): the engine's experts of positions
    # [0, routed_positions), encoded as pipeline.contracts.schema.RoutedExperts.ids.
    routed: bytearray = field(default_factory=bytearray)
    routed_positions: int = 0

    @classmethod
    def from_prompt(cls, prompt_ids: list[int]) -> SegmentBuffer:
        n = len(prompt_ids)
        return cls(list(prompt_ids), n, [0] * n, [0.0] * n, [-1] * n, [-1] * n)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return sum(self.loss_mask)

    def append_generated(
        self, ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int], turn: int
    ) -> None:
        """Model tokens: loss mask 1, the engine's log-probs and policy versions."""
        if not len(ids) == len(logprobs) == len(versions):
            raise ValueError(
                f"generated ids ({len(ids)}), logprobs ({len(logprobs)}) and versions ({len(versions)}) "
                "must have the same length"
            )
        n = len(ids)
        self.token_ids.extend(ids)
        self.loss_mask.extend([1] * n)
        self.logprobs.extend(logprobs)
        self.turn_index.extend([turn] * n)
        self.versions.extend(versions)

    def append_routed(self, start: int, positions: int, ids: bytes) -> None:
        """The engine's routing of positions [start, start + positions); `start` must be where the record
        ends (each request asks from there), so the record stays contiguous from position 0."""
        if start != self.routed_positions:
            raise ValueError(f"routing record ends at position {self.routed_positions}, not {start}")
        if start + positions > len(self.token_ids):
            raise ValueError(f"routing of positions up to {start + positions} in a {len(self)}-token segment")
        self.routed.extend(ids)
        self.routed_positions += positions

    def append_context(self, ids: Sequence[int], turn: int) -> None:
        """Tokens the model did not generate (environment replies, template glue): loss mask 0."""
        n = len(ids)
        self.token_ids.extend(ids)
        self.loss_mask.extend([0] * n)
        self.logprobs.extend([0.0] * n)
        self.turn_index.extend([turn] * n)
        self.versions.extend([-1] * n)


def _verified_backend(tokenizer: ChatTokenizer, text: str, ids: list[int]) -> Any | None:
    """The fast tokenizer's `tokenizers.Tokenizer` when it encodes and decodes `text` exactly as the HF
    wrapper does (it skips the wrapper's per-call overhead, ~4x on short texts), else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        same_ids = list(backend.encode(text, add_special_tokens=False).ids) == ids
        wrapper_text = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        same_text = backend.decode(ids, skip_special_tokens=False) == wrapper_text
    except Exception:  # an unexpected backend API: the wrapper is always correct
        return None
    return backend if same_ids and same_text else None


_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def _is_plain(value: Any) -> bool:
    """True for values made only of exact JSON types (what the HF wrapper would pass through unchanged)."""
    kind = type(value)
    if value is None or kind in (str, int, float, bool):
        return True
    if kind is dict:
        return all(type(k) is str and _is_plain(v) for k, v in value.items())
    if kind is list:
        return all(_is_plain(v) for v in value)
    return False


def _renderable_fast(message: Message) -> bool:
    """A message the direct render treats exactly as `apply_chat_template` does: a plain dict with no
    None values (the wrapper drops them) and no reasoning fields (the wrapper aliases them)."""
    return (
        type(message) is dict
        and all(v is not None for v in message.values())
        and not any(key in message for key in _REASONING_KEYS)
        and _is_plain(message)
    )


# Every name `getattr(d, name)` resolves on a plain dict instance (methods and object's dunders).
_DICT_ATTRIBUTES = frozenset(dir(dict))


def dict_fast_getattr(base: type[Any]) -> type[Any]:
    """A subclass of the sandboxed Jinja environment class `base` whose `getattr` (what `message.role`
    compiles to) reads a plain dict's key at once.

    The sandbox first tries `getattr(obj, name)`; on a dict that raises AttributeError unless `name` is
    a dict attribute, and only then reads `obj[name]` (undefined when missing). Raising and catching
    those exceptions is most of a chat-template render. For `type(obj) is dict` and a name that is not
    a dict attribute the result is the same without the exception; everything else goes to `base`.
    """

    class DictFastSandbox(base):
        def getattr(self, obj: Any, attribute: str) -> Any:
            if type(obj) is dict and type(attribute) is str and attribute not in _DICT_ATTRIBUTES:
                try:
                    return obj[attribute]
                except KeyError:
                    return self.undefined(obj=obj, name=attribute)
            return super().getattr(obj, attribute)

    DictFastSandbox.__name__ = DictFastSandbox.__qualname__ = f"DictFast{base.__name__}"
    return DictFastSandbox


@lru_cache(maxsize=32)
def _compile_dict_fast(source: str) -> Any:
    """transformers' compiled template of `source`, recompiled in an overlay of its (sandboxed)
    environment whose class has the dict fast path: same filters, globals, extensions and options."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    environment = _compile_jinja_template(source).environment.overlay()
    environment.__class__ = dict_fast_getattr(type(environment))
    return environment.from_string(source)


class _FastRenderer:
    """Renders `apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)`
    by calling the chat template compiled the way transformers compiles it (plus the dict fast path of
    `dict_fast_getattr`), with the same variables."""

    def __init__(self, template: Any, tools: list[dict[str, Any]] | None, variables: dict[str, Any]) -> None:
        from jinja2.runtime import new_context

        self._template = template
        self._new_context = new_context
        # Template.render merges the template's globals (a ChainMap) into a new dict on every call and
        # the context copies their names again; a plain snapshot merged once with the fixed variables
        # gives the context the same names and values (variables win, as in render) for a dict copy.
        self._globals = dict(template.globals)
        self._parent = {
            **self._globals,
            "tools": tools,
            "documents": None,
            "add_generation_prompt": True,
            **variables,
        }

    def render(self, messages: list[Message]) -> str:
        template = self._template
        parent = self._parent.copy()
        parent["messages"] = messages
        context = self._new_context(
            template.environment, template.name, template.blocks, parent, True, self._globals
        )
        return str(template.environment.concat(template.root_render_func(context)))

    @classmethod
    def build(
        cls, tokenizer: ChatTokenizer, tools: list[dict[str, Any]] | None, messages: list[Message], text: str
    ) -> _FastRenderer | None:
        """A renderer that reproduces `text` (the wrapper's render of `messages`), or None when the tokenizer
        is not a Hugging Face one, the private API moved, or the renders differ."""
        get_template = getattr(tokenizer, "get_chat_template", None)
        special_tokens = getattr(tokenizer, "special_tokens_map", None)
        if get_template is None or not isinstance(special_tokens, dict):
            return None
        if not (_is_plain(tools) and all(_renderable_fast(m) for m in messages)):
            return None
        try:
            renderer = cls(_compile_dict_fast(get_template(None, tools)), tools, dict(special_tokens))
            same = renderer.render(messages) == text
        except Exception:  # a moved private API or an unexpected template: the wrapper is always right
            return None
        return renderer if same else None


@dataclass(frozen=True)
class _FirstPrompt:
    """What a ChatBuffer derives from its first messages: the text, its ids and the verified fast paths."""

    text: str
    ids: tuple[int, ...]
    backend: Any | None
    fast: _FastRenderer | None


class _TokenizerMemo:
    """Results that are pure functions of one tokenizer and their exact inputs, shared by its buffers.

    - first prompts by (chat template, tools, messages) as JSON: the G episodes of a group, and every
      task with a fixed opening, start from the same messages;
    - encodings of short texts (at most MAX_TEXT_CHARS), separately for the backend and the wrapper:
      the text appended after a turn is template glue around the environment's reply, and replies
      repeat ("higher", "lower", "invalid"). Both are bounded, oldest entry evicted first.
    A tokenizer must not be changed (template, added tokens) while buffers use it.
    """

    MAX_PROMPTS = 256
    MAX_TEXTS = 4096
    MAX_TEXT_CHARS = 1024

    def __init__(self) -> None:
        self.prompts: dict[tuple[str, str, str], _FirstPrompt] = {}
        self.encodings: tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]] = ({}, {})

    def prompt_key(
        self, tokenizer: ChatTokenizer, tools: list[dict[str, Any]] | None, messages: list[Message]
    ) -> tuple[str, str, str] | None:
        """The memo key, or None when the inputs are not plain JSON (no exact, cheap key) or the
        tokenizer has no single template string."""
        template = getattr(tokenizer, "chat_template", None)
        if not isinstance(template, str) or not (_is_plain(tools) and _is_plain(messages)):
            return None
        # json.dumps is injective on plain values (1, 1.0 and true differ; key order is kept).
        return template, json.dumps(tools), json.dumps(messages)

    @staticmethod
    def remember(memo: dict[Any, Any], key: Any, value: Any, limit: int) -> None:
        if len(memo) >= limit:
            del memo[next(iter(memo))]
        memo[key] = value


_MEMOS: weakref.WeakKeyDictionary[Any, _TokenizerMemo] = weakref.WeakKeyDictionary()


def _memo_for(tokenizer: ChatTokenizer) -> _TokenizerMemo | None:
    try:
        memo = _MEMOS.get(tokenizer)
        if memo is None:
            memo = _MEMOS[tokenizer] = _TokenizerMemo()
    except TypeError:  # not hashable or not weak-referenceable: no sharing
        return None
    return memo


class ChatBuffer:
    """Token buffer of one conversation; `input_ids` is what the next /generate call sends.

    Call order per turn: `add_generated` (one or more times: a resubmitted aborted request adds its
    continuation), `finish_turn` (returns the assistant text), then either `add_env_messages` to
    continue or nothing when the episode ends.
    """

    def __init__(
        self,
        tokenizer: ChatTokenizer,
        messages: Iterable[Message],
        *,
        tools: Sequence[dict[str, Any]] = (),
        stop_token_ids: Iterable[int] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.tools = list(tools) or None
        self.stop_token_ids = frozenset(stop_token_ids)
        self.messages: list[Message] = list(messages)
        self._memo = _memo_for(tokenizer)
        key = self._memo.prompt_key(tokenizer, self.tools, self.messages) if self._memo is not None else None
        first = self._memo.prompts.get(key) if self._memo is not None and key is not None else None
        if first is None:
            first = self._first_prompt()
            if self._memo is not None and key is not None:
                self._memo.remember(self._memo.prompts, key, first, _TokenizerMemo.MAX_PROMPTS)
        self._text = first.text
        self._backend = first.backend
        self._fast = first.fast
        self._encodings = self._memo.encodings[self._backend is not None] if self._memo is not None else None
        self.segments: list[SegmentBuffer] = [SegmentBuffer.from_prompt(list(first.ids))]
        self._turn_ids: list[int] = []
        self._turn_text: str | None = None

    @property
    def current(self) -> SegmentBuffer:
        return self.segments[-1]

    def branch(self) -> ChatBuffer:
        """An independent copy between turns (a tree rollout's branch): the same messages and per-token
        columns, each list its own, so that the copy and this buffer continue apart. The renderers and
        encoders are shared: they are replaced, never changed in place."""
        twin = copy.copy(self)
        twin.messages = copy.deepcopy(self.messages)
        twin.segments = [copy.deepcopy(segment) for segment in self.segments]
        twin._turn_ids = list(self._turn_ids)
        return twin

    @property
    def input_ids(self) -> list[int]:
        """The current segment's ids (the live list: do not mutate)."""
        return self.current.token_ids

    def _render(self, messages: list[Message]) -> str:
        if self._fast is not None:
            return self._fast.render(messages)
        text = self.tokenizer.apply_chat_template(
            messages, tools=self.tools, add_generation_prompt=True, tokenize=False
        )
        if not isinstance(text, str):
            raise TypeError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}, not str")
        return text

    def _first_prompt(self) -> _FirstPrompt:
        """Render and encode the first messages through the wrapper; verify the fast paths against it."""
        self._fast = None
        text = self._render(self.messages)
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        backend = _verified_backend(self.tokenizer, text, ids)
        fast = _FastRenderer.build(self.tokenizer, self.tools, self.messages, text)
        return _FirstPrompt(text, tuple(ids), backend, fast)

    def _encode(self, text: str) -> list[int]:
        memo = self._encodings
        if memo is None or len(text) > _TokenizerMemo.MAX_TEXT_CHARS:
            return self._encode_uncached(text)
        ids = memo.get(text)
        if ids is None:
            ids = tuple(self._encode_uncached(text))
            _TokenizerMemo.remember(memo, text, ids, _TokenizerMemo.MAX_TEXTS)
        return list(ids)

    def _encode_uncached(self, text: str) -> list[int]:
        # The template already wrote every special token; adding BOS/EOS again would corrupt the prompt.
        if self._backend is not None:
            return list(self._backend.encode(text, add_special_tokens=False).ids)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _decode(self, ids: Sequence[int]) -> str:
        if self._backend is not None:
            return str(self._backend.decode(list(ids), skip_special_tokens=False))
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def add_generated(
        self, ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int], turn: int
    ) -> None:
        """Append engine output ids verbatim to the current segment (part of the turn in progress)."""
        self.current.append_generated(ids, logprobs, versions, turn)
        self._turn_ids.extend(ids)

    def finish_turn(self) -> str:
        """Close the turn in progress; return the assistant text (decoded, trailing stop token removed).

        The assistant message joins the conversation with that text as its content (tool-call markup
        included, no parsed `tool_calls`: the template must reproduce what the model wrote).
        """
        ids = self._turn_ids
        self._turn_text = self._decode(ids)
        ends_with_stop = bool(ids) and ids[-1] in self.stop_token_ids
        content = self._decode(ids[:-1]) if ends_with_stop else self._turn_text
        self.messages.append({"role": "assistant", "content": content})
        self._turn_ids = []
        return content

    def add_env_messages(self, new_messages: Sequence[Message], turn: int, max_tokens: int) -> ExtendOutcome:
        """Append the environment's reply (and the next generation prompt) to the buffer.

        Returns "appended" when the current segment was extended, "new_segment" when the template could
        not extend it and a new segment started, "overflow" when the result would leave no room to
        generate (`len >= max_tokens`); on overflow nothing changes. The tokens get `turn_index = turn`.
        """
        if self._turn_text is None:
            raise RuntimeError("add_env_messages called before finish_turn")
        return self._extend([*self.messages, *new_messages], new_messages, turn, max_tokens)

    def add_conversation(
        self,
        conversation: Sequence[Message],
        turn: int,
        max_tokens: int,
        *,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> ExtendOutcome:
        """Continue the buffer with `conversation`, the whole history the next prompt renders, as an
        OpenAI-style client sends it with every request (`add_env_messages` is the case where it is
        `self.messages` plus the reply). Same outcomes and same rule as `add_env_messages`: the segment
        is extended only when the rendering starts with exactly what the engine saw and produced so far;
        a history the client rewrote, or `tools` that differ from this buffer's, start a new segment.
        On "overflow", or when the template cannot render the conversation (it raises), nothing changes.
        """
        if self._turn_text is None:
            raise RuntimeError("add_conversation called before finish_turn")
        new_tools = (list(tools) or None) if tools is not None else self.tools
        if new_tools == self.tools:
            return self._extend(list(conversation), conversation, turn, max_tokens)
        previous = self.tools, self._fast
        self.tools, self._fast = new_tools, None  # the fast renderer has the tools baked in
        try:
            outcome = self._extend(list(conversation), conversation, turn, max_tokens)
        except BaseException:
            self.tools, self._fast = previous
            raise
        if outcome == "overflow":
            self.tools, self._fast = previous
        return outcome

    def _extend(
        self, conversation: list[Message], unchecked: Sequence[Message], turn: int, max_tokens: int
    ) -> ExtendOutcome:
        """Render `conversation` (its `unchecked` messages not yet vetted for the fast renderer) and append
        the new tokens, or start a new segment; see `add_env_messages`."""
        if self._fast is not None and not all(_renderable_fast(m) for m in unchecked):
            self._fast = None  # the wrapper normalises such messages; keep its exact behaviour
        rendered = self._render(conversation)
        assert self._turn_text is not None  # both public callers checked it
        expected_prefix = self._text + self._turn_text
        if rendered.startswith(expected_prefix):
            suffix_ids = self._encode(rendered[len(expected_prefix) :])
            if len(self.current) + len(suffix_ids) >= max_tokens:
                return "overflow"
            self.current.append_context(suffix_ids, turn)
            outcome: ExtendOutcome = "appended"
        else:
            full_ids = self._encode(rendered)
            if len(full_ids) >= max_tokens:
                return "overflow"
            self.segments.append(SegmentBuffer.from_prompt(full_ids))
            outcome = "new_segment"
        self.messages = conversation
        self._text = rendered
        self._turn_text = None
        return outcome
