"""`rollwise bench http1`: both parsers read the same replies alike; without httptools it says so."""

from __future__ import annotations

import json
import sys

import pytest

from pipeline.tools.bench import http1_parser


@pytest.mark.parametrize("chunked", [False, True])
def test_the_own_parser_reads_the_benchmarks_replies(chunked: bool) -> None:
    raw = http1_parser.generate_reply(5, chunked=chunked)
    split = raw.index(b"\r\n\r\n") + 4
    for pieces in ([raw], [raw[:split], raw[split:]]):
        status, body, keep_alive = http1_parser.own(pieces)
        assert (status, keep_alive) == (200, True)
        assert json.loads(body)["meta_info"]["completion_tokens"] == 5


def test_httptools_reads_what_the_own_parser_reads() -> None:
    pytest.importorskip("httptools")
    raw = http1_parser.generate_reply(7, chunked=True)
    parse = http1_parser.llhttp_on(http1_parser.HttptoolsReplies())
    assert parse([raw]) == http1_parser.own([raw])
    assert parse([raw[:100], raw[100:]]) == http1_parser.own([raw])  # the same connection, a second reply


def test_without_httptools_the_bench_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "httptools", None)  # import raises ImportError
    assert http1_parser.main(["--rounds", "1", "--replies", "1"]) == 2
    assert "pip install httptools" in capsys.readouterr().out
