"""Guess a number from 1 to 8 in at most 3 turns, told "higher" or "lower" after each wrong guess.

The target is drawn from the reset seed. A correct guess scores 1.0 and ends the episode; a third wrong
guess ends it with 0.0; a reply that is not a whole number is answered and scores 0.0, unless the reset
asked for `coin = True`: then it scores a fair coin flip drawn from the OS (not the seed), which gives
a random policy's groups reward variance in a training test. The action has two fields (`guess`, and
an optional `note`). Served only by the OpenEnv venv.
"""

from __future__ import annotations

import os
import random
from typing import Any

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

LOW, HIGH, GUESSES = 1, 8, 3


class GuessAction(Action):
    guess: str
    note: str = ""  # a second field: the adapter then wants JSON unless told which field takes the text


class GuessObservation(Observation):
    feedback: str = ""


class GuessState(State):
    target: int = 0
    solved: bool = False
    coin: bool = False


class GuessEnvironment(Environment):
    # GUESS_ENV_SINGLE=1 makes it one that keeps its app's cap of one session (the capacity test).
    SUPPORTS_CONCURRENT_SESSIONS = os.environ.get("GUESS_ENV_SINGLE") != "1"

    def __init__(self) -> None:
        super().__init__()
        self._state = GuessState()

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, coin: bool = False, **kwargs: Any
    ) -> GuessObservation:
        target = random.Random(seed).randint(LOW, HIGH)
        self._state = GuessState(episode_id=episode_id, target=target, coin=bool(coin))
        return GuessObservation(
            feedback=f"I picked a whole number from {LOW} to {HIGH}. Guess it: reply with the number only. "
            f"You have {GUESSES} guesses.",
            reward=0.0,
        )

    def step(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:
        assert isinstance(action, GuessAction)
        state = self._state
        state.step_count += 1
        last = state.step_count >= GUESSES
        text = action.guess.strip()
        if not text.isdigit():
            reward = float(random.SystemRandom().random() < 0.5) if state.coin else 0.0
            feedback = f"{text[:40]!r} is not a whole number."
        elif int(text) == state.target:
            state.solved = True
            return GuessObservation(
                feedback="Correct!", reward=1.0, done=True, metadata={"guesses": state.step_count}
            )
        else:
            reward = 0.0
            feedback = "Higher." if int(text) < state.target else "Lower."
        if last:
            feedback += f" No guesses left: it was {state.target}."
        return GuessObservation(
            feedback=feedback, reward=reward, done=last, metadata={"guesses": state.step_count}
        )

    @property
    def state(self) -> GuessState:
        return self._state


app = create_app(GuessEnvironment, GuessAction, GuessObservation, env_name="guess_env", max_concurrent_envs=1)
