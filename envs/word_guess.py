"""word-guess: a three-letter Wordle over a bundled list of WORDS.

Turn: the first three-letter word in the text (case-insensitive) is the guess. Feedback is one
symbol per letter, space-separated: ``G`` right letter in the right place, ``Y`` letter elsewhere in
the word, ``-`` not in the word (repeated letters are matched at most as often as the secret has
them, greens first). The secret word is done with outcome 1.0 (feedback "G G G"). A three-letter word
not in WORDS gets "unknown", text without one gets "invalid"; both cost -0.1 and count a turn.
After ``max_turns`` turns the episode is truncated with outcome 0.0.

The gold policy guesses, among the words consistent with all feedback so far, the one that splits
the remaining candidates into the most feedback classes; it solves every secret of WORDS within
6 turns (the default ``max_turns``), 3.3 on average.
"""

from __future__ import annotations

import functools
import itertools
import random
import re
from collections import Counter
from collections.abc import Iterator

from envs.api import Action, EnvError, Environment, EnvSpec, Message, StepResult, Task

INVALID_PENALTY = -0.1
WORDS: tuple[str, ...] = (
    "cat", "dog", "sun", "hat", "map", "cup", "pen", "box", "red", "bed",
    "bus", "car", "egg", "fan", "fox", "gum", "hen", "ink", "jar", "key",
    "leg", "mug", "net", "owl", "pig", "rat", "sky", "toy", "van", "web",
    "yak", "zip", "ant", "bag", "bat", "cow", "day", "ear", "fig", "gas",
    "ice", "jam", "kit", "lid", "man", "nut", "oak", "pan", "rug", "sea",
)  # fmt: skip
_WORD = re.compile(r"\b[a-zA-Z]{3}\b")

VOCAB_HINTS: list[str] = ["Guess", "my", "word", "G", "Y", "-", "unknown", "invalid", *WORDS]


def feedback(guess: str, secret: str) -> str:
    """Per-letter feedback of ``guess`` against ``secret`` (same length), e.g. ``"G Y -"``."""
    marks = ["-"] * len(guess)
    unmatched = Counter(s for g, s in zip(guess, secret, strict=True) if g != s)
    for index, (g, s) in enumerate(zip(guess, secret, strict=True)):
        if g == s:
            marks[index] = "G"
        elif unmatched[g] > 0:
            marks[index] = "Y"
            unmatched[g] -= 1
    return " ".join(marks)


@functools.lru_cache(maxsize=4096)
def best_guess(candidates: tuple[str, ...]) -> str:
    """The candidate whose feedback splits ``candidates`` into the most classes (first on ties).

    Cached: the first turn's candidates are always all of WORDS, and that search costs ~2,500 scorings.
    """
    return max(candidates, key=lambda guess: len({feedback(guess, secret) for secret in candidates}))


class WordGuessEnv(Environment):
    """Guess a secret three-letter word from per-letter feedback."""

    def __init__(self, max_turns: int = 6) -> None:
        self.spec = EnvSpec(name="word-guess", version="1", max_turns=max_turns)
        self._secret: str | None = None
        self._history: list[tuple[str, str]] = []  # (guess, feedback) for every valid guess
        self._turns = 0
        self._finished = False

    def tasks(self, seed: int) -> Iterator[Task]:
        for index in itertools.count():
            rng = random.Random(f"word-guess:{seed}:{index}")
            yield Task(
                id=f"word-guess-{seed}-{index}", seed=rng.getrandbits(31), data={"secret": rng.choice(WORDS)}
            )

    async def reset(self, task: Task) -> list[Message]:
        secret = task.data.get("secret")
        if secret not in WORDS:
            raise EnvError(f"word-guess task {task.id!r}: secret {secret!r} is not in the word list")
        self._secret, self._history = str(secret), []
        self._turns, self._finished = 0, False
        return [{"role": "user", "content": "Guess my word."}]

    async def step(self, action: Action) -> StepResult:
        if self._secret is None or self._finished:
            raise EnvError("word-guess: step() called before reset() or after the episode ended")
        self._turns += 1
        match = _WORD.search(action.text)
        guess = match.group().lower() if match else None
        if guess is None:
            content, reward = "invalid", INVALID_PENALTY
        elif guess not in WORDS:
            content, reward = "unknown", INVALID_PENALTY
        else:
            content, reward = feedback(guess, self._secret), 0.0
            self._history.append((guess, content))
        solved = guess == self._secret
        out_of_turns = not solved and self._turns >= self.spec.max_turns
        self._finished = solved or out_of_turns
        return StepResult(
            messages=[{"role": "user", "content": content}],
            reward=reward,
            done=solved,
            truncated=out_of_turns,
            outcome=1.0 if solved else (0.0 if out_of_turns else None),
            info={"valid": guess in WORDS},
        )

    def gold_action(self) -> str | None:
        if self._secret is None or self._finished:
            return None
        candidates = tuple(
            word for word in WORDS if all(feedback(guess, word) == marks for guess, marks in self._history)
        )
        return best_guess(candidates)
