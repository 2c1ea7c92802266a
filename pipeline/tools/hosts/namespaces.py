"""Network namespaces as machines: each host gets a namespace of its own with one interface (eth0) on a
bridge that lives in a namespace of its own too (the switch), so nothing of the real host's network is
touched and two runs never see each other. Only the hosts' addresses exist: 10.77.0.<n>/24.

`Network(prefix, hosts)` creates them (unique names: the prefix carries this process's pid) and deletes
them on `close()`, also after a failure (use it as a context manager); `sweep_stale()` deletes what a
killed earlier run left behind. A partition is a host's link set down on the switch side (`cut`,
`mend`): its packets are dropped, connections hang as on a real network, nothing is refused.

`run_in(host, fn)` calls `fn` in a thread that joined the host's namespace (setns(2) changes only the
calling thread), so a test talks to the hosts as a machine on that network would.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")
CLONE_NEWNET = 0x40000000
SUBNET = "10.77.0"
_NETNS_DIR = "/var/run/netns"


def unavailable() -> str | None:
    """Why namespaces cannot be made here (a skip reason), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    probe = f"rwprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, check=False)
    if made.returncode != 0:
        return f"ip netns add fails here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return None


def _ip(*args: str, netns: str | None = None) -> None:
    argv = ["ip", *(["-n", netns] if netns else []), *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")


def sweep_stale() -> list[str]:
    """Delete namespaces named by a Network of a process that no longer runs; their names."""
    removed = []
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    for line in listed.splitlines():
        name = line.split()[0] if line.split() else ""
        match = re.match(r"^rwn(\d+)x\d+-", name)
        if match and not os.path.exists(f"/proc/{match.group(1)}"):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
            removed.append(name)
    return removed


class Network:
    """Hosts (namespaces) on one bridge. `address(host)`, `argv(host, ...)`, `cut(host)`, `mend(host)`."""

    _count = 0

    def __init__(self, hosts: Sequence[str]) -> None:
        Network._count += 1
        self.prefix = f"rwn{os.getpid()}x{Network._count}"
        self.hosts = list(hosts)
        self.switch = f"{self.prefix}-sw"
        self._made: list[str] = []
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def namespace(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    def address(self, host: str) -> str:
        return f"{SUBNET}.{self.hosts.index(host) + 1}"

    def _build(self) -> None:
        self._add_ns(self.switch)
        _ip("link", "add", "br0", "type", "bridge", netns=self.switch)
        _ip("link", "set", "br0", "up", netns=self.switch)
        for i, host in enumerate(self.hosts):
            ns = self.namespace(host)
            self._add_ns(ns)
            inside, outside = f"rw{os.getpid() % 100000}h{i}", f"rw{os.getpid() % 100000}s{i}"
            _ip("link", "add", inside, "type", "veth", "peer", "name", outside)
            _ip("link", "set", inside, "netns", ns, "name", "eth0")
            _ip("link", "set", outside, "netns", self.switch, "name", f"port{i}")
            _ip("link", "set", f"port{i}", "master", "br0", "up", netns=self.switch)
            _ip("addr", "add", f"{self.address(host)}/24", "dev", "eth0", netns=ns)
            _ip("link", "set", "eth0", "up", netns=ns)
            _ip("link", "set", "lo", "up", netns=ns)

    def _add_ns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)

    def argv(self, host: str, *command: str) -> list[str]:
        """`command` run inside the host's namespace."""
        return ["ip", "netns", "exec", self.namespace(host), *command]

    def cut(self, host: str) -> None:
        """Partition: the host's link goes down on the switch (its packets are dropped)."""
        _ip("link", "set", f"port{self.hosts.index(host)}", "down", netns=self.switch)

    def mend(self, host: str) -> None:
        _ip("link", "set", f"port{self.hosts.index(host)}", "up", netns=self.switch)

    def enter(self, host: str) -> None:
        """Move the calling thread into the host's namespace (only for a thread of its own: it stays)."""
        path = os.path.join(_NETNS_DIR, self.namespace(host))
        fd = os.open(path, os.O_RDONLY)
        try:
            if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns into {path} failed")
        finally:
            os.close(fd)

    def routes(self, host: str) -> list[str]:
        """The host's routing table: where its packets can go at all."""
        argv = ["ip", "-n", self.namespace(host), "route", "show"]
        return subprocess.run(argv, capture_output=True, text=True, check=True).stdout.splitlines()

    def run_in(self, host: str, fn: Callable[[], T], timeout_s: float = 600.0) -> T:
        """`fn()` in a thread that joined the host's namespace; its result or its exception."""
        result: list[Any] = []
        failure: list[BaseException] = []

        def target() -> None:
            try:
                self.enter(host)
                result.append(fn())
            except BaseException as exc:  # handed to the caller's thread
                failure.append(exc)

        thread = threading.Thread(target=target, name=f"in-{host}", daemon=True)
        thread.start()
        thread.join(timeout_s)
        if thread.is_alive():
            raise TimeoutError(f"call in {host} did not return within {timeout_s} s")
        if failure:
            raise failure[0]
        return result[0]

    def close(self) -> None:
        """Delete every namespace (their interfaces go with them). Idempotent."""
        for name in reversed(self._made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
        self._made.clear()

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
