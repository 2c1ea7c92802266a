"""textarena/<EnvId>: TextArena's games as multi-turn episodes (observation -> action -> observation).

    [env]
    name = "textarena/GuessTheNumber-v0"
    options = { kwargs = { max_number = 8, max_turns = 4 } }

- The game: `textarena.make(EnvId, **kwargs)` without TextArena's observation wrappers (the runner keeps
  the chat history); its registered action wrappers apply unless `action_formatting = false` (`-raw`
  ids have none; `-train` is the default game).
- Turns: the first user message is what the game shows the player at the start; each assistant reply goes
  to `game.step` verbatim, and the game's new messages to the player become the next user message
  (another player's moves prefixed `[Player k]`). Invalid moves are the game's business.
- Rewards: the outcome is the player's reward from `game.close()` (1 = solved; two-player: 1 win, 0 draw,
  -1 loss); turn rewards are 0; a non-finite reward is an environment failure. `max_turns` (default: twice
  the game's own limit, else 64) truncates an episode with outcome 0.0.
- Players: two-player games need `opponent` ("first-listed", "random-listed", or a "module:attr" /
  "file.py:attr" path to `make_opponent(seed) -> (observation -> action)`); the policy plays `seat`. Games
  for more players are refused.
- Offline: games that need nltk corpora run only when those are installed (`nltk.download` is kept off
  the network); games that call a hosted model are refused. Decided from the game's source, unimported.
- Determinism: every call into a game runs under one process-wide lock with the episode's own `random`
  (and numpy) state swapped in, so `reset(task)` depends on the task alone. The games are synchronous:
  they run in the shared thread pool (envs/sync_adapter.py).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import itertools
import random
import re
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from envs.api import (
    Action,
    EnvError,
    EnvFactory,
    EnvFamily,
    EnvSpec,
    FamilyMember,
    Message,
    StepResult,
    Task,
    is_finite_number,
)
from envs.sync_adapter import SyncEnvironment, as_async_factory

INSTALL_HINT = "pip install 'rollwise[textarena]'"
DEFAULT_MAX_TURNS = 64
_VARIANT_SUFFIXES = ("-raw", "-train")
_GAME_LOCK = threading.Lock()  # the global RNG is shared: one game call at a time in this process

Opponent = Callable[[str], str]


def _library() -> Any:
    try:
        import textarena
    except ImportError as exc:
        raise ImportError(f"the textarena package is not installed ({INSTALL_HINT})") from exc
    return textarena


def _version() -> str:
    try:
        return importlib.metadata.version("textarena")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


# ------------------------------------------------------------------------------------------- game info
@dataclass(frozen=True)
class GameInfo:
    """What a game needs, read from its source files (nothing imported)."""

    env_id: str
    entry_point: str
    players: int | None  # 1, 2, or None (more, or unknown)
    nltk_resources: tuple[str, ...]
    missing_nltk: tuple[str, ...]
    network: str | None  # why the game needs the network, if it does

    @property
    def unavailable(self) -> str | None:
        """Why this game cannot run here at all, or None."""
        if self.network is not None:
            return f"needs the network ({self.network})"
        if self.missing_nltk:
            names = " ".join(self.missing_nltk)
            return (
                f"needs the nltk data {list(self.missing_nltk)}, which is not installed, and would download "
                f"it at run time (no network here); install it where there is network with `python -m "
                f"nltk.downloader {names}` (or copy it into NLTK_DATA)"
            )
        if self.players is None:
            return "has more than two players (not supported)"
        return None


_NLTK_DOWNLOAD = re.compile(r"nltk\.download\(\s*([^)]*)\)")
_QUOTED = re.compile(r"""["']([A-Za-z0-9_.-]+)["']""")
_NLTK_CATEGORIES = ("corpora", "taggers", "tokenizers", "chunkers", "models", "misc", "sentiment", "grammars")


def _game_sources(entry_point: str) -> str:
    """The text of the game's package (every .py file of textarena/envs/<Game>/), unread modules skipped."""
    module = entry_point.partition(":")[0]
    root = Path(_library().__file__).parent.parent
    path = root.joinpath(*module.split(".")).with_suffix(".py")
    folder = path.parent
    files = sorted(folder.rglob("*.py")) if folder.name != "envs" and folder.is_dir() else [path]
    return "\n".join(f.read_text(errors="replace") for f in files if f.is_file())


def _nltk_has(resource: str) -> bool:
    try:
        import nltk
    except ImportError:
        return False
    for category in _NLTK_CATEGORIES:
        try:
            nltk.data.find(f"{category}/{resource}")
        except LookupError:
            continue
        return True
    return False


@functools.lru_cache(maxsize=1024)
def game_info(env_id: str) -> GameInfo:
    """GameInfo of a registered id; ValueError naming close ids when it is not registered."""
    registry = _library().envs.registration.ENV_REGISTRY
    if env_id not in registry:
        close = [name for name in registry if name.lower().startswith(env_id.split("-")[0].lower())][:8]
        hint = f"; similar: {', '.join(close)}" if close else ""
        raise ValueError(f"TextArena has no game {env_id!r} (`rollwise envs textarena` lists them){hint}")
    entry_point = registry[env_id].entry_point
    if not isinstance(entry_point, str):
        entry_point = f"{entry_point.__module__}:{entry_point.__qualname__}"
    source = _game_sources(entry_point)
    resources: dict[str, None] = {}
    for call in _NLTK_DOWNLOAD.finditer(source):
        for name in _QUOTED.findall(call.group(1)):
            resources.setdefault(name, None)
    if "EnglishDictionary" in source or "words.words(" in source:
        resources.setdefault("words", None)
    if "pos_tag" in source:
        resources.setdefault("averaged_perceptron_tagger_eng", None)
    network = "a hosted model through OpenRouter" if "OpenRouter" in source else None
    players = 1 if "SinglePlayerState" in source else 2 if "TwoPlayerState" in source else None
    missing = tuple(name for name in resources if not _nltk_has(name))
    return GameInfo(env_id, entry_point, players, tuple(resources), missing, network)


@contextlib.contextmanager
def _offline_nltk() -> Iterator[None]:
    """`nltk.download` answers from the local data only: True when installed, never a network call."""
    try:
        import nltk
    except ImportError:
        yield
        return
    original = nltk.download

    def local_only(info_or_id: Any = None, *args: Any, **kwargs: Any) -> bool:
        names = info_or_id if isinstance(info_or_id, list | tuple) else [info_or_id]
        return all(isinstance(name, str) and _nltk_has(name) for name in names)

    nltk.download = local_only
    try:
        yield
    finally:
        nltk.download = original


# ------------------------------------------------------------------------------------------- opponents
_MOVES_LINE = re.compile(r"(?:available|valid|legal)\s+(?:moves|actions)\s*:(.*)", re.IGNORECASE)
_BRACKETED = re.compile(r"\[[^\[\]\n]{1,40}\]")


def listed_moves(observation: str) -> list[str]:
    """The bracketed moves of the last "Available/Valid/Legal moves:" line of an observation."""
    lines = _MOVES_LINE.findall(observation)
    return _BRACKETED.findall(lines[-1]) if lines else []


def first_listed(seed: int) -> Opponent:
    """A fixed opponent: the first move the game lists."""

    def play(observation: str) -> str:
        moves = listed_moves(observation)
        if not moves:
            raise EnvError(
                f"opponent 'first-listed' found no 'Available Moves:' list in {observation[-200:]!r}"
            )
        return moves[0]

    return play


def random_listed(seed: int) -> Opponent:
    """A fixed opponent: a uniformly random listed move, from a generator seeded per episode."""
    rng = random.Random(f"textarena-opponent:{seed}")

    def play(observation: str) -> str:
        moves = listed_moves(observation)
        if not moves:
            raise EnvError(
                f"opponent 'random-listed' found no 'Available Moves:' list in {observation[-200:]!r}"
            )
        return rng.choice(moves)

    return play


BUILTIN_OPPONENTS: dict[str, Callable[[int], Opponent]] = {
    "first-listed": first_listed,
    "random-listed": random_listed,
}


def _opponent_factory(opponent: str | Callable[[int], Opponent]) -> Callable[[int], Opponent]:
    if callable(opponent):
        return opponent
    if opponent in BUILTIN_OPPONENTS:
        return BUILTIN_OPPONENTS[opponent]
    if ":" not in opponent:
        raise ValueError(
            f"opponent {opponent!r} is neither a built-in ({', '.join(BUILTIN_OPPONENTS)}) nor a "
            "'module:attr' / 'file.py:attr' path"
        )
    from envs.discovery import EnvDiscoveryError, load_object

    try:
        target = load_object(opponent)
    except EnvDiscoveryError as exc:
        raise ValueError(f"opponent: {exc}") from None
    if not callable(target):
        raise ValueError(f"opponent: {opponent!r} is {target!r}, not a make_opponent(seed) callable")
    opponent_factory: Callable[[int], Opponent] = target
    return opponent_factory


# ------------------------------------------------------------------------------------------- the env
def _format(messages: list[Any], me: int, game_id: int) -> str:
    """A player's new messages as one user message: own moves dropped, other players' moves labelled."""
    import textarena

    lines = []
    for sender, text, kind in messages:
        if sender == me and kind == textarena.ObservationType.PLAYER_ACTION:
            continue
        lines.append(str(text) if sender in (game_id, me) else f"[Player {sender}] {text}")
    return "\n".join(lines).strip()


class TextArenaEnv(SyncEnvironment):
    """One TextArena game as an environment; see the module docstring."""

    def __init__(
        self,
        env_id: str,
        *,
        kwargs: dict[str, Any] | None = None,
        opponent: str | Callable[[int], Opponent] | None = None,
        seat: int = 0,
        max_turns: int | None = None,
        step_timeout_s: float = 10.0,
        action_formatting: bool = True,
    ) -> None:
        self.info = game_info(env_id)
        if self.info.unavailable is not None:
            raise ValueError(f"textarena/{env_id} {self.info.unavailable}")
        if self.info.players == 2 and opponent is None:
            raise ValueError(
                f"textarena/{env_id} is a two-player game: set env.options.opponent to a fixed opponent "
                f"({', '.join(BUILTIN_OPPONENTS)}, or a 'module:attr' path to make_opponent(seed))"
            )
        if self.info.players == 1 and opponent is not None:
            raise ValueError(f"textarena/{env_id} is a single-player game: it takes no opponent")
        if seat not in range(self.info.players or 1):
            raise ValueError(f"seat must be 0 or 1 for a two-player game (0 for one player), got {seat}")
        self.env_id = env_id
        self.kwargs = dict(kwargs or {})
        self.seat = seat
        self.make_opponent = _opponent_factory(opponent) if opponent is not None else None
        self.action_formatting = action_formatting
        self._action_wrappers: list[Any] = []
        game = self._make()  # bad kwargs and broken game modules fail here, at configuration time
        game_turns = getattr(game, "max_turns", None)
        if max_turns is None:
            max_turns = (
                2 * game_turns if isinstance(game_turns, int) and game_turns > 0 else DEFAULT_MAX_TURNS
            )
        self.spec = EnvSpec(
            name=f"textarena/{env_id}",
            version=_version(),
            max_turns=max_turns,
            step_timeout_s=step_timeout_s,
            episode_timeout_s=max(120.0, step_timeout_s * max_turns),
        )
        self._game: Any = None
        self._spare: Any = game  # made once already: the first reset uses it (some games load word lists)
        self._opponent: Opponent | None = None
        self._opponent_log: list[Any] = []
        self._rng_state: Any = None
        self._np_state: Any = None
        self._steps = 0
        self._done = False

    def _make(self) -> Any:
        library = _library()
        try:
            with _GAME_LOCK, _offline_nltk():
                game = library.make(self.env_id, **self.kwargs)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"textarena/{self.env_id} rejects kwargs {self.kwargs!r}: {exc}") from None
        except Exception as exc:  # a game module that does not import (a syntax error in the library)
            raise ValueError(f"textarena/{self.env_id} cannot be made: {exc!r}") from None
        actions = []
        while isinstance(game, library.Wrapper):
            if isinstance(game, library.ActionWrapper):
                actions.append(game)  # outermost first: the order step() would apply them in
            game = game.env
        self._action_wrappers = actions if self.action_formatting else []
        return game

    def _act(self, text: str) -> str:
        """The move as the game's registered action wrappers would pass it on."""
        for wrapper in self._action_wrappers:
            text = wrapper.action(text)
        return text

    @contextlib.contextmanager
    def _own_rng(self) -> Iterator[None]:
        """Run with this episode's random state (module docstring)."""
        numpy = sys.modules.get("numpy")
        with _GAME_LOCK, _offline_nltk():
            outer = random.getstate()
            outer_np = numpy.random.get_state() if numpy is not None else None
            if self._rng_state is not None:
                random.setstate(self._rng_state)
            if numpy is not None and self._np_state is not None:
                numpy.random.set_state(self._np_state)
            try:
                yield
            finally:
                self._rng_state = random.getstate()
                random.setstate(outer)
                if numpy is not None:
                    self._np_state = numpy.random.get_state()
                    numpy.random.set_state(outer_np)

    def tasks(self, seed: int) -> Iterator[Task]:
        for index in itertools.count():
            game_seed = random.Random(f"textarena:{self.env_id}:{seed}:{index}").getrandbits(31)
            yield Task(
                id=f"{self.env_id}-{seed}-{index}",
                seed=game_seed,
                data={"env_id": self.env_id, "seed": game_seed},
            )

    def reset(self, task: Task) -> list[Message]:
        self.close()
        seed = int(task.seed)
        self._game, self._spare = (self._spare if self._spare is not None else self._make()), None
        self._rng_state = random.Random(seed).getstate()
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            self._np_state = numpy.random.RandomState(seed % 2**32).get_state()
        self._opponent = self.make_opponent(seed) if self.make_opponent is not None else None
        self._steps, self._done = 0, False
        try:
            with self._own_rng():
                self._game.reset(num_players=self.info.players or 1, seed=seed)
                self._play_others()
                text = self._observe()
        except EnvError:
            raise
        except Exception as exc:
            raise EnvError(f"textarena/{self.env_id}: reset raised {exc!r}") from exc
        return [{"role": "user", "content": text}]

    def _play_others(self) -> None:
        """Let the opponent move until it is the policy's turn or the game is over (under _own_rng)."""
        game = self._game
        for _ in range(1000):
            if self._done or game.state.current_player_id == self.seat:
                return
            if self._opponent is None:
                raise EnvError(
                    f"textarena/{self.env_id}: player {game.state.current_player_id} has no one to play it"
                )
            _, messages = game.get_observation()
            self._opponent_log.extend(messages)
            action = self._opponent(_format(self._opponent_log, 1 - self.seat, -1))
            self._done, _ = game.step(self._act(action))
        raise EnvError(f"textarena/{self.env_id}: the opponent moved 1000 times in a row")

    def _observe(self) -> str:
        player, messages = self._game.get_observation()
        if player != self.seat and not self._done:
            raise EnvError(
                f"textarena/{self.env_id}: expected player {self.seat} to move, the game says {player}"
            )
        return _format(messages, self.seat, -1) or "(no new message)"

    def step(self, action: Action) -> StepResult:
        if self._game is None or self._done:
            raise EnvError(f"textarena/{self.env_id}: step() before reset() or after the game ended")
        self._steps += 1
        try:
            with self._own_rng():
                self._done, _ = self._game.step(self._act(action.text))
                self._play_others()
                if self._done:
                    rewards, game_info = self._game.close()
                    pending = self._game.state.observations.get(self.seat, [])
                    return self._final(rewards, game_info, _format(pending, self.seat, -1))
                text = self._observe()
        except EnvError:
            raise
        except Exception as exc:
            raise EnvError(f"textarena/{self.env_id}: step raised {exc!r}") from exc
        if self._steps >= self.spec.max_turns:
            self._done = True
            return StepResult([{"role": "user", "content": text}], truncated=True, outcome=0.0)
        return StepResult([{"role": "user", "content": text}])

    def _final(self, rewards: Any, game_info: Any, text: str) -> StepResult:
        reward: Any = rewards.get(self.seat) if isinstance(rewards, dict) else None
        if not is_finite_number(reward):
            raise EnvError(
                f"textarena/{self.env_id} ended with reward {reward!r} for player {self.seat} "
                f"(rewards {rewards!r}), not a number"
            )
        details = game_info.get(self.seat, {}) if isinstance(game_info, dict) else {}
        reason = str(details.get("reason", "")) if isinstance(details, dict) else ""
        info = (
            {"reason": reason[:500], "invalid_move": bool(details.get("invalid_move", False))}
            if details
            else {}
        )
        return StepResult(
            [{"role": "user", "content": text or reason or "game over"}],
            done=True,
            outcome=float(reward),
            info=info,
        )

    def close(self) -> None:
        self._game, self._opponent, self._opponent_log = None, None, []

    def gold_unavailable(self) -> str | None:
        return "TextArena provides no solver or reference move for its games"


# ------------------------------------------------------------------------------------------- the family
def _base_id(env_id: str) -> str:
    for suffix in _VARIANT_SUFFIXES:
        if env_id.endswith(suffix):
            return env_id[: -len(suffix)]
    return env_id


def factory_for(env_id: str) -> EnvFactory:
    """The factory of textarena/<env_id> (ValueError: unknown, unavailable offline, more than two players;
    ImportError without the library). Two-player games are checked for their opponent when made."""
    info = game_info(env_id)
    if info.unavailable is not None:
        raise ValueError(info.unavailable)
    return as_async_factory(functools.partial(TextArenaEnv, env_id))


def _note(info: GameInfo) -> str:
    if info.unavailable is not None:
        return f"unavailable: {info.unavailable.split(';')[0]}"
    return "two players: needs env.options.opponent" if info.players == 2 else ""


def members() -> list[FamilyMember]:
    registry = _library().envs.registration.ENV_REGISTRY
    ids = sorted({_base_id(env_id) for env_id in registry if _base_id(env_id) in registry})
    return [FamilyMember(env_id, _note(game_info(env_id))) for env_id in ids]


FAMILY = EnvFamily(name="textarena", factory_for=factory_for, members=members)
