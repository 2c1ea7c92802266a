#!/usr/bin/env python3
"""Stand-in for `python -m sglang.launch_server` in launcher tests (standard library only).

Invoked as `stub_sglang_server.py -m sglang.launch_server --model-path M --host H --port P ...`, i.e.
in the place of the Python executable. It parses the flags SGLangServer passes, logs them, answers
GET /health with 503 for STUB_READY_AFTER_S seconds (default 0.3) and 200 afterwards, and exits 0 on
SIGTERM. Env STUB_MODE: "normal" (default), "ignore_sigterm" (only SIGKILL ends it), "crash" (exits 3
at once, after logging an error), "orphan_child" (like SGLang's scheduler processes: starts a child that
ignores SIGTERM and leaves it behind on exit).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import FrameType


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("-m", dest="module", required=True)
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--mem-fraction-static", type=float, required=True)
    parser.add_argument("--tp-size", type=int, required=True)
    parser.add_argument("--dp-size", type=int, required=True)
    parser.add_argument("--enable-metrics", action="store_true")
    parser.add_argument("--weight-version", required=True)
    parser.add_argument("--api-key")
    args, unknown = parser.parse_known_args(argv)
    args.unknown = unknown
    return args


def main() -> int:
    args = parse_args(sys.argv[1:])
    mode = os.environ.get("STUB_MODE", "normal")
    ready_after_s = float(os.environ.get("STUB_READY_AFTER_S", "0.3"))
    print(
        f"stub sglang: module={args.module} model={args.model_path} port={args.port} "
        f"tp={args.tp_size} dp={args.dp_size} weight_version={args.weight_version} extra={args.unknown}",
        flush=True,
    )
    if mode == "crash":
        print("stub sglang: RuntimeError: CUDA out of memory (simulated)", file=sys.stderr, flush=True)
        return 3
    started = time.monotonic()
    if mode == "orphan_child":
        code = (
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('ignoring SIGTERM', flush=True); time.sleep(120)"
        )
        child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
        assert child.stdout is not None
        child.stdout.readline()  # its SIGTERM handler is in place
        print(f"stub sglang: child pid {child.pid}", flush=True)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            ready = time.monotonic() - started >= ready_after_s
            self.send_response(200 if self.path == "/health" and ready else 503)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *log_args: object) -> None:
            pass

    server = ThreadingHTTPServer((args.host, args.port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    stop = threading.Event()

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        if mode == "ignore_sigterm":
            print("stub sglang: ignoring SIGTERM", flush=True)
            return
        print("stub sglang: SIGTERM received, shutting down", flush=True)
        stop.set()

    signal.signal(signal.SIGTERM, on_sigterm)
    print(f"stub sglang: serving on http://{args.host}:{args.port}", flush=True)
    while not stop.wait(0.05):
        pass
    server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
