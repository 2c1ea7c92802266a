"""LLM-judge rewards: any environment can score an answer with a model behind an OpenAI-compatible endpoint.

    judge = shared_judge(JudgeConfig(rubric=..., base_url="http://judge:30000/v1", model="Qwen/Qwen3-8B"))
    verdict = await judge.score(question=q, response=answer, reference=gold)   # JudgeScore, or JudgeError
    return StepResult(messages, done=True, outcome=verdict.score)

- Endpoint: `base_url` of any OpenAI-compatible server, or None for the run's own engines (the daemon's
  in-process endpoint registers itself with `set_run_endpoint`). Key: `api_key`, else the variable that
  `api_key_env` names.
- Prompt: `rubric` is a `str.format` template over {question}, {response}, {reference}, {min_score} and
  {max_score} (plus any extra keyword `score` is given), sent after an optional `system_prompt`.
- Parse: the last match of `score_pattern` (one number group) must lie in [min_score, max_score];
  `JudgeScore.score` is it mapped to [0, 1].
- Limits: at most `max_concurrency` requests in flight per judge (share one with `shared_judge`), each
  within `timeout_s`; timeouts, connection errors, HTTP 429/5xx and replies without a score are retried
  `retries` times with exponential backoff; any other status fails at once.
- Failure: `JudgeError` (an `EnvError` of kind "judge", `reason` = the last attempt's status). Raised from
  `step`, it ends the episode as env_error: never trained, never scored 0.
- Metrics: every attempt and failure goes to the listeners (`add_listener`); the daemon exports them
  (pipeline/supervisor/observability/judge_metrics.py).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from envs.api import EnvError

DEFAULT_RUBRIC = (
    "Grade the answer to the question below.\n\n"
    "Question:\n{question}\n\nReference answer:\n{reference}\n\nAnswer to grade:\n{response}\n\n"
    "Give a score from {min_score} (wrong) to {max_score} (fully correct). Think briefly, then end with a "
    "line of the form 'Score: <number>'."
)
DEFAULT_SCORE_PATTERN = r"(?i)score\s*[:=]\s*(-?\d+(?:\.\d+)?)"
STATUSES = ("ok", "timeout", "connection", "http", "parse")


class JudgeError(EnvError):
    """The judge could not score (after retries). `reason`: timeout, connection, http, parse or config."""

    kind = "judge"

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class JudgeConfig:
    """How a judge is reached and asked (module docstring). Frozen and hashable: `shared_judge` keys on it."""

    base_url: str | None = None
    model: str = "policy"
    api_key: str | None = None
    api_key_env: str | None = None
    rubric: str = DEFAULT_RUBRIC
    system_prompt: str | None = None
    score_pattern: str = DEFAULT_SCORE_PATTERN
    min_score: float = 0.0
    max_score: float = 10.0
    max_concurrency: int = 8
    timeout_s: float = 60.0
    retries: int = 2
    backoff_s: float = 0.5
    max_tokens: int = 256
    temperature: float = 0.0
    seed: int | None = None
    name: str = "judge"

    def __post_init__(self) -> None:
        problems = []
        if not self.max_score > self.min_score:
            problems.append(f"max_score ({self.max_score}) must exceed min_score ({self.min_score})")
        if self.max_concurrency < 1 or self.retries < 0 or self.max_tokens < 1:
            problems.append("max_concurrency >= 1, retries >= 0 and max_tokens >= 1 are required")
        if not (self.timeout_s > 0 and self.backoff_s >= 0):
            problems.append(
                f"timeout_s must be > 0 and backoff_s >= 0, got {self.timeout_s}, {self.backoff_s}"
            )
        try:
            pattern = re.compile(self.score_pattern)
        except re.error as exc:
            problems.append(f"score_pattern is not a regular expression: {exc}")
        else:
            if pattern.groups != 1:
                problems.append(f"score_pattern must have exactly one group, has {pattern.groups}")
        try:
            self.rubric.format(question="", response="", reference="", min_score=0, max_score=1)
        except (KeyError, IndexError, ValueError) as exc:
            problems.append(f"rubric is not a format template over question/response/reference: {exc!r}")
        if problems:
            raise ValueError("invalid JudgeConfig: " + "; ".join(problems))


@dataclass(frozen=True)
class JudgeScore:
    """A verdict: `score` in [0, 1] (the parsed `raw` mapped from [min_score, max_score]), the judge's
    `text`, the `attempts` it took and the `seconds` of the successful one."""

    score: float
    raw: float
    text: str
    attempts: int
    seconds: float


@dataclass(frozen=True)
class JudgeEvent:
    """One attempt (`status` in STATUSES, its `seconds`; `failure` None) or one verdict that could not be
    given (`failure` = the reason: the last attempt's status, or "config"; `status` and `seconds` repeat
    nothing new)."""

    judge: str
    status: str
    seconds: float
    failure: str | None = None

    @property
    def is_attempt(self) -> bool:
        return self.failure is None


JudgeListener = Callable[[JudgeEvent], None]
_listeners: list[JudgeListener] = []
_run_endpoint: tuple[str, str] | None = None


def add_listener(listener: JudgeListener) -> None:
    """Call `listener` for every judge attempt and failure (idempotent for the same function)."""
    if listener not in _listeners:
        _listeners.append(listener)


def set_run_endpoint(base_url: str | None, api_key: str | None = None) -> None:
    """Where judges with `base_url=None` find the run's own engines (called by rollwise when a run starts;
    None clears it)."""
    global _run_endpoint
    _run_endpoint = None if base_url is None else (base_url, api_key or "")


def _emit(event: JudgeEvent) -> None:
    for listener in list(_listeners):
        listener(event)


class _Attempt(Exception):
    """One failed attempt: its status and whether another attempt may help."""

    def __init__(self, status: str, message: str, *, retry: bool) -> None:
        super().__init__(message)
        self.status = status
        self.retry = retry


class Judge:
    """Scores answers with the model `config` describes; see the module docstring."""

    def __init__(self, config: JudgeConfig | None = None) -> None:
        self.config = config or JudgeConfig()
        self._pattern = re.compile(self.config.score_pattern)
        self._limits: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary()
        )

    def _limit(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        semaphore = self._limits.get(loop)
        if semaphore is None:
            semaphore = self._limits[loop] = asyncio.Semaphore(self.config.max_concurrency)
        return semaphore

    def _target(self) -> tuple[str, str | None]:
        config = self.config
        if config.base_url is None:
            if _run_endpoint is None:
                raise JudgeError(
                    f"judge {config.name!r}: base_url is unset (the run's own engines) and no rollwise run "
                    "serves them in this process",
                    reason="config",
                )
            return _run_endpoint
        key = config.api_key
        if key is None and config.api_key_env is not None:
            key = os.environ.get(config.api_key_env)
            if key is None:
                raise JudgeError(
                    f"judge {config.name!r}: environment variable {config.api_key_env} is not set",
                    reason="config",
                )
        return config.base_url.rstrip("/"), key

    def parse(self, text: str) -> float | None:
        """The score in `text` (the last match of the pattern) if it lies in [min_score, max_score]."""
        matches = self._pattern.findall(text)
        if not matches:
            return None
        try:
            value = float(matches[-1])
        except ValueError:
            return None
        if not math.isfinite(value) or not self.config.min_score <= value <= self.config.max_score:
            return None
        return value

    def messages(
        self, *, response: str, question: str = "", reference: str = "", **fields: Any
    ) -> list[dict[str, str]]:
        """The chat messages sent for one verdict."""
        config = self.config
        prompt = config.rubric.format(
            question=question,
            response=response,
            reference=reference,
            min_score=_plain(config.min_score),
            max_score=_plain(config.max_score),
            **fields,
        )
        system = [{"role": "system", "content": config.system_prompt}] if config.system_prompt else []
        return [*system, {"role": "user", "content": prompt}]

    async def score(
        self, *, response: str, question: str = "", reference: str = "", **fields: Any
    ) -> JudgeScore:
        """Ask the judge; JudgeScore, or JudgeError after the retries (module docstring)."""
        config = self.config
        try:
            base_url, key = self._target()
        except JudgeError:
            _emit(JudgeEvent(config.name, "config", 0.0, failure="config"))
            raise
        body: dict[str, Any] = {
            "model": config.model,
            "messages": self.messages(response=response, question=question, reference=reference, **fields),
            "max_tokens": config.max_tokens,
            "temperature": config.temperature,
        }
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        last: _Attempt | None = None
        for attempt in range(config.retries + 1):
            if attempt:
                await asyncio.sleep(config.backoff_s * 2 ** (attempt - 1))
            if config.seed is not None:
                body["seed"] = config.seed + attempt
            started = time.perf_counter()
            try:
                async with self._limit():
                    text = await self._ask(f"{base_url}/chat/completions", body, headers)
                value = self.parse(text)
                if value is None:
                    raise _Attempt(
                        "parse",
                        f"no score in [{config.min_score}, {config.max_score}] in {text!r:.200}",
                        retry=True,
                    )
            except _Attempt as failed:
                _emit(JudgeEvent(config.name, failed.status, time.perf_counter() - started))
                last = failed
                if not failed.retry:
                    break
                continue
            seconds = time.perf_counter() - started
            _emit(JudgeEvent(config.name, "ok", seconds))
            span = config.max_score - config.min_score
            return JudgeScore((value - config.min_score) / span, value, text, attempt + 1, seconds)
        assert last is not None
        _emit(JudgeEvent(config.name, last.status, 0.0, failure=last.status))
        raise JudgeError(
            f"judge {config.name!r} failed after {attempt + 1} attempt(s): {last}", reason=last.status
        )

    async def _ask(self, url: str, body: dict[str, Any], headers: dict[str, str]) -> str:
        timeout = aiohttp.ClientTimeout(total=self.config.timeout_s)
        try:
            async with (
                aiohttp.ClientSession(timeout=timeout) as session,
                session.post(url, json=body, headers=headers) as reply,
            ):
                raw = await reply.text()
                if reply.status != 200:
                    retry = reply.status == 429 or reply.status >= 500
                    raise _Attempt("http", f"HTTP {reply.status} from {url}: {raw[:300]}", retry=retry)
        except TimeoutError as exc:
            raise _Attempt(
                "timeout", f"no reply from {url} within {self.config.timeout_s} s", retry=True
            ) from exc
        except aiohttp.ClientError as exc:
            raise _Attempt("connection", f"{url}: {exc!r}", retry=True) from exc
        try:
            content = json.loads(raw)["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise _Attempt(
                "http", f"{url} answered something that is not a chat completion: {raw[:200]!r}", retry=True
            ) from exc
        return content if isinstance(content, str) else ""


def _plain(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


_shared: dict[JudgeConfig, Judge] = {}


def shared_judge(config: JudgeConfig) -> Judge:
    """The process-wide Judge for `config`: environments are made once per episode, and sharing the judge
    is what makes `max_concurrency` bound every episode's requests together."""
    judge = _shared.get(config)
    if judge is None:
        judge = _shared[config] = Judge(config)
    return judge
