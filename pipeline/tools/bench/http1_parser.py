"""HTTP/1.1 reply parsing: engines/http1.py's own parser against httptools (llhttp, what uvicorn uses).

Same process, same replies, same results read back (status, body, keep-alive): each parser takes a
realistic /generate reply of an aiohttp server (Content-Length framed, and chunked), fed whole and in
two reads (head, body), and the time per reply is the best of several rounds. The httptools side is a
complete equivalent of `_Reply` for these replies (callbacks into one small object per connection, as
uvicorn's protocol holds its parser); what it would need beyond that (HEAD replies, replies framed by
the server closing, 1xx) is not timed. Printed: microseconds per reply of each, and httptools / own.

    rollwise bench http1 [--rounds 7] [--replies 20000]

httptools is not a dependency of rollwise (engines/http1.py's docstring says why): `pip install httptools`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence

from pipeline.supervisor.engines.http1 import _Reply


def generate_reply(tokens: int, *, chunked: bool) -> bytes:
    """An SGLang /generate reply of `tokens` tokens as the embedded engine (aiohttp) sends it."""
    ids = [(7919 * i) % 32000 for i in range(tokens)]
    body = json.dumps(
        {
            "text": " word" * tokens,
            "output_ids": ids,
            "meta_info": {
                "id": "0f3c2a9e41d84b7c9a5e6d1f2b3c4d5e",
                "finish_reason": {"type": "length", "length": tokens},
                "prompt_tokens": 412,
                "completion_tokens": tokens,
                "cached_tokens": 384,
                "weight_version": "17",
                "output_token_logprobs": [[-0.1234567 - i * 1e-3, t, None] for i, t in enumerate(ids)],
                "output_token_weight_versions": ["17"] * tokens,
                "e2e_latency": 0.0412,
            },
        },
        separators=(",", ":"),
    ).encode()
    head = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json; charset=utf-8\r\n"
        b"Date: Sun, 29 Nov 2026 03:20:00 GMT\r\nServer: Python/3.11 aiohttp/3.12.15\r\n"
    )
    if chunked:
        half = len(body) // 2
        chunks = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in (body[:half], body[half:]))
        return head + b"Transfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n"
    return head + b"Content-Length: %d\r\n\r\n" % len(body) + body


class HttptoolsReplies:
    """`_Reply`'s results (status, body, keep_alive) from httptools.HttpResponseParser, one parser per
    connection as uvicorn holds it (a parser per reply would be a reference cycle per reply)."""

    __slots__ = ("_parser", "_pieces", "body", "complete", "keep_alive", "status")

    def __init__(self) -> None:
        import httptools

        self._pieces: list[bytes] = []
        self.body = b""
        self.status = 0
        self.keep_alive = False
        self.complete = False
        self._parser = httptools.HttpResponseParser(self)

    def on_body(self, body: bytes) -> None:
        self._pieces.append(body)

    def on_message_complete(self) -> None:
        parser = self._parser
        self.status = parser.get_status_code()
        self.keep_alive = parser.should_keep_alive()
        self.body = b"".join(self._pieces)
        self._pieces.clear()
        self.complete = True

    def feed(self, data: bytes) -> bool:
        self._parser.feed_data(data)
        return self.complete

    def next_reply(self) -> None:
        self.complete, self.status, self.body, self.keep_alive = False, 0, b"", False


def own(pieces: Sequence[bytes]) -> tuple[int, bytes, bool]:
    reply = _Reply(head_only=False)
    for piece in pieces:
        reply.feed(piece)
    return reply.status, reply.body, reply.keep_alive


def llhttp_on(connection: HttptoolsReplies) -> Callable[[Sequence[bytes]], tuple[int, bytes, bool]]:
    def parse(pieces: Sequence[bytes]) -> tuple[int, bytes, bool]:
        connection.next_reply()
        for piece in pieces:
            connection.feed(piece)
        return connection.status, connection.body, connection.keep_alive

    return parse


def best_us(
    parse: Callable[[Sequence[bytes]], object], pieces: Sequence[bytes], replies: int, rounds: int
) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(replies):
            parse(pieces)
        best = min(best, time.perf_counter() - start)
    return best / replies * 1e6


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--replies", type=int, default=20000)
    args = parser.parse_args(argv)
    try:
        import httptools  # noqa: F401
    except ImportError:
        print("rollwise bench http1 needs httptools (not a rollwise dependency): pip install httptools")
        return 2
    print(f"{'reply':<34} {'bytes':>6} {'own us':>7} {'httptools us':>12} {'ratio':>6}")
    for tokens in (48, 512):
        for chunked in (False, True):
            raw = generate_reply(tokens, chunked=chunked)
            split = raw.index(b"\r\n\r\n") + 4
            for label, pieces in (("whole", [raw]), ("head, body", [raw[:split], raw[split:]])):
                llhttp = llhttp_on(HttptoolsReplies())
                assert own(pieces) == llhttp(pieces), "the two parsers disagree"
                a = best_us(own, pieces, args.replies, args.rounds)
                b = best_us(llhttp, pieces, args.replies, args.rounds)
                name = f"{tokens} tokens, {'chunked' if chunked else 'length'}, {label}"
                print(f"{name:<34} {len(raw):>6} {a:>7.2f} {b:>12.2f} {b / a:>6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
