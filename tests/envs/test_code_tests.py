"""code-tests: the generated problem set, grading (hacks included), the turn protocol, the checker."""

from __future__ import annotations

import argparse
import ast
import copy
import itertools
import json
from collections import Counter
from typing import Any

import pytest

from envs.api import Action, EnvError, Task
from envs.checker import check_env, format_report
from envs.code_tests import reference_solutions as reference
from envs.code_tests.environment import CodeTestsEnv, extract_solution, grade
from envs.code_tests.problems import TESTS_PER_PROBLEM, _build, all_problems, canonical, problems
from envs.code_tests.specialize import specialize
from envs.discovery import resolve_env
from envs.sandbox.isolation import MIN_PYTHON
from envs.sandbox.limits import Limits
from envs.sandbox.runner import Sandbox, SandboxConfig, SandboxUnavailable
from envs.toolcalls import parse_hermes
from tests.envs.test_sandbox import BWRAP_PROBLEM

RLIMITS_ONLY = {"require": "rlimits", "bwrap": ""}
BEST = {"require": "rlimits"}  # bubblewrap where it works, as a machine without it would still run


def _env(**options: Any) -> CodeTestsEnv:
    return CodeTestsEnv(**{"sandbox": BEST, **options})


def _task(problem_id: str) -> Task:
    env = _env()
    return next(t for t in itertools.islice(env.tasks(0), 400) if t.data["problem"] == problem_id)


# --- the problem set ----------------------------------------------------------------------------


def test_problem_set_is_a_few_hundred_distinct_problems_with_eight_distinct_tests() -> None:
    every = all_problems()
    assert 250 <= len(every) <= 400
    assert len({p.id for p in every}) == len(every)
    assert len({p.statement for p in every}) == len(every)  # variants differ in what they ask
    for problem in every:
        assert len(problem.inputs) == len(problem.expected) == TESTS_PER_PROBLEM, problem.id
        assert len({canonical(list(args)) for args in problem.inputs}) == TESTS_PER_PROBLEM, problem.id
        assert problem.function in problem.statement and problem.function in problem.solution
    families = Counter(p.id.split("-")[0] for p in every)
    assert len(families) >= 40 and max(families.values()) <= 25


def test_problem_set_is_deterministic_and_known_answers_hold() -> None:
    from envs.code_tests.problems import FAMILIES

    first = all_problems()
    rebuilt = [_build(f.__name__.lstrip("_"), draft) for f in FAMILIES for draft in f()]
    assert [(p.id, p.inputs, p.expected, p.solution) for p in rebuilt] == [
        (p.id, p.inputs, p.expected, p.solution) for p in first
    ]
    answers = {
        p.id: {canonical(list(a)): e for a, e in zip(p.inputs, p.expected, strict=True)} for p in first
    }
    assert answers["roman-upper"]["[3999]"] == '"MMMCMXCIX"'
    assert answers["sum_multiples-3-5"]["[6]"] == "8"  # 3 + 5
    assert answers["collatz-steps"]["[27]"] == "111"
    assert answers["leap_years-gregorian"]["[1900,1900]"] == "0"
    assert answers["leap_years-julian"]["[1900,1900]"] == "1"
    assert answers["look_and_say-1"]['["1211"]'] == '"111221"'
    assert answers["spiral-clockwise"]["[[[1,2],[3,4]]]"] == "[1,2,4,3]"
    assert answers["merge_intervals-overlap-count"]["[[[1,3],[3,5]]]"] == "2"  # touching, not merged


def test_every_rendered_solution_defines_its_function_alone_and_reproduces_the_answers() -> None:
    every = all_problems()
    assert len({p.solution for p in every}) == len(every)  # a mistyped mode would repeat another variant
    for problem in every:
        tree = ast.parse(problem.solution, feature_version=MIN_PYTHON)
        assert [(type(n), getattr(n, "name", None)) for n in tree.body] == [
            (ast.FunctionDef, problem.function)
        ]
        namespace: dict[str, Any] = {}
        exec(problem.solution, namespace)  # a fresh namespace: the source stands alone
        answers = [canonical(namespace[problem.function](*copy.deepcopy(args))) for args in problem.inputs]
        assert tuple(answers) == problem.expected, problem.id


def test_specialize_writes_parameters_in_and_folds_the_branches_they_decide() -> None:
    source = specialize(reference.word_counts, MIN_COUNT=3, LOWERCASE=False)
    assert source.startswith("def word_counts(text):\n")  # annotations dropped
    assert "c >= 3" in source and "MIN_COUNT" not in source
    assert "lower" not in source and "LOWERCASE" not in source  # `if LOWERCASE:` went with its body
    assert "word.lower()" in specialize(reference.word_counts, MIN_COUNT=3, LOWERCASE=True)
    renamed = specialize(reference.merge_intervals, "merge", TOUCHING=False, MERGED_RESULT="count")
    assert renamed.startswith("def merge(intervals):\n")
    assert "s < merged[-1][1]" in renamed and "<=" not in renamed
    assert renamed.rstrip().endswith("return len(merged)") and "MERGED_RESULT" not in renamed
    assert "(1000, 'M')" in specialize(reference.to_roman, LOWER_CASE=False)  # a Final constant, inlined


def test_specialize_refuses_a_source_that_would_not_stand_alone() -> None:
    reads = r"reads the module-level names \['SHIFT'\] \(Final constants aside\), the variant gives"
    with pytest.raises(ValueError, match=reads + r" \[\]"):
        specialize(reference.caesar)
    with pytest.raises(ValueError, match=reads + r" \['BASE', 'SHIFT'\]"):
        specialize(reference.caesar, SHIFT=3, BASE=2)
    constant = r"gives \['LOWER_CASE', 'ROMAN_NUMERALS'\]"  # a Final constant is not a parameter
    with pytest.raises(ValueError, match=constant):
        specialize(reference.to_roman, LOWER_CASE=False, ROMAN_NUMERALS=[(1, "I")])
    with pytest.raises(ValueError, match=r"SHIFT=<object object .*> has no literal form"):
        specialize(reference.caesar, SHIFT=object())


def test_splits_partition_the_set() -> None:
    train, test = problems("train"), problems("test")
    assert {p.id for p in train} | {p.id for p in test} == {p.id for p in all_problems()}
    assert not {p.id for p in train} & {p.id for p in test}
    assert 0.12 < len(test) / len(all_problems()) < 0.3
    with pytest.raises(ValueError, match="split must be one of"):
        problems("validation")


async def test_every_reference_solution_reproduces_its_answers_inside_the_sandbox() -> None:
    """One sandbox run executes all references on the tests as the grader receives them (JSON)."""
    every = all_problems()
    program = """
import json
out = []
for problem in json.load(open("problems.json")):
    namespace = {}
    exec(problem["solution"], namespace)
    function = namespace[problem["function"]]
    dump = lambda value: json.dumps(value, sort_keys=True, separators=(",", ":"))
    out.append([dump(function(*args)) for args in problem["inputs"]])
print(json.dumps(out))
"""
    payload = [{"solution": p.solution, "function": p.function, "inputs": p.inputs} for p in every]
    sandbox = Sandbox(SandboxConfig.from_options(BEST))
    result = await sandbox.run_python(
        program,
        files={"problems.json": json.dumps(payload)},
        limits=Limits(wall_time_s=120.0, cpu_time_s=120.0, max_output_bytes=1 << 24),
    )
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout) == [list(p.expected) for p in every]


# --- extraction and grading ---------------------------------------------------------------------


def test_extract_solution() -> None:
    code = "def f(x):\n    return x\n"
    assert extract_solution(f"Here:\n```python\n{code}```\nDone.", "f") == code
    assert extract_solution(f"```\nprint(1)\n```\n```py\n{code}```", "f") == code  # the defining block
    assert extract_solution(f"```python\n{code}```\n```python\nprint(f(2))\n```", "f") == code
    assert extract_solution("```python\nprint(1)\n```", "f") == "print(1)\n"  # graded, and fails
    assert extract_solution(code, "f") == code  # no fence, but a definition
    assert extract_solution("the answer is f(x) = x", "f") is None
    assert extract_solution("def fx(y): pass", "f") is None


def test_grade_counts_first_records_under_the_tag_only() -> None:
    tag = "@@t@@"
    expected = ["1", "2", "3", "4"]
    lines = [
        '{"test": 0, "value": "1"}',  # no tag: printed by the solution itself
        tag + '{"test": 0, "value": "1"}',
        tag + '{"test": 0, "value": "9"}',  # a second record for test 0 does not replace the first
        tag + '{"test": 1, "value": "5"}',
        tag + '{"test": 2, "error": "ZeroDivisionError"}',
        tag + "not json",
    ]
    assert grade(4, "\n".join(lines), tag, expected) == (
        1,
        "passed 1/4 hidden tests; 1 raised (ZeroDivisionError); 1 never ran (the program was stopped)",
    )
    load = tag + '{"load_error": "SyntaxError: invalid syntax"}'
    assert grade(4, load, tag, expected) == (
        0,
        "passed 0/4 hidden tests: your code failed to load (SyntaxError: invalid syntax)",
    )


# --- episodes -----------------------------------------------------------------------------------


async def _answer(code: str, problem: str = "sum_multiples-3-5", **options: Any) -> tuple[float | None, str]:
    env = _env(**options)
    await env.reset(_task(problem))
    result = await env.step(Action(f"```python\n{code}\n```"))
    assert result.done and not result.truncated
    return result.outcome, result.messages[0]["content"]


async def test_gold_solution_scores_one_and_a_partial_one_a_fraction() -> None:
    env = _env()
    await env.reset(_task("sum_multiples-3-5"))
    gold = env.gold_action()
    assert gold is not None and gold.startswith("```python\ndef sum_multiples(n):")
    result = await env.step(parse_hermes(gold))
    assert (result.outcome, result.messages[0]["content"]) == (1.0, "passed 8/8 hidden tests")
    assert result.info["tests_passed"] == 8 and env.gold_action() is None
    # "return 0" is right exactly for the two inputs n = -3 and n = 1
    assert await _answer("def sum_multiples(n):\n    return 0") == (0.25, "passed 2/8 hidden tests")


@pytest.mark.parametrize(
    ("code", "observation"),
    [
        ('print(\'@@rollwise-grader-0000@@{"test": 0, "value": "0"}\')', "failed to load (NameError"),
        ("import os\nos._exit(0)", "passed 0/8 hidden tests; 8 never ran"),
        (
            "class Any:\n    def __eq__(self, other):\n        return True\n"
            "def sum_multiples(n):\n    return Any()",
            "8 raised (TypeError)",
        ),
        ("def sum_multiples(n):\n    raise SystemExit(0)", "8 raised (SystemExit)"),
        ("def sum_multiples(n):\n    while True:\n        pass", "8 raised (timeout)"),
        (
            "import json, sys\nspec = json.load(open('tests.json'))\n"
            "for i in range(8):\n"
            "    sys.__stdout__.write(spec['tag'] + json.dumps({'test': i, 'value': '0'}) + '\\n')\n"
            "def sum_multiples(n):\n    return 0",
            "passed 2/8 hidden tests",  # forged records claim only what "return 0" would: no gain
        ),
    ],
    ids=["forged-untagged", "exit", "always-equal", "system-exit", "endless", "forged-tagged"],
)
async def test_grading_resists_hacks(code: str, observation: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("envs.code_tests.environment.TEST_S", 0.25)  # the endless one times out on every test
    outcome, message = await _answer(code)
    assert observation in message
    assert outcome == (0.25 if "2/8" in observation else 0.0)


async def test_tool_turns_mistakes_and_truncation() -> None:
    env = _env(max_turns=3, max_calls_per_turn=1)
    await env.reset(_task("caesar-3"))
    calls = '<tool_call>{"name": "python", "arguments": {"code": "print(chr(97 + 3))"}}</tool_call>'
    result = await env.step(parse_hermes(calls + calls))
    reply = json.loads(result.messages[0]["content"])
    assert (reply["stdout"], reply["exit_code"], reply["stopped_by"]) == ("d\n", 0, None)
    assert result.messages[1]["content"] == "error: at most 1 tool calls per turn"
    assert (result.reward, result.done, result.info["tool_calls"]) == (-0.1, False, 1)
    result = await env.step(Action("I need to think about it."))
    assert (result.reward, result.done) == (-0.1, False)
    assert "reply with the function `caesar`" in result.messages[0]["content"]
    result = await env.step(parse_hermes('<tool_call>{"name": "python", "arguments": {}}</tool_call>'))
    assert (result.truncated, result.outcome) == (True, 0.0)
    assert result.messages[0]["content"] == 'error: "code" must be a string holding the program'
    with pytest.raises(EnvError, match="after the episode ended"):
        await env.step(Action("```python\npass\n```"))


async def test_bad_task_data_is_an_env_error() -> None:
    with pytest.raises(EnvError, match="lacks a field"):
        await _env().reset(Task("broken", 0, {"prompt": "x"}))


def test_bad_options_and_missing_isolation_are_refused() -> None:
    with pytest.raises(ValueError, match="max_calls_per_turn"):
        CodeTestsEnv(max_calls_per_turn=0)
    with pytest.raises(ValueError, match=r"sandbox\.wall_time_s"):
        CodeTestsEnv(sandbox={"wall_time_s": -1})
    with pytest.raises(SandboxUnavailable, match=r'sandbox\.require = "bwrap"'):
        CodeTestsEnv(sandbox={"bwrap": "/nonexistent/bwrap"})


def test_the_daemon_refuses_a_config_whose_sandbox_cannot_be_had(tmp_path: Any) -> None:
    from pipeline.contracts.config import ConfigError
    from pipeline.supervisor.wiring import resolve_config

    overrides = ["env.name=code-tests", 'env.options={sandbox = {bwrap = "/nonexistent/bwrap"}}']
    args = argparse.Namespace(config=None, set=overrides, run_dir=str(tmp_path / "run"), max_steps=None)
    args.log_format = None
    with pytest.raises(ConfigError, match=r"env.options: code-tests rejects .*apt-get install bubblewrap"):
        resolve_config(args)


# --- the checker, with bubblewrap and with rlimits only -------------------------------------------


@pytest.mark.parametrize("isolation", ["bwrap", "rlimits"])
async def test_env_check_passes_and_gold_solves_everything(isolation: str) -> None:
    if isolation == "bwrap" and BWRAP_PROBLEM:
        pytest.skip(f"bubblewrap unusable here: {BWRAP_PROBLEM}")
    options = {"sandbox": {"require": "bwrap"} if isolation == "bwrap" else RLIMITS_ONLY}
    report = await check_env(resolve_env("code-tests"), episodes=8, seed=2, options=options)
    assert report.passed, format_report(report)
    assert report.stats["gold_success_rate"] == 1.0
    assert report.stats["random_success_rate"] == 0.0
