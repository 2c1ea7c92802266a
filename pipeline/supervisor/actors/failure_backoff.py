"""Backing admission off while whole groups fail.

A group whose every episode failed (an engine down, a broken environment) takes milliseconds, and it is
still written (the learner drops it as `too_few_members`, so the loss shows in its drop counts). Each
such group in a row doubles a pause of admission (`failure_backoff_s` = (first, longest) pause); a group
with a trainable episode resets it. The warning, logged and sent to `notify` at the 1st, 2nd, 4th,
8th ... group of a streak, says why: the streak's episodes by finish reason and its most frequent error
messages (`FailureStreak`)."""

from __future__ import annotations

import logging
import re
import time
from collections import Counter
from collections.abc import Callable

from pipeline.supervisor.actors.outcomes import EpisodeOutcome

log = logging.getLogger(__name__)


class FailureStreak:
    """Why the groups of a streak of wholly failed groups failed: their episodes counted by finish
    reason, and their error messages counted by shape (digits ignored, so "The input (1020 tokens)" and
    "(1024 tokens)" count together; the first message of each shape is the one shown)."""

    MAX_SHAPES = 64  # distinct messages kept: a streak of unique messages must not grow without bound
    SHOWN = 3

    def __init__(self) -> None:
        self.groups = 0
        self.reasons: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self._example: dict[str, str] = {}

    def add(self, episodes: list[EpisodeOutcome]) -> None:
        self.groups += 1
        for episode in episodes:
            self.reasons[episode.finish_reason] += 1
            if episode.error:
                shape = re.sub(r"\d+", "#", episode.error)[:300]
                if shape not in self._example and len(self._example) >= self.MAX_SHAPES:
                    shape = "(other messages)"
                self._example.setdefault(shape, episode.error[:300])
                self.errors[shape] += 1

    def summary(self) -> str:
        episodes = sum(self.reasons.values())
        reasons = ", ".join(f"{reason} {count}" for reason, count in self.reasons.most_common())
        text = f"{episodes} episodes ended {reasons or 'without episodes'}"
        if self.errors:
            top = "; ".join(
                f"{count} x {self._example[shape]!r}" for shape, count in self.errors.most_common(self.SHOWN)
            )
            text += f"; most frequent errors: {top}"
        return text


class FailureBackoff:
    """The pause admission takes after wholly failed groups (module docstring): admission waits until
    `resume_at` (time.monotonic)."""

    def __init__(self, pause_s: tuple[float, float], notify: Callable[[str], None]) -> None:
        self.pause_s = pause_s
        self.notify = notify
        self.streak = 0
        self.why = FailureStreak()
        self.resume_at = 0.0
        self.failed_groups = 0  # groups written with no trainable episode

    def note(self, group_id: str, episodes: list[EpisodeOutcome]) -> None:
        """A group finished with these episodes."""
        if any(ep.trainable for ep in episodes):
            self.streak = 0
            self.why = FailureStreak()
            return
        self.streak += 1
        self.why.add(episodes)
        base_s, max_s = self.pause_s
        delay = min(max_s, base_s * 2 ** min(self.streak - 1, 30))
        self.resume_at = max(self.resume_at, time.monotonic() + delay)
        self.failed_groups += 1
        if self.streak & (self.streak - 1) == 0:  # 1, 2, 4, 8...: not every group
            text = (
                f"group {group_id}: every episode failed ({self.streak} groups in a row; "
                f"{self.why.summary()}); pausing admission for {delay:.2f} s"
            )
            log.warning("%s", text)
            self.notify(text)
