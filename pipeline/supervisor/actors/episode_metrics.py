"""The training episodes' metrics of one env label, chosen once per episode: `EpisodeMetrics` records,
its twin `UnrecordedMetrics` (an evaluation episode, `run_episode(record_metrics=False)`) records
nothing. Engine and environment failures are counted either way (episode_end). Children are bound once
per label: labels() per turn would cost a lock and a lookup."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from pipeline.supervisor.actors.outcomes import EpisodeOutcome
from pipeline.supervisor.observability import metrics


def budget_cut(text: str, answers: tuple[str, ...]) -> bool:
    """Whether a turn the token budget ended was cut short. Without a list of the environment's complete
    answers (EnvSpec.action_hints) every such turn was; with one, only a reply that is the beginning of
    an answer and not an answer itself: a whole answer that fills the budget exactly was not cut, and a
    reply that begins no answer is a wrong answer, which a larger budget would not fix."""
    if not answers:
        return True
    reply = text.strip()
    return reply not in answers and any(answer.startswith(reply) for answer in answers)


class EpisodeMetrics:
    """Records an episode's turns and its end under `env_name`."""

    def __init__(self, env_name: str) -> None:
        self.env_name = env_name
        self._turns = metrics.TURNS.labels(env=env_name)
        self._turns_cut = metrics.TURNS_CUT.labels(env=env_name)
        self._generated_tokens = metrics.GENERATED_TOKENS.labels(env=env_name)
        self._prompt_tokens = metrics.PROMPT_TOKENS.labels(env=env_name)
        self._prompt_tokens_cached = metrics.PROMPT_TOKENS_CACHED.labels(env=env_name)
        self._turn_tokens = metrics.TURN_TOKENS.labels(env=env_name)
        self._turn_reward = metrics.TURN_REWARD.labels(env=env_name)
        self._step_latency = metrics.ENV_STEP_LATENCY.labels(env=env_name)
        self._tool_calls = metrics.TOOL_CALLS.labels(env=env_name)
        self._tool_call_errors = metrics.TOOL_CALL_ERRORS.labels(env=env_name)
        self._without_tool_calls = metrics.EPISODES_WITHOUT_TOOL_CALLS.labels(env=env_name)
        self._format_errors = metrics.ANSWER_FORMAT_ERRORS.labels(env=env_name)

    def started(self) -> None:
        metrics.EPISODES_IN_FLIGHT.inc()

    def stopped(self) -> None:
        metrics.EPISODES_IN_FLIGHT.dec()

    def generated(self, tokens: int, prompt_tokens: int | None, cached_tokens: int) -> None:
        """One engine answer: `prompt_tokens` None when it was aborted before anything was prefilled."""
        self._generated_tokens.inc(tokens)
        if prompt_tokens is not None:
            self._prompt_tokens.inc(prompt_tokens)
            self._prompt_tokens_cached.inc(cached_tokens)

    def turn_generated(self, tokens: int) -> None:
        self._turns.inc()
        self._turn_tokens.observe(tokens)

    def turn_cut(self) -> None:
        self._turns_cut.inc()

    def tool_calls(self, calls: int, errors: int) -> None:
        if calls:
            self._tool_calls.inc(calls)
        if errors:
            self._tool_call_errors.inc(errors)

    def step_latency(self, seconds: float) -> None:
        self._step_latency.observe(seconds)

    def format_error(self) -> None:
        self._format_errors.inc()

    def turn_reward(self, reward: float) -> None:
        self._turn_reward.observe(reward)

    def ended(self, outcome: EpisodeOutcome, tool_calls: int, has_tools: bool) -> None:
        record_episode(outcome)
        if tool_calls == 0 and has_tools and outcome.trainable:
            self._without_tool_calls.inc()


class UnrecordedMetrics(EpisodeMetrics):
    """Records nothing: the turn-level metrics of an evaluation episode."""

    def __init__(self, env_name: str) -> None:
        self.env_name = env_name

    def started(self) -> None:
        pass

    def stopped(self) -> None:
        pass

    def generated(self, tokens: int, prompt_tokens: int | None, cached_tokens: int) -> None:
        pass

    def turn_generated(self, tokens: int) -> None:
        pass

    def turn_cut(self) -> None:
        pass

    def tool_calls(self, calls: int, errors: int) -> None:
        pass

    def step_latency(self, seconds: float) -> None:
        pass

    def format_error(self) -> None:
        pass

    def turn_reward(self, reward: float) -> None:
        pass

    def ended(self, outcome: EpisodeOutcome, tool_calls: int, has_tools: bool) -> None:
        pass


@lru_cache(maxsize=256)
def episode_metrics(env_name: str, record: bool = True) -> EpisodeMetrics:
    return EpisodeMetrics(env_name) if record else UnrecordedMetrics(env_name)


@lru_cache(maxsize=1024)
def _episodes_counter(env_name: str, finish_reason: str) -> Any:
    return metrics.EPISODES.labels(env=env_name, reason=finish_reason)


@lru_cache(maxsize=256)
def _episode_children(env_name: str) -> tuple[Any, ...]:
    """(turns, duration, reward, positive reward, negative reward, successes) of `env_name`."""
    return (
        metrics.EPISODE_TURNS.labels(env=env_name),
        metrics.EPISODE_DURATION.labels(env=env_name),
        metrics.EPISODE_REWARD.labels(env=env_name),
        metrics.EPISODE_REWARD_POSITIVE.labels(env=env_name),
        metrics.EPISODE_REWARD_NEGATIVE.labels(env=env_name),
        metrics.EPISODE_SUCCESSES.labels(env=env_name),
    )


def record_episode(outcome: EpisodeOutcome) -> None:
    """An episode ended (any runner's, failed ones included): its count by finish reason, turns,
    duration, and for a trainable one its score; a success."""
    _episodes_counter(outcome.env, outcome.finish_reason).inc()
    turns, duration, reward, positive, negative, successes = _episode_children(outcome.env)
    turns.observe(outcome.num_turns)
    duration.observe(outcome.duration_s)
    if outcome.trainable:
        score = outcome.score
        reward.observe(score)
        if score >= 0:
            positive.inc(score)
        else:
            negative.inc(-score)
    if outcome.success:
        successes.inc()
