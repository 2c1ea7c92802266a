"""One turn for a service caller (a judge, an evaluator) of the endpoint: nothing is recorded; its
`temperature`, `top_p`, `seed` and `max_tokens` (up to the context budget) are honoured; the run's
`top_k`, `min_p` and stop tokens apply. Engine failures become a 502 in the API's shape."""

from __future__ import annotations

import secrets
import time

from envs.api import ToolCall
from envs.toolcalls import get_parser, text_without_calls
from pipeline.supervisor.actors.agent_api.openai_wire import ChatRequest, Completion, OpenAIRequestError
from pipeline.supervisor.actors.chat import ChatTokenizer
from pipeline.supervisor.actors.rollout import GenerateEngine, RolloutSettings, stop_token_ids
from pipeline.supervisor.engines.protocol import EngineError, SamplingParams
from pipeline.supervisor.observability import metrics


class ServiceTurns:
    """Answers service requests, each under its own request id ("svc-<prefix>-<n>")."""

    def __init__(self, engine: GenerateEngine, tokenizer: ChatTokenizer, settings: RolloutSettings) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.settings = settings
        self.stops = stop_token_ids(settings, tokenizer)
        self._parser = get_parser(settings.tool_parser)
        self._prefix = secrets.token_hex(4)
        self._requests = 0

    def _prompt(self, request: ChatRequest) -> tuple[list[int], int]:
        """(the rendered prompt's ids, the tokens left for the completion); 400 when none are."""
        try:
            text = self.tokenizer.apply_chat_template(
                request.messages, tools=request.tools, add_generation_prompt=True, tokenize=False
            )
        except Exception as exc:
            raise OpenAIRequestError(
                400, f"the model's chat template cannot render these messages: {exc!r}", param="messages"
            ) from exc
        ids = list(self.tokenizer.encode(str(text), add_special_tokens=False))
        budget = self.settings.max_context_tokens - len(ids)
        if budget <= 0:
            raise OpenAIRequestError(
                400,
                f"the prompt ({len(ids)} tokens) does not fit the context budget ({budget + len(ids)})",
                param="messages",
                code="context_length_exceeded",
            )
        return ids, budget

    def _sampling(self, request: ChatRequest, budget: int) -> SamplingParams:
        base = self.settings.sampling
        return SamplingParams(
            temperature=base.temperature if request.temperature is None else request.temperature,
            top_p=base.top_p if request.top_p is None else request.top_p,
            top_k=base.top_k,
            min_p=base.min_p,
            max_new_tokens=min(request.max_tokens or base.max_new_tokens, budget),
            stop_token_ids=self.stops,
            seed=request.seed,
            stop=request.stop,
        )

    async def complete(self, request: ChatRequest) -> tuple[Completion, str]:
        """The completion and its request id (taken before the await: service calls run concurrently)."""
        ids, budget = self._prompt(request)
        sampling = self._sampling(request, budget)
        self._requests += 1
        rid = f"svc-{self._prefix}-{self._requests}"
        started = time.perf_counter()
        try:
            result = await self.engine.generate(ids, sampling, rid, affinity_key=rid)
        except EngineError as exc:
            metrics.ENGINE_ERRORS.labels(engine="pool", kind="error").inc()
            raise OpenAIRequestError(
                502, f"the engine failed: {exc}", code="engine_error", kind="server_error"
            ) from exc
        finally:
            metrics.ENGINE_REQUEST_LATENCY.labels(engine="pool").observe(time.perf_counter() - started)
        output = result.output_ids
        content_ids = output[:-1] if output and output[-1] in self.stops else output
        raw = self.tokenizer.decode(content_ids, skip_special_tokens=False)
        if result.matched is not None and result.matched in raw:
            raw = raw[: raw.index(result.matched)]
        calls: tuple[ToolCall, ...] = ()
        content: str | None = raw
        if request.parse_tools:
            action = self._parser(raw)
            if action.tool_calls and not action.tool_call_errors:
                calls, content = action.tool_calls, text_without_calls(raw, self.settings.tool_parser) or None
        logprobs = None
        if request.logprobs:
            logprobs = [
                (self.tokenizer.decode([token], skip_special_tokens=False), lp)
                for token, lp in zip(content_ids, result.logprobs, strict=False)
            ]
        finish = "length" if result.finish_reason == "length" else "tool_calls" if calls else "stop"
        completion = Completion(
            content=content,
            tool_calls=calls,
            call_ids=[f"call_{secrets.token_hex(8)}" for _ in calls],
            finish_reason=finish,
            prompt_tokens=len(ids),
            completion_tokens=len(output),
            logprobs=logprobs,
            fingerprint=f"rollwise-v{result.weight_version}",
            stop_sequence=result.matched,
        )
        return completion, rid
