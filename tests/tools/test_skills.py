"""The skills for coding agents (skills/<name>/SKILL.md): the peers' format, and no rollwise command named
in prose that the skill's blocks do not run. tests/e2e/test_skills_e2e.py runs the blocks (real daemons:
with the other e2e files, so that the suite schedules them early)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SKILLS = REPO / "skills"
NAMES = sorted(p.parent.name for p in SKILLS.glob("*/SKILL.md"))
NAME = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.S | re.M)


def frontmatter(text: str) -> dict[str, str]:
    """The `key: value` lines between the leading `---` lines (the Agent Skills format)."""
    match = re.match(r"^---\n(.*?)\n---\n", text, re.S)
    if match is None:
        raise ValueError("no frontmatter: the file must start with a '---' block")
    fields: dict[str, str] = {}
    for line in match.group(1).splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            raise ValueError(f"frontmatter line {line!r} is not 'key: value'")
        fields[key.strip()] = value.strip()
    return fields


def bash_blocks(text: str) -> list[str]:
    return [body for lang, body in FENCE.findall(text) if lang == "bash"]


def test_the_skills_the_issue_asks_for_are_there() -> None:
    assert NAMES == [
        "add-an-environment",
        "bring-an-agent-program",
        "debug-a-weight-sync",
        "operate-a-run",
        "scale-out",
    ]


@pytest.mark.parametrize("name", NAMES)
def test_a_skill_has_a_name_a_description_and_commands(name: str) -> None:
    text = (SKILLS / name / "SKILL.md").read_text()
    fields = frontmatter(text)
    assert set(fields) == {"name", "description"}, fields
    assert fields["name"] == name and NAME.match(name) and len(name) <= 64
    description = fields["description"]
    assert 40 <= len(description) <= 1024 and "Use when" in description, description
    assert bash_blocks(text), "a skill names the commands to run"
    assert text.count("```") % 2 == 0, "an unclosed code fence"


def named_commands(text: str) -> set[str]:
    """The rollwise commands a skill's prose names in `code` spans: "rollwise" and its subcommand words
    (`rollwise engines --run-dir` -> "rollwise engines", `rollwise env check` -> "rollwise env check")."""
    outside = FENCE.sub("", text)
    named = set()
    for span in re.findall(r"`(rollwise [^`]*)`", outside):
        words = []
        for word in span.split()[:3]:
            if not re.fullmatch(r"[a-z]+", word):
                break
            words.append(word)
        named.add(" ".join(words))
    return named


@pytest.mark.parametrize("name", NAMES)
def test_every_rollwise_command_a_skill_names_is_among_the_commands_it_runs(name: str) -> None:
    text = (SKILLS / name / "SKILL.md").read_text()
    run = "\n".join(bash_blocks(text))
    assert {command for command in named_commands(text) if command not in run} == set()


def test_the_frontmatter_reader_refuses_what_the_format_does_not_allow() -> None:
    with pytest.raises(ValueError, match="no frontmatter"):
        frontmatter("# a title\n")
    with pytest.raises(ValueError, match="not 'key: value'"):
        frontmatter("---\nname operate\n---\n")
    text = "---\nname: x\ndescription: d\n---\n```bash\necho 1\n```\n```toml\na = 1\n```\n"
    assert frontmatter(text) == {"name": "x", "description": "d"}
    assert bash_blocks(text) == ["echo 1\n"]
    prose = "Use `rollwise engines --run-dir D list`, `rollwise env check X`.\n```bash\nrollwise run\n```\n"
    assert named_commands(prose) == {"rollwise engines", "rollwise env check"}
