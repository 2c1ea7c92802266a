"""The reasoning-gym and TextArena adapters with the real libraries, offline: every test here runs with
socket connections refused, so a library that tried to reach the network would fail it."""

from __future__ import annotations

import importlib.metadata
import json
import random
import socket
from pathlib import Path
from typing import Any

import pytest

from envs import discovery
from envs.api import Action, EnvError, Task
from envs.checker import check_env
from envs.discovery import EnvDiscoveryError, list_envs, main_list, resolve_env
from envs.reasoning_gym_tasks import ReasoningGymEnv
from envs.sync_adapter import AsyncAdapter
from envs.textarena_games import TextArenaEnv, game_info, listed_moves


@pytest.fixture(autouse=True)
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: socket.socket, address: Any) -> None:
        raise OSError(f"test forbids network access (connect to {address!r})")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)


def sync_env(factory_name: str, **options: Any) -> Any:
    env = resolve_env(factory_name)(**options)
    assert isinstance(env, AsyncAdapter)
    return env.sync_env


# ------------------------------------------------------------------------------------------ reasoning-gym
@pytest.mark.parametrize("dataset", ["basic_arithmetic", "chain_sum", "leg_counting"])
async def test_reasoning_gym_datasets_pass_the_checker_with_their_own_answers_as_gold(dataset: str) -> None:
    report = await check_env(resolve_env(f"reasoning-gym/{dataset}"), episodes=8, name=dataset)
    assert report.passed, report.failures()
    assert report.stats["gold_mean_outcome"] == 1.0 and report.stats["random_mean_outcome"] < 0.5


def test_reasoning_gym_items_are_the_libraries_and_scored_by_its_score_answer() -> None:
    import reasoning_gym

    env = sync_env("reasoning-gym/basic_arithmetic", config={"max_terms": 2, "max_digits": 1}, size=5)
    task = next(env.tasks(7))
    expected = reasoning_gym.create_dataset(
        "basic_arithmetic", size=5, seed=task.data["dataset_seed"], max_terms=2, max_digits=1
    )[task.data["index"]]
    [system, user] = env.reset(task)
    assert system["content"] == reasoning_gym.utils.SYSTEM_PROMPTS["default"]
    assert user == {"role": "user", "content": expected["question"]}
    right = env.step(Action(f"Let me think. <answer>{expected['answer']}</answer>"))
    assert (right.done, right.outcome, right.info["score"]) == (True, 1.0, 1.0)


def test_reasoning_gym_retries_give_feedback_and_score_the_last_try() -> None:
    env = sync_env("reasoning-gym/basic_arithmetic", attempts=3, config={"max_terms": 2})
    env.reset(next(env.tasks(0)))
    answer = env.gold_action()
    no_tag = env.step(Action("42"))
    assert not no_tag.done and "<answer>" in no_tag.messages[0]["content"] and no_tag.reward == 0.0
    wrong = env.step(Action("<answer>not a number</answer>"))
    assert not wrong.done and wrong.messages[0]["content"] == "Your answer is not correct. Try again."
    last = env.step(Action(answer))
    assert (last.done, last.outcome, last.info["attempt"]) == (True, 1.0, 3)
    assert env.spec.max_turns == 3


def test_reasoning_gym_text_format_and_task_stream() -> None:
    env = sync_env("reasoning-gym/leg_counting", answer_format="text", system_prompt=None, size=2)
    stream = [t for _, t in zip(range(5), env.tasks(3), strict=False)]
    again = [
        t for _, t in zip(range(5), sync_env("reasoning-gym/leg_counting", size=2).tasks(3), strict=False)
    ]
    assert [t.id for t in stream] == [t.id for t in again]
    assert [t.data["index"] for t in stream] == [0, 1, 0, 1, 0]
    assert len({t.data["dataset_seed"] for t in stream}) == 3  # every pass draws new items
    messages = env.reset(stream[0])
    assert [m["role"] for m in messages] == ["user"]
    assert env.step(Action(f"  {env.gold_action()}\n")).outcome == 1.0


def test_reasoning_gym_number_format_scores_the_last_number_of_the_reply() -> None:
    config = {"min_terms": 2, "max_terms": 2, "max_digits": 1, "allow_negation": False}
    env = sync_env("reasoning-gym/basic_arithmetic", answer_format="number", attempts=2, config=config)
    env.reset(next(env.tasks(5)))
    answer = env.gold_action()
    assert answer is not None and "<answer>" not in answer
    prose = env.step(Action("Let me see."))
    assert not prose.done and prose.messages[0]["content"] == "No number found. Reply with the number."
    worked = env.step(Action(f"1 + 2 + 3 = 6 is not it; the result is {answer}."))
    assert (worked.done, worked.outcome, worked.info["answer_found"]) == (True, 1.0, True)
    assert env.extract("-3.5 then 12") == "12" and env.extract("x = -4") == "-4"


def test_reasoning_gym_refusals_name_the_problem() -> None:
    with pytest.raises(EnvDiscoveryError, match="no dataset 'nope'"):
        resolve_env("reasoning-gym/nope")
    with pytest.raises(ValueError, match="max_terms must be >= min_terms"):
        ReasoningGymEnv("basic_arithmetic", config={"max_terms": 0})
    with pytest.raises(ValueError, match="not accepted"):
        ReasoningGymEnv("basic_arithmetic", config={"no_such_option": 1})
    with pytest.raises(EnvDiscoveryError, match="family of environments"):
        resolve_env("reasoning-gym")


async def test_reasoning_gym_gold_phase_is_skipped_with_the_reason_when_the_dataset_has_no_answer() -> None:
    report = await check_env(resolve_env("reasoning-gym/graph_color"), episodes=4)
    gold = next(c for c in report.criteria if c.name == "gold_policy_scores")
    assert report.passed and "stores no answer" in gold.detail and "skipped" in gold.detail


# ------------------------------------------------------------------------------------------ TextArena
@pytest.mark.parametrize("game", ["GuessTheNumber-v0", "FrozenLake-v0", "TowerOfHanoi-v0"])
async def test_textarena_games_pass_the_checker(game: str) -> None:
    report = await check_env(resolve_env(f"textarena/{game}"), episodes=8, name=game)
    assert report.passed, report.failures()
    gold = next(c for c in report.criteria if c.name == "gold_policy_scores")
    assert "no solver" in gold.detail


def test_textarena_guess_the_number_plays_to_the_games_own_end_and_reward() -> None:
    env = sync_env("textarena/GuessTheNumber-v0", kwargs={"min_number": 1, "max_number": 8, "max_turns": 4})
    task = next(env.tasks(0))
    [first] = env.reset(task)
    assert "between 1 and 8" in first["content"] and "[5]" in first["content"]
    secret = env._game.game_number
    low, high, result = 1, 8, None
    for _ in range(4):  # bisection on the game's own hints
        guess = (low + high) // 2
        result = env.step(Action(f"I guess [{guess}]"))
        if result.done:
            break
        hint = result.messages[0]["content"]
        assert hint in ("The target number is higher.", "The target number is lower.")
        low, high = (guess + 1, high) if "higher" in hint else (low, guess - 1)
    assert result is not None and result.done and result.outcome == 1.0 and guess == secret
    assert env.spec.max_turns == 8  # twice the game's limit: an invalid move does not count as a game turn


def test_textarena_registered_action_formatting_applies_unless_turned_off() -> None:
    env = sync_env("textarena/GuessTheNumber-v0", kwargs={"max_number": 4})
    env.reset(next(env.tasks(0)))
    wrapped = env.step(Action("2"))  # ActionFormattingWrapper: "2" -> "[2]", a valid guess
    assert wrapped.done or "The target number is" in wrapped.messages[0]["content"]
    raw = sync_env("textarena/GuessTheNumber-v0", kwargs={"max_number": 4}, action_formatting=False)
    raw.reset(next(raw.tasks(0)))
    assert "invalid move" in raw.step(Action("2")).messages[0]["content"]


def test_textarena_invalid_moves_are_the_games_business() -> None:
    env = sync_env("textarena/GuessTheNumber-v0")
    env.reset(next(env.tasks(1)))
    first = env.step(Action("[no number]"))
    assert not first.done and "invalid move" in first.messages[0]["content"]
    second = env.step(Action("[still none]"))
    assert second.done and second.outcome == 0.0 and second.info["invalid_move"] is True


def test_textarena_reset_is_a_function_of_the_task_and_leaves_the_global_rng_alone() -> None:
    make = lambda: sync_env("textarena/FrozenLake-v0-random")  # noqa: E731
    a, b, c = make(), make(), make()
    tasks = [t for _, t in zip(range(2), a.tasks(5), strict=False)]
    random.seed(1234)
    state = random.getstate()
    first = a.reset(tasks[0])
    b.reset(tasks[1])  # another episode in between must not shift a's stream
    a.step(Action("[down]"))
    assert random.getstate() == state
    assert c.reset(tasks[0]) == first
    assert c.step(Action("[down]")).messages == make_then_step(tasks[0], "[down]")


def make_then_step(task: Task, move: str) -> list[Any]:
    env = sync_env("textarena/FrozenLake-v0-random")
    env.reset(task)
    return list(env.step(Action(move)).messages)


async def test_textarena_two_player_games_take_a_fixed_opponent_or_are_refused() -> None:
    with pytest.raises(ValueError, match=r"two-player game: set env\.options\.opponent"):
        resolve_env("textarena/TicTacToe-v0")()
    report = await check_env(
        resolve_env("textarena/TicTacToe-v0"), episodes=6, options={"opponent": "random-listed"}
    )
    assert report.passed, report.failures()
    env = sync_env("textarena/TicTacToe-v0", opponent="first-listed")
    env.reset(next(env.tasks(0)))
    reply = env.step(Action("[4]"))  # the opponent answers with the first free cell, 0
    assert "[Player 1] [0]" in reply.messages[0]["content"]
    assert listed_moves(reply.messages[0]["content"]) == ["[1]", "[2]", "[3]", "[5]", "[6]", "[7]", "[8]"]
    with pytest.raises(EnvDiscoveryError, match="more than two players"):
        resolve_env("textarena/SecretMafia-v0")


def test_textarena_games_that_download_word_lists_are_refused_offline_with_the_reason() -> None:
    with pytest.raises(EnvDiscoveryError, match=r"nltk data \['averaged_perceptron_tagger_eng', 'words'\]"):
        resolve_env("textarena/Wordle-v0")
    with pytest.raises(EnvDiscoveryError, match=r"nltk data \['words'\].*nltk.downloader words"):
        resolve_env("textarena/Hangman-v0")
    with pytest.raises(EnvDiscoveryError, match="needs the network"):
        resolve_env("textarena/TwentyQuestions-v0")


def test_hangman_runs_offline_once_its_corpus_is_installed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import nltk

    words = tmp_path / "corpora" / "words"
    words.mkdir(parents=True)
    (words / "en").write_text("apple\nhouse\nwater\n")
    (words / "en-basic").write_text("apple\nhouse\nwater\n")
    monkeypatch.setattr(nltk.data, "path", [str(tmp_path), *nltk.data.path])
    game_info.cache_clear()
    try:
        env = sync_env("textarena/Hangman-v0")  # its module calls nltk.download('words') on import
        env.reset(next(env.tasks(0)))
        word = env._game.state.game_state["target_word"]
        result = env.step(Action(f"[{word}]"))
        assert result.done and result.outcome == 1.0
    finally:
        game_info.cache_clear()


def test_textarena_non_numeric_reward_is_an_env_error() -> None:
    env = sync_env("textarena/Countdown-v0")
    env.reset(next(env.tasks(0)))
    env.step(Action("garbage"))
    with pytest.raises(EnvError, match="not a number"):
        env.step(Action("garbage again"))


def test_textarena_bad_kwargs_and_unknown_games_fail_at_configuration() -> None:
    with pytest.raises(ValueError, match="rejects kwargs"):
        TextArenaEnv("GuessTheNumber-v0", kwargs={"colour": "red"})
    with pytest.raises(EnvDiscoveryError, match="no game 'GuessTheNumbr-v0'"):
        resolve_env("textarena/GuessTheNumbr-v0")


# ------------------------------------------------------------------------------------------ discovery
def test_families_are_listed_and_their_members_on_request(capsys: pytest.CaptureFixture[str]) -> None:
    names = {info.name: info for info in list_envs()}
    assert names["textarena/<member>"].note == "" and names["reasoning-gym/<member>"].note == ""
    assert main_list(["textarena", "--json"]) == 0
    members = {row["name"]: row["note"] for row in json.loads(capsys.readouterr().out)}
    assert members["textarena/GuessTheNumber-v0"] == ""
    assert members["textarena/TicTacToe-v0"] == "two players: needs env.options.opponent"
    assert members["textarena/Wordle-v0"].startswith("unavailable: needs the nltk data")
    assert "textarena/GuessTheNumber-v0-raw" not in members
    assert main_list(["reasoning-gym"]) == 0
    assert "reasoning-gym/basic_arithmetic" in capsys.readouterr().out.split()


def test_a_family_whose_library_is_missing_is_listed_with_the_install_hint(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = importlib.metadata.distribution

    def without_textarena(name: str) -> Any:
        if name.lower() == "textarena":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(discovery.importlib.metadata, "distribution", without_textarena)
    names = {info.name: info.note for info in list_envs()}
    assert names["textarena/<member>"] == "not installed: pip install 'rollwise[textarena]'"
    assert names["reasoning-gym/<member>"] == ""
    assert main_list([]) == 0
    assert "(not installed: pip install 'rollwise[textarena]')" in capsys.readouterr().out
