"""Logs under a size cap (issue 33: +6 MiB/h without bound): copytruncate rotation keeps every appending
writer, this process's or a child's, writing at the new end; readers see the rotated copies in order;
the ledger is never rotated."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

from pipeline.contracts.config import load_config
from pipeline.contracts.run_dir import log_lines, rotated_parts
from pipeline.supervisor.log_rotation import keep_logs_small, rotate, rotate_large_logs


def test_copytruncate_keeps_an_appending_writer_at_the_new_end(tmp_path: Path) -> None:
    path = tmp_path / "supervisor.log"
    with open(path, "a", buffering=1) as writer:
        for generation in range(5):
            for i in range(3):
                writer.write(f"g{generation} line {i}\n")
            rotate(path, keep=2)
        writer.write("after\n")
    assert path.read_text() == "after\n"  # no hole of zeros where the old content was
    assert [p.name for p in rotated_parts(path)] == ["supervisor.log.2", "supervisor.log.1", "supervisor.log"]
    assert log_lines(path) == [f"g{g} line {i}" for g in (3, 4) for i in range(3)] + ["after"]
    assert not (tmp_path / "supervisor.log.3").exists()


def test_a_childs_inherited_log_is_capped_while_it_writes(tmp_path: Path) -> None:
    """The children write to the file the supervisor opened for them (their stderr): rotated under them."""
    path = tmp_path / "engine0.log"
    # One write per line, as logging's handlers write a record (print() may write the newline apart).
    code = "import sys\nfor i in range(4000):\n    sys.stderr.write('x' * 99 + '\\n')\n    sys.stderr.flush()"
    with open(path, "a") as log_file:
        child = subprocess.Popen([sys.executable, "-c", code], stderr=log_file)
        while child.poll() is None:
            rotate_large_logs(tmp_path, max_bytes=64 * 1024, keep=2)
        rotate_large_logs(tmp_path, max_bytes=64 * 1024, keep=2)
    assert child.returncode == 0
    sizes = [p.stat().st_size for p in rotated_parts(path)]
    assert len(sizes) <= 3 and max(sizes) <= 64 * 1024 + 100 * 4000
    assert path.stat().st_size <= 64 * 1024
    assert all(line == "x" * 99 for line in log_lines(path))  # whole lines, no zero-filled hole


def test_only_large_logs_rotate_and_never_the_ledger(tmp_path: Path) -> None:
    (tmp_path / "consumed.jsonl").write_text("x" * 5000)
    (tmp_path / "steps.jsonl").write_text("y" * 5000)
    (tmp_path / "learner.log").write_text("small\n")
    (tmp_path / "notes.txt").write_text("z" * 5000)
    assert rotate_large_logs(tmp_path, max_bytes=4096, keep=3) == ["steps.jsonl"]
    assert (tmp_path / "consumed.jsonl").stat().st_size == 5000
    assert (tmp_path / "steps.jsonl.1").stat().st_size == 5000 and (
        tmp_path / "steps.jsonl"
    ).stat().st_size == 0


async def test_the_rotation_task_runs_until_the_stop(tmp_path: Path) -> None:
    (tmp_path / "supervisor.log").write_text("a" * 70_000)
    stopping = asyncio.Event()
    task = asyncio.create_task(keep_logs_small(tmp_path, 65_536, 2, stopping, every_s=0.05))
    for _ in range(200):
        if (tmp_path / "supervisor.log.1").exists():
            break
        await asyncio.sleep(0.01)
    stopping.set()
    await asyncio.wait_for(task, 5)
    assert (tmp_path / "supervisor.log.1").stat().st_size == 70_000


def test_log_rotation_config_keys_have_defaults_and_bounds() -> None:
    logs = load_config(None, []).logs
    assert (logs.max_bytes, logs.keep, logs.check_every_s) == (64 * 2**20, 3, 30.0)
    assert load_config(None, ["logs.keep=5"]).logs.keep == 5


def test_a_copy_that_ends_in_a_torn_line_keeps_only_whole_lines(tmp_path: Path) -> None:
    from pipeline.supervisor.log_rotation import _drop_torn_tail

    whole, torn, bare = tmp_path / "whole.log", tmp_path / "torn.log", tmp_path / "bare.log"
    whole.write_bytes(b"a\nb\n")
    torn.write_bytes(b"a\nb\nhalf a li")
    bare.write_bytes(b"half")
    for path in (whole, torn, bare):
        _drop_torn_tail(path)
    assert (whole.read_bytes(), torn.read_bytes(), bare.read_bytes()) == (b"a\nb\n", b"a\nb\n", b"half")
