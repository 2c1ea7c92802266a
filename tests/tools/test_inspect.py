"""`rollwise inspect`: its data over a run directory, its HTTP API, and the page in a real headless Chromium
(Debian's chromium + chromium-driver through selenium)."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from learner.trace import TracedRow, trace_batch, write_trace
from pipeline.contracts.config import load_config, write_resolved
from pipeline.contracts.schema import EpisodeSegment, segments_to_batch
from pipeline.tools.inspect.trajectories import GroupFilter, RunView, parse_filter
from pipeline.tools.inspect.web import start
from pipeline.transport.spool import SpoolWriter

XSS_REPLY = '<script>window.pwned = 1</script><img src=x onerror="window.pwned = 2">'
XSS_ACTION = "<b>bold</b>"


class Episodes:
    """Valid Contract-1 rows built from text with the tiny tokenizer: prompt, then (model, reply) turns."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok

    def enc(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def row(
        self,
        group: str,
        index: int,
        turns: list[tuple[str, str | None]],
        *,
        env: str = "guess-number",
        outcome: float | None = 1.0,
        finish: str = "stop",
        version: int = 3,
        logprob: float = -0.5,
    ) -> EpisodeSegment:
        ids = self.enc("<|im_start|>user\nGuess my number.<|im_end|>\n<|im_start|>assistant\n")
        prompt = len(ids)
        mask, lps, turn_index, versions = [0] * prompt, [0.0] * prompt, [-1] * prompt, [-1] * prompt
        for k, (action, reply) in enumerate(turns):
            gen = [*self.enc(action), self.tok.eos_token_id]
            ids += gen
            mask += [1] * len(gen)
            lps += [logprob] * len(gen)
            turn_index += [k] * len(gen)
            versions += [version] * len(gen)
            if reply is not None:
                env_ids = self.enc(f"\n<|im_start|>user\n{reply}<|im_end|>\n<|im_start|>assistant\n")
                ids += env_ids
                mask += [0] * len(env_ids)
                lps += [0.0] * len(env_ids)
                turn_index += [k] * len(env_ids)
                versions += [-1] * len(env_ids)
        return EpisodeSegment(
            episode_id=f"{group}-{index}", group_id=group, task_id=f"task-{group}", env=env, token_ids=ids,
            prompt_len=prompt, loss_mask=mask, logprobs=lps, turn_index=turn_index, versions=versions,
            turn_rewards=[0.25] * len(turns), outcome=outcome, num_turns=len(turns), finish_reason=finish,
        )  # fmt: skip


TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path, tok: Any) -> Path:
    """A run directory with four spool groups (one of them full of markup), a trace of the first, a step
    log that trained it and one quarantined file."""
    root = tmp_path_factory.mktemp("inspect-run")
    write_resolved(load_config(None, [f"run.run_dir={json.dumps(str(root))}"]), root)
    shutil.copytree(tiny_tokenizer_dir, root / "model")
    eps = Episodes(tok)
    solved = [eps.row("gA", 0, [("8", "higher"), ("12", None)], logprob=-0.05),
              eps.row("gA", 1, [("8", "higher"), ("12", None)], logprob=-3.0)]  # fmt: skip
    failed = [eps.row("gB", i, [("2+2", None)], env="calculator", outcome=0.0, finish="truncated", version=1)
              for i in range(2)]  # fmt: skip
    xss = [eps.row("gX", 0, [(XSS_ACTION, XSS_REPLY), ("4", None)], outcome=0.0, version=5),
           eps.row("gX", 1, [("4", None)], outcome=1.0, version=5)]  # fmt: skip
    late = [eps.row("gL", i, [("9", None)], version=6) for i in range(2)]
    late[0].trace_id = TRACE_ID  # its episode was traced ([tracing]); the other one was not sampled
    spool = SpoolWriter(root / "spool")
    for group in (solved, failed, xss, late):
        spool.write_group(segments_to_batch(group), group_id=group[0].group_id)
    traced = []
    for row, adv in zip(solved, (1.5, -1.5), strict=True):
        n = len(row.token_ids)
        gen = [bool(m) for m in row.loss_mask]
        traced.append(
            TracedRow(
                row,
                learner_logprobs=[lp - 0.25 if g else 0.0 for lp, g in zip(row.logprobs, gen, strict=True)],
                advantages=[adv if g else 0.0 for g in gen],
                is_weights=[1.0] * n,
                clip=[(1 if adv > 0 else 0) if g else -1 for g in gen],
            )
        )
    write_trace(root / "trace", trace_batch(traced, step=1, learner_version=3), step=1, keep=10)
    (root / "logs").mkdir()
    step = {"event": "step", "step": 1, "version": 4, "groups": 1, "group_ids": ["gA"]}
    (root / "logs" / "steps.jsonl").write_text(json.dumps(step) + "\n")
    quarantine = root / "spool" / "quarantine"
    quarantine.mkdir()
    (quarantine / "g000000000099.arrow").write_bytes(b"not arrow")
    (quarantine / "g000000000099.arrow.reason").write_text("unreadable: not a complete Arrow IPC stream\n")
    return root


@pytest.fixture(scope="module")
def view(run_dir: Path, tok: Any) -> RunView:
    return RunView(run_dir, tok)


# --- the data -----------------------------------------------------------------------------------------------
def test_groups_are_listed_newest_first_with_outcome_versions_and_staleness(view: RunView) -> None:
    listing = view.list_groups(GroupFilter())
    summaries = {g["group_id"]: g for g in listing["groups"]}
    assert [g["group_id"] for g in listing["groups"]] == ["gL", "gX", "gB", "gA"]
    assert listing["choices"]["env"] == ["calculator", "guess-number"]
    a, b, x = summaries["gA"], summaries["gB"], summaries["gX"]
    assert (a["outcome"], a["solved"], a["traced"], a["trained_step"], a["learner_version"]) == (
        "solved",
        2,
        True,
        1,
        3,
    )
    assert (a["versions"], a["staleness"]) == ([3, 3], 0)  # trained by version 3 on version-3 tokens
    assert (b["outcome"], b["finish_reasons"], b["staleness"]) == ("failed", {"truncated": 2}, 3)  # 4 - 1
    assert (x["outcome"], x["traced"], x["trained_step"]) == ("mixed", False, None)


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ({"env": "calculator"}, ["gB"]),
        ({"outcome": "mixed"}, ["gX"]),
        ({"finish_reason": "truncated"}, ["gB"]),
        ({"version_min": "5"}, ["gL", "gX"]),
        ({"version_max": "3"}, ["gB", "gA"]),
        ({"staleness_min": "1"}, ["gB"]),
        ({"staleness_max": "0"}, ["gL", "gX", "gA"]),  # pending groups newer than the log: 0
        ({"traced": "yes"}, ["gA"]),
    ],
)
def test_each_filter_keeps_the_groups_it_names(
    view: RunView, query: dict[str, str], expected: list[str]
) -> None:
    assert [g["group_id"] for g in view.list_groups(parse_filter(query))["groups"]] == expected


def test_bad_filters_name_the_parameter() -> None:
    with pytest.raises(ValueError, match="version_min must be an integer, got 'x'"):
        parse_filter({"version_min": "x"})
    with pytest.raises(ValueError, match="outcome must be one of"):
        parse_filter({"outcome": "won"})


def test_a_group_is_shown_as_chat_blocks_with_token_values_and_trace(view: RunView) -> None:
    detail = view.group_detail("gA")
    assert detail is not None
    first, second = detail["episodes"]
    assert [(b["role"], b["turn"]) for b in first["blocks"]] == [
        ("prompt", -1),
        ("model", 0),
        ("env", 0),
        ("model", 1),
    ]
    assert "".join(t["text"] for t in first["blocks"][1]["tokens"]) == "8<|im_end|>"
    token = first["blocks"][1]["tokens"][0]
    assert token["logprob"] == pytest.approx(-0.05) and token["version"] == 3
    assert token["learner_logprob"] == pytest.approx(-0.3) and token["mismatch"] == pytest.approx(-0.25)
    assert (token["advantage"], token["is_weight"], token["clip"]) == (1.5, 1.0, 1)
    assert second["blocks"][1]["tokens"][0]["advantage"] == -1.5
    assert "learner_logprob" not in first["blocks"][0]["tokens"][0]  # prompt tokens carry no values
    untraced = view.group_detail("gB")
    assert untraced is not None and "advantage" not in untraced["episodes"][0]["blocks"][1]["tokens"][0]
    assert view.group_detail("nope") is None


def test_an_episodes_trace_id_is_shown_when_it_has_one(view: RunView) -> None:
    detail = view.group_detail("gL")
    assert detail is not None
    assert [e["trace_id"] for e in detail["episodes"]] == [TRACE_ID, None]


def test_quarantined_files_are_listed_with_their_reason(view: RunView) -> None:
    assert view.quarantine() == [
        {
            "file": "g000000000099.arrow",
            "seq": 99,
            "bytes": 9,
            "reason": "unreadable: not a complete Arrow IPC stream",
        }
    ]


def test_a_traced_group_whose_spool_file_was_pruned_is_shown_from_the_trace(
    run_dir: Path, tok: Any, tmp_path: Path
) -> None:
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    (copy / "spool" / "g000000000001.arrow").unlink()  # gA's file, as retention would
    pruned = RunView(copy, tok)
    [a] = [g for g in pruned.list_groups(GroupFilter())["groups"] if g["group_id"] == "gA"]
    assert (a["source"], a["seq"], a["episodes"], a["traced"]) == ("trace", None, 2, True)


# --- the HTTP API -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(view: RunView) -> Iterator[str]:
    """The inspector on 127.0.0.1 in a thread of its own (the browser tests drive it synchronously)."""
    loop = asyncio.new_event_loop()
    started = threading.Event()
    box: dict[str, Any] = {}

    async def main() -> None:
        runner, url = await start(view, "127.0.0.1", 0)
        box["url"], box["stop"] = url, asyncio.Event()
        started.set()
        await box["stop"].wait()
        await runner.cleanup()

    thread = threading.Thread(target=lambda: loop.run_until_complete(main()), daemon=True)
    thread.start()
    assert started.wait(30)
    yield box["url"]
    loop.call_soon_threadsafe(box["stop"].set)
    thread.join(10)
    loop.close()


def _get(url: str) -> tuple[int, dict[str, str], bytes]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def test_api_serves_json_with_a_strict_content_security_policy(server: str) -> None:
    status, headers, body = _get(server + "api/groups?outcome=failed")
    assert status == 200 and [g["group_id"] for g in json.loads(body)["groups"]] == ["gB"]
    assert "script-src 'self'" in headers["Content-Security-Policy"]
    status, _, body = _get(server + "api/groups?staleness_min=-")
    assert status == 400 and json.loads(body)["error"] == "staleness_min must be an integer, got '-'"
    status, _, body = _get(server + "api/groups/missing")
    assert status == 404 and "no group 'missing'" in json.loads(body)["error"]
    status, headers, body = _get(server)
    assert status == 200 and b'<script src="/static/app.js"' in body


# --- the page in a real browser -----------------------------------------------------------------------------
def _chromium() -> tuple[str, str] | None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    import os

    found = _chromium()
    if found is None:
        if os.environ.get("CI"):
            pytest.fail(
                "chromium and chromium-driver are not installed: `make test` installs Debian's packages"
            )
        pytest.skip(
            "no chromium + chromedriver on PATH (make test installs Debian's chromium and chromium-driver)"
        )
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = found[0]
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1600,1000",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(found[1]), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def _wait(driver: Any, condition: Any, what: str, timeout: float = 30.0) -> Any:
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout).until(condition, message=f"timed out waiting for {what}")


def _open(driver: Any, url: str) -> None:
    driver.get(url)
    _wait(
        driver, lambda d: d.execute_script("return document.body.dataset.ready === '1'"), "the page to load"
    )


def _group_ids(driver: Any) -> list[str]:
    # One script call: the table may be rebuilt between finding its rows and reading them.
    script = "return Array.from(document.querySelectorAll('#groups tbody tr'), tr => tr.dataset.group)"
    return list(driver.execute_script(script))


def _rgb(css: str) -> tuple[int, int, int]:
    parts = css[css.index("(") + 1 : css.index(")")].split(",")
    return int(parts[0]), int(parts[1]), int(parts[2])


def test_browser_lists_the_runs_groups_and_a_filter_narrows_them(browser: Any, server: str) -> None:
    from selenium.webdriver.support.ui import Select

    _open(browser, server)
    assert _group_ids(browser) == ["gL", "gX", "gB", "gA"]
    Select(browser.find_element("id", "f-env")).select_by_value("calculator")
    browser.find_element("id", "apply").click()
    _wait(browser, lambda d: _group_ids(d) == ["gB"], "the env filter")
    assert browser.find_element("id", "group-count").text.startswith("1 of 4 groups match")
    assert "unreadable: not a complete Arrow IPC stream" in browser.find_element("id", "quarantine").text


def test_browser_colours_generated_tokens_by_the_chosen_channel(browser: Any, server: str) -> None:
    from selenium.webdriver.support.ui import Select

    _open(browser, server)
    browser.find_element("css selector", '#groups tr[data-group="gA"]').click()
    _wait(
        browser, lambda d: len(d.find_elements("css selector", ".episode")) == 2, "the group's two episodes"
    )

    def first_token(episode: str) -> Any:
        return browser.find_element(
            "css selector", f'.episode[data-episode="{episode}"] .block.model .tok.gen'
        )

    # engine log-prob: the likely token (p = 0.95) is green, the unlikely one (p = 0.05) red.
    sure, unsure = (
        _rgb(first_token("gA-0").value_of_css_property("background-color")),
        _rgb(first_token("gA-1").value_of_css_property("background-color")),
    )
    assert sure[1] > sure[0] and unsure[0] > unsure[1]
    assert first_token("gA-0").get_attribute("title").startswith("engine log-prob -0.050")
    # advantage: +1.5 green, -1.5 red; the hover text carries the value.
    Select(browser.find_element("id", "channel")).select_by_value("advantage")
    plus, minus = first_token("gA-0"), first_token("gA-1")
    assert (
        plus.get_attribute("title") == "advantage 1.500"
        and minus.get_attribute("title") == "advantage -1.500"
    )
    p_rgb, m_rgb = (
        _rgb(plus.value_of_css_property("background-color")),
        _rgb(minus.value_of_css_property("background-color")),
    )
    assert p_rgb[1] > p_rgb[0] and m_rgb[0] > m_rgb[1]
    # clip state: the positive-advantage token was clipped (orange), the other trained.
    Select(browser.find_element("id", "channel")).select_by_value("clip")
    assert first_token("gA-0").get_attribute("title") == "clip state: clipped"
    assert first_token("gA-1").get_attribute("title") == "clip state: trained"
    # A group without a trace has no advantage to show: its tokens are marked, not painted.
    Select(browser.find_element("id", "channel")).select_by_value("advantage")
    browser.find_element("css selector", '#groups tr[data-group="gB"]').click()
    _wait(browser, lambda d: "gB" in d.find_element("id", "group-title").text, "group gB")
    token = browser.find_element("css selector", ".block.model .tok.gen")
    assert "novalue" in token.get_attribute("class") and token.get_attribute("title").startswith("not traced")


def test_browser_shows_markup_in_a_trajectory_as_text(browser: Any, server: str) -> None:
    _open(browser, server)
    browser.find_element("css selector", '#groups tr[data-group="gX"]').click()
    _wait(browser, lambda d: len(d.find_elements("css selector", ".episode")) == 2, "the markup group")
    column = browser.find_element("css selector", '.episode[data-episode="gX-0"]')
    env_block, model_block = (
        column.find_element("css selector", ".block.env"),
        column.find_element("css selector", ".block.model"),
    )
    assert XSS_REPLY in env_block.text and XSS_ACTION in model_block.text
    assert browser.execute_script("return window.pwned === undefined")
    assert not browser.find_elements("css selector", "#episodes script, #episodes img, #episodes b")
