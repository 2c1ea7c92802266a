"""reasoning-gym/<dataset>: the procedural tasks of reasoning-gym (~100 generators, nothing downloaded).

    [env]
    name = "reasoning-gym/basic_arithmetic"
    options = { config = { max_terms = 2, max_digits = 1 }, attempts = 2 }

- Tasks: task k of `tasks(seed)` is item k % size of `reasoning_gym.create_dataset(dataset, size=size,
  seed=(seed, data_seed, k // size), **config)`: each pass over `size` items draws new ones, the same seed
  the same stream. `Task.data` holds only that recipe; `reset` regenerates the item.
- Prompt: the item's question as the user message, after the system prompt `system_prompt` names (a key
  of `reasoning_gym.utils.SYSTEM_PROMPTS`, default "default"; any other string as written; None for none).
- Answer: `answer_format = "tag"` takes the last <answer>...</answer>, "text" the whole reply stripped,
  "number" the last number written; the dataset's own `score_answer` scores it (an exception scores 0).
- Turns: with `attempts = n > 1` a reply scoring below 1 gets feedback and another try, up to n; the
  outcome is the last try's score, turn rewards are 0.
- Gold policy: the item's own answer when the dataset scores it > 0 (else `env check` skips the gold phase).
The environment is synchronous library code: it runs in the shared thread pool (envs/sync_adapter.py).
Datasets are built once per (name, seed, size, config).
"""

from __future__ import annotations

import functools
import importlib.metadata
import itertools
import json
import random
import re
from collections.abc import Iterator
from typing import Any

from envs.api import (
    FORMAT_ERROR,
    Action,
    EnvError,
    EnvFactory,
    EnvFamily,
    EnvSpec,
    FamilyMember,
    Message,
    StepResult,
    Task,
)
from envs.sync_adapter import SyncEnvironment, as_async_factory

INSTALL_HINT = "pip install 'rollwise[reasoning-gym]'"
ANSWER_FORMATS = ("tag", "text", "number")
# A number as a reply writes it: an optional sign, digits, an optional decimal part ("-12", "3.5").
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
NEEDS_CONFIG = {"composite": "needs config.datasets (a mixture of other datasets)"}


def _library() -> Any:
    try:
        import reasoning_gym
    except ImportError as exc:
        raise ImportError(f"the reasoning-gym package is not installed ({INSTALL_HINT})") from exc
    return reasoning_gym


def _version() -> str:
    try:
        return importlib.metadata.version("reasoning-gym")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@functools.lru_cache(maxsize=64)
def _dataset(name: str, seed: int, size: int, config_json: str) -> Any:
    """The dataset object (cached: a dataset's items are a pure function of these arguments)."""
    library = _library()
    config = json.loads(config_json)
    try:
        return library.create_dataset(name, size=size, seed=seed, **config)
    except TypeError as exc:
        raise ValueError(f"reasoning-gym/{name}: config {config!r} is not accepted: {exc}") from None
    except AssertionError as exc:  # the datasets validate their configs with assert
        raise ValueError(f"reasoning-gym/{name}: config {config!r} is invalid: {exc}") from None


def dataset_seed(seed: int, data_seed: int, epoch: int) -> int:
    """The seed of pass `epoch` over the dataset for the run seed `seed` (deterministic, 31 bits)."""
    return random.Random(f"reasoning-gym:{seed}:{data_seed}:{epoch}").getrandbits(31)


class ReasoningGymEnv(SyncEnvironment):
    """One reasoning-gym dataset as a (possibly multi-attempt) environment; see the module docstring."""

    def __init__(
        self,
        dataset: str,
        *,
        size: int = 1000,
        data_seed: int = 0,
        config: dict[str, Any] | None = None,
        attempts: int = 1,
        answer_format: str = "tag",
        system_prompt: str | None = "default",
        step_timeout_s: float = 10.0,
    ) -> None:
        library = _library()
        if dataset not in library.factory.DATASETS:
            raise ValueError(
                f"reasoning-gym has no dataset {dataset!r} (`rollwise envs reasoning-gym` lists them)"
            )
        if size < 1 or attempts < 1:
            raise ValueError(f"size and attempts must be >= 1, got size={size}, attempts={attempts}")
        if answer_format not in ANSWER_FORMATS:
            raise ValueError(f"answer_format must be one of {ANSWER_FORMATS}, got {answer_format!r}")
        self.dataset = dataset
        self.size = size
        self.data_seed = data_seed
        self.config_json = json.dumps(config or {}, sort_keys=True)
        self.attempts = attempts
        self.answer_format = answer_format
        prompts = library.utils.SYSTEM_PROMPTS
        self.system_prompt = prompts.get(system_prompt, system_prompt) if system_prompt is not None else None
        _dataset(dataset, 0, size, self.config_json)  # a bad config fails here, at configuration time
        self.spec = EnvSpec(
            name=f"reasoning-gym/{dataset}",
            version=_version(),
            max_turns=attempts,
            step_timeout_s=step_timeout_s,
            episode_timeout_s=max(120.0, step_timeout_s * attempts),
        )
        self._item: dict[str, Any] | None = None
        self._source: Any = None
        self._tries = 0

    def tasks(self, seed: int) -> Iterator[Task]:
        for k in itertools.count():
            epoch, index = divmod(k, self.size)
            data_seed = dataset_seed(seed, self.data_seed, epoch)
            yield Task(
                id=f"{self.dataset}-{data_seed}-{index}",
                seed=data_seed,
                data={"dataset": self.dataset, "dataset_seed": data_seed, "index": index},
            )

    def reset(self, task: Task) -> list[Message]:
        try:
            source = _dataset(self.dataset, int(task.data["dataset_seed"]), self.size, self.config_json)
            item = source[int(task.data["index"])]
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise EnvError(
                f"reasoning-gym task {task.id!r} cannot be rebuilt from {dict(task.data)!r}: {exc!r}"
            ) from exc
        self._source, self._item, self._tries = source, item, 0
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*system, {"role": "user", "content": str(item["question"])}]

    def extract(self, text: str) -> str | None:
        """The answer in a reply (`answer_format`), or None when it has none."""
        if self.answer_format == "text":
            return text.strip() or None
        if self.answer_format == "number":
            numbers = _NUMBER.findall(text)
            return numbers[-1] if numbers else None
        answer = _library().utils.extract_answer(text)
        return None if answer is None else str(answer)

    def _score(self, answer: str | None) -> float:
        assert self._source is not None and self._item is not None
        try:
            score = float(self._source.score_answer(answer, self._item))
        except Exception:  # the library could not read this reply: it scores nothing
            return 0.0
        return score if 0.0 <= score <= 1.0 else 0.0

    def step(self, action: Action) -> StepResult:
        if self._item is None:
            raise EnvError(f"reasoning-gym/{self.dataset}: step() before reset()")
        self._tries += 1
        answer = self.extract(action.text)
        score = self._score(answer)
        info: dict[str, Any] = {"score": score, "answer_found": answer is not None, "attempt": self._tries}
        if answer is None:
            info[FORMAT_ERROR] = "no <answer> tag" if self.answer_format == "tag" else "empty reply"
        if score >= 1.0:
            return StepResult([{"role": "user", "content": "correct"}], done=True, outcome=score, info=info)
        if self._tries >= self.attempts:
            return StepResult(
                [{"role": "user", "content": "not correct"}], done=True, outcome=score, info=info
            )
        if answer is None and self.answer_format == "tag":
            feedback = "No answer found. Give your final answer between <answer> and </answer>."
        elif answer is None and self.answer_format == "number":
            feedback = "No number found. Reply with the number."
        else:
            feedback = "Your answer is not correct. Try again."
        return StepResult([{"role": "user", "content": feedback}], info=info)

    def close(self) -> None:
        self._item = self._source = None

    def gold_unavailable(self) -> str | None:
        if self._item is not None and self.gold_action() is None:
            return f"reasoning-gym/{self.dataset} stores no answer its score_answer accepts for this item"
        return None

    def gold_action(self) -> str | None:
        if self._item is None:
            return None
        answer = self._item.get("answer")
        if not isinstance(answer, str) or self._score(answer) <= 0.0:
            return None  # the dataset stores no answer it would accept
        return f"<answer>{answer}</answer>" if self.answer_format == "tag" else answer


def factory_for(dataset: str) -> EnvFactory:
    """The factory of reasoning-gym/<dataset> (ValueError for an unknown dataset, ImportError without the
    library)."""
    if dataset not in _library().factory.DATASETS:
        raise ValueError(
            f"reasoning-gym has no dataset {dataset!r} (`rollwise envs reasoning-gym` lists them)"
        )
    return as_async_factory(functools.partial(ReasoningGymEnv, dataset))


def members() -> list[FamilyMember]:
    return [FamilyMember(name, NEEDS_CONFIG.get(name, "")) for name in sorted(_library().factory.DATASETS)]


FAMILY = EnvFamily(name="reasoning-gym", factory_for=factory_for, members=members)
