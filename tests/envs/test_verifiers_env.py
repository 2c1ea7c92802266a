"""verifiers/<taskset> (envs/ecosystems/verifiers_env.py): verifiers 0.4's own rollout loop, run by its
venv's interpreter in rollwise's sandbox, against an episode's endpoint.

The tasksets are tests/envs/verifiers_fixtures/*.py, in-memory data written with verifiers' v1 API: a
single-turn exact answer (one task of which has broken scoring), a tool call served by a verifiers
Toolset (MCP, in a subprocess), and a multi-turn Env that plays the user. verifiers, its null harness
program (prepared by uv from the venv's wheel index), the tool server and the sandbox are real; the
model is the SGLang fake behind rollwise's real endpoint, scripted per prompt and decoded by the tiny
tokenizer, so every reward and every recorded turn is exact.

verifiers takes seconds to import, and every episode and every listing imports it in a process of its
own, so the module plays all its episodes at once (`played`) and the tests read what happened.
Skipped, naming `make env-verifiers`, where the verifiers venv is absent or the sandbox's user cannot
run it.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import shutil
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from envs.agent import AgentResult
from envs.api import Task
from envs.discovery import load_family, resolve_env
from envs.ecosystems.ecosystem_venvs import EcosystemMissing, venv_python
from envs.ecosystems.verifiers_env import FAMILY, VerifiersEnvironment, members, sandbox_user_problem
from pipeline.supervisor.actors.agent_api.openai_endpoint import OpenAIEndpoint
from pipeline.supervisor.actors.outcomes import EpisodeOutcome
from pipeline.supervisor.actors.rollout import RolloutSettings
from pipeline.supervisor.engines.client import EngineClient
from pipeline.supervisor.engines.pool import EnginePool
from pipeline.supervisor.engines.protocol import SamplingParams
from pipeline.supervisor.observability.metrics import REGISTRY
from pipeline.tools.fake_sglang import FakeSGLang, GenerateCall, Plan
from tests.envs.test_sandbox import BWRAP_PROBLEM

FIXTURES = Path(__file__).with_name("verifiers_fixtures")


@functools.cache
def readable_fixtures() -> Path:
    """The fixture tasksets copied where the sandbox's unprivileged user can read them: the checkout may
    sit in a private directory (a fresh clone in `mktemp -d` does, and root's home is one)."""
    target = Path(tempfile.mkdtemp(prefix="rollwise-verifiers-fixtures-"))
    shutil.copytree(FIXTURES, target, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    for path in [target, *target.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    atexit.register(shutil.rmtree, target, True)
    return target


ENV_NAME = "verifiers-test"
CALL = '<tool_call>{"name": "calc_toolset_add", "arguments": {"a": 19, "b": 23}}</tool_call>'
# What the scripted model answers, chosen by the text that comes last in its prompt.
REPLIES = {
    "What is 2 + 3?": "5",
    "What is 1 / 0?": "0",
    "Use the tool: 19 + 23?": CALL,
    "<tool_response>\n42\n</tool_response>": "42",
    "Guess my number (1-9).": "3",
    "No, not 3. Again.": "7",
}


def verifiers_problem() -> str:
    """Why verifiers episodes cannot run here ("" when they can): no bubblewrap, no verifiers venv, or a
    venv the sandbox's user cannot read."""
    if BWRAP_PROBLEM:
        return f"bubblewrap unusable here: {BWRAP_PROBLEM}"
    try:
        python = venv_python("verifiers")
    except EcosystemMissing as exc:
        return str(exc)
    return sandbox_user_problem(python) or ""


def script(tok: Any, call: GenerateCall) -> Plan:
    prompt = tok.decode(call.input_ids)
    last = max(REPLIES, key=prompt.rfind)
    return plan(tok, REPLIES[last])


def plan(tok: Any, text: str) -> Plan:
    ids = [*tok.encode(text, add_special_tokens=False), tok.eos_token_id]
    return Plan(ids, [-0.1 - 0.01 * i for i in range(len(ids))])


def make(name: str, probe_port: int = 0) -> VerifiersEnvironment:
    taskset = str(readable_fixtures() / f"{name}_taskset.py")
    env = {"PROBE_PORT": str(probe_port)} if probe_port else {}
    return VerifiersEnvironment(name, taskset=taskset, harness="null", env=env, episode_timeout_s=150.0)


def task_of(env: VerifiersEnvironment, index: int) -> Task:
    _, key, name = env.listing.tasks[index]
    return Task(id=f"{name}#0", seed=0, data={"index": index, "key": key})


def failures(reason: str) -> float:
    labels = {"env": ENV_NAME, "reason": reason}
    return REGISTRY.get_sample_value("rollwise_agent_failures_total", labels) or 0.0


@dataclass
class Played:
    """Every episode of the module: outcome and what the runner returned, by task name."""

    envs: dict[str, VerifiersEnvironment]
    outcomes: dict[str, EpisodeOutcome]
    results: dict[str, AgentResult]
    prompts: list[str]
    exit_failures: float


@pytest.fixture(scope="module")
def skip_reason() -> str:
    return verifiers_problem()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def played(tok: Any, skip_reason: str) -> AsyncIterator[Played]:
    if skip_reason:
        pytest.skip(skip_reason)
    fake = FakeSGLang(tokenizer=tok, script=lambda call: script(tok, call))
    await fake.start()
    pool = EnginePool([EngineClient(fake.base_url, retries=0)])
    settings = RolloutSettings(sampling=SamplingParams(max_new_tokens=64), max_context_tokens=4096)
    endpoint = OpenAIEndpoint(engine=pool, tokenizer=tok, settings=settings)
    await endpoint.start()
    try:
        names = ("arith", "calc", "guess")
        made = await asyncio.gather(*(asyncio.to_thread(make, name) for name in names))
        envs = dict(zip(names, made, strict=True))
        results: dict[str, AgentResult] = {}

        def spy(env: VerifiersEnvironment, label: str) -> None:
            original = env.play

            async def play(episode: Any, task: Task) -> object:
                value = await original(episode, task)
                assert isinstance(value, AgentResult)
                results[label] = value
                return value

            env.play = play  # type: ignore[method-assign]

        runs = {"arith-0": ("arith", 0), "arith-3": ("arith", 3)}
        runs |= {"calc": ("calc", 0), "guess": ("guess", 0)}
        before = failures("exit")
        episodes = []
        for label, (name, index) in runs.items():
            env = make(name, endpoint.port)  # one per episode, as the runner makes them (listed above)
            spy(env, label)
            task = task_of(env, index)
            episodes.append(
                endpoint.run_agent_episode(env, task, episode_id=label, group_id="g", env_name=ENV_NAME)
            )
        outcomes = dict(zip(runs, await asyncio.gather(*episodes), strict=True))
        prompts = [tok.decode(request["input_ids"]) for request in fake.generate_requests()]
        yield Played(envs, outcomes, results, prompts, failures("exit") - before)
    finally:
        await endpoint.close()
        await pool.close()
        await fake.stop()


def generated(outcome: EpisodeOutcome, turn: int = 0) -> tuple[list[int], list[float]]:
    row = outcome.rows[0]
    picked = [k for k, t in enumerate(row.turn_index) if t == turn and row.loss_mask[k]]
    return [row.token_ids[k] for k in picked], [row.logprobs[k] for k in picked]


@pytest.mark.integration
@pytest.mark.slow
def test_a_taskset_is_listed_once_and_streamed_per_seed(played: Played) -> None:
    env = played.envs["arith"]
    assert [(index, name) for index, _, name in env.listing.tasks] == [
        (0, "arith-0"),
        (1, "arith-1"),
        (2, "arith-2"),
        (3, "arith-3"),
    ]
    assert (env.listing.taskset, env.listing.env, env.listing.harnesses) == (
        "arith_taskset",
        "SingleAgentEnv",
        {"agent": "null"},
    )
    assert env.spec.name == "verifiers/arith" and env.spec.version == "0.4.0"
    stream, again = env.tasks(5), env.tasks(5)
    first = [next(stream) for _ in range(8)]
    assert first == [next(again) for _ in range(8)]  # same seed, same stream
    assert (
        sorted(t.data["index"] for t in first[:4])
        == [0, 1, 2, 3]
        == sorted(t.data["index"] for t in first[4:])
    )
    assert all(t.id.endswith("#0") for t in first[:4]) and all(t.id.endswith("#1") for t in first[4:])
    assert played.envs["guess"].listing.env == "GuessEnv"
    assert played.envs["guess"].listing.harnesses == {"player": "null"}


@pytest.mark.integration
@pytest.mark.slow
def test_a_single_turn_taskset_is_scored_by_verifiers_and_recorded_token_exact(
    played: Played, tok: Any
) -> None:
    right = played.outcomes["arith-0"]
    assert (right.finish_reason, right.outcome, right.num_turns) == ("stop", 1.0, 1), right.error
    expected = plan(tok, "5")
    assert generated(right) == (expected.output_ids, expected.logprobs)  # token-exact, with log-probs
    info = dict(played.results["arith-0"].info)
    seconds, process_seconds = info.pop("seconds"), info.pop("process_seconds")
    assert info == {
        "reward": 1.0,
        "rewards": {"exact": 1.0},
        # The scoring code ran in the sandbox: the endpoint's own TCP port is out of its reach.
        "metrics": {"reply_chars": 1.0, "probe_port_reachable": 0.0},
        "stop": "agent_completed",
        "turns": 1,
    }
    assert set(seconds) == {"boot", "setup", "agent", "finalize", "scoring"}
    assert set(process_seconds) == {"load", "episode"}


@pytest.mark.integration
@pytest.mark.slow
def test_a_tool_taskset_runs_its_toolset_and_each_model_call_is_a_turn(played: Played, tok: Any) -> None:
    calc = played.outcomes["calc"]
    assert (calc.finish_reason, calc.outcome, calc.num_turns) == ("stop", 1.0, 2), calc.error
    info = played.results["calc"].info
    assert (info["rewards"], info["metrics"], info["turns"]) == ({"correct": 1.0}, {"tool_results": 1.0}, 2)
    first, second = (p for p in played.prompts if "Use the tool: 19 + 23?" in p)
    assert '"name": "calc_toolset_add"' in first  # the toolset's MCP tool, offered as a function
    assert "<tool_response>\n42\n</tool_response>" in second  # the harness ran the call on the server
    assert generated(calc, 1)[0] == plan(tok, "42").output_ids


@pytest.mark.integration
@pytest.mark.slow
def test_a_multi_turn_env_plays_the_user_between_turns(played: Played) -> None:
    guess = played.outcomes["guess"]
    assert (guess.finish_reason, guess.outcome, guess.num_turns) == ("stop", 0.75, 2), guess.error
    assert played.results["guess"].info["rewards"] == {"hit": 0.75}
    assert played.results["guess"].info["metrics"] == {"misses": 1.0}
    assert any(
        p.rstrip().endswith("No, not 3. Again.<|im_end|>\n<|im_start|>assistant") for p in played.prompts
    )


@pytest.mark.integration
@pytest.mark.slow
def test_a_failing_taskset_costs_only_its_episode_with_verifiers_error(played: Played) -> None:
    broken = played.outcomes["arith-3"]
    assert (broken.finish_reason, broken.outcome) == ("env_error", None)
    assert "verifiers recorded the episode as failed" in (broken.error or "")
    assert "this task stores no answer to compare with" in (broken.error or "")
    assert "arith-3" not in played.results and played.exit_failures == 1.0
    assert played.outcomes["arith-0"].outcome == 1.0  # its group's other episodes are unaffected


@pytest.mark.integration
@pytest.mark.slow
def test_a_taskset_that_does_not_load_is_refused_naming_it(skip_reason: str, tmp_path: Path) -> None:
    if skip_reason:
        pytest.skip(skip_reason)
    # The key (the member), the package verifiers tried, and verifiers' own error.
    with pytest.raises(ValueError) as refused:
        VerifiersEnvironment("no-such-taskset")
    assert str(refused.value).startswith(
        "verifiers/no-such-taskset: verifiers cannot load taskset 'no-such-taskset': ModuleNotFoundError: "
        "taskset 'no-such-taskset' not found (tried to import 'no_such_taskset')"
    )
    with pytest.raises(ValueError, match=r"taskset: '.*/missing\.py' is not a file"):
        VerifiersEnvironment("x", taskset=str(tmp_path / "missing.py"))
    with pytest.raises(ValueError, match="max_tasks"):
        VerifiersEnvironment("x", max_tasks=0)
    with pytest.raises(ValueError, match="harness must be a harness id or a table with an"):
        VerifiersEnvironment("x", harness={"edit": False})


def test_a_missing_venv_names_the_make_target(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ROLLWISE_ECOSYSTEM_VENVS", str(tmp_path))
    factory = resolve_env("verifiers/gsm8k")
    with pytest.raises(EcosystemMissing, match=r"verifiers's virtualenv is missing .* `make env-verifiers`"):
        factory()
    with pytest.raises(EcosystemMissing, match="make env-verifiers"):
        members()
    with pytest.raises(EcosystemMissing, match=r"env\.options\.python = '/nonexistent/python'"):
        factory(python="/nonexistent/python")


def test_the_family_lists_the_tasksets_verifiers_ships(skip_reason: str) -> None:
    assert load_family("verifiers") is FAMILY
    if skip_reason:
        pytest.skip(skip_reason)
    shipped = {member.name: member.note for member in members()}
    assert {"harbor", "nemo_gym", "openenv", "textarena"} <= set(shipped)
    assert "verifiers[ta]" in shipped["textarena"]
