"""The core lease (pipeline.contracts.core_lease): one byte two processes map."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.contracts.core_lease import NO_LEASE, CoreLease, open_lease


def test_a_hold_is_seen_by_another_process_and_released_on_an_exception(tmp_path: Path) -> None:
    lease = CoreLease.create(tmp_path / "cores.lease")
    probe = [
        sys.executable,
        "-c",
        "import sys; from pathlib import Path; from pipeline.contracts.core_lease import open_lease; "
        "print(open_lease(Path(sys.argv[1])).held())",
        str(lease.path),
    ]
    assert subprocess.run(probe, capture_output=True, text=True, check=True).stdout == "False\n"
    with pytest.raises(RuntimeError), lease.holding():
        assert subprocess.run(probe, capture_output=True, text=True, check=True).stdout == "True\n"
        raise RuntimeError("the step failed")
    assert not lease.held() and lease.path.read_bytes() == b"\0"
    assert not CoreLease.create(lease.path).held()  # a new run starts with nobody holding it


def test_no_file_means_no_lease_and_no_lease_is_never_held(tmp_path: Path) -> None:
    assert open_lease(None) is NO_LEASE
    assert open_lease(tmp_path / "missing") is NO_LEASE
    (tmp_path / "empty").write_bytes(b"")
    assert open_lease(tmp_path / "empty") is NO_LEASE  # cannot map 1 byte of an empty file
    with NO_LEASE.holding():
        assert not NO_LEASE.held()
