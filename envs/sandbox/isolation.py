"""What isolation this machine gives the sandbox, found out once per process by trying it.

``detect_isolation`` picks an interpreter the sandbox's user can run, then runs a trivial program
under bubblewrap exactly as real executions will run; if that works the sandbox gets ``bwrap``,
otherwise ``rlimits`` with the reason (bwrap missing, user namespaces disabled, ...). The result is
cached: a sandbox asks once, at construction, so a config that requires more than the machine gives
is refused before anything starts.

Under bubblewrap the code sees: the system directories read-only (/usr and the /bin, /lib links),
the interpreter's prefix read-only, a fresh /proc and /dev, a private size-limited /tmp, the
working directory at /sandbox (the only writable place that outlives nothing: it is removed after
the call), an empty read-only root, no network (own network namespace: loopback only), its own PID,
IPC, UTS and user namespaces (no further user namespaces), no environment but PATH, HOME, TMPDIR
and LANG. When rollwise runs as root, bubblewrap itself runs as an unprivileged uid of its own.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from envs.api import EnvError

SANDBOX_DIR = "/sandbox"
PATH_INSIDE = "/usr/local/bin:/usr/bin:/bin"
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
SYSTEM_FILES = ("/etc/ld.so.cache", "/etc/localtime", "/etc/alternatives")
PYTHON_FLAGS = ("-I", "-B", "-u", "-X", "utf8")
PROBE_TIMEOUT_S = 60.0
MIN_PYTHON = (3, 9)
_INTERPRETER_PROBE = "import sys; print(sys.base_prefix); print('%d.%d.%d' % sys.version_info[:3])"


class SandboxUnavailable(EnvError, ValueError):
    """The sandbox cannot run here as configured (no usable interpreter, or less isolation than required).

    Also a ValueError: raised while an env is built from its options, it is a config the machine cannot
    honour, and `rollwise run` reports it as such (``env.options: ... rejects ...``) before starting.
    """


@dataclass(frozen=True)
class Interpreter:
    """A Python the sandbox's user can run: its real path, ``sys.base_prefix`` and version."""

    path: str
    prefix: str
    version: str


@dataclass(frozen=True)
class Isolation:
    """What a sandbox gets: ``kind`` and, for ``rlimits``, why bubblewrap was not used."""

    kind: Literal["bwrap", "rlimits"]
    interpreter: Interpreter
    bwrap_path: str | None
    bwrap_version: str
    bwrap_features: frozenset[str]
    fallback_reason: str

    def describe(self) -> str:
        """One line for logs and ``rollwise env check``: what is isolated and what is not."""
        python = f"python {self.interpreter.version} ({self.interpreter.path})"
        if self.kind == "bwrap":
            return (
                f"bwrap ({self.bwrap_version}): own user, PID, network, IPC and UTS namespaces; read-only "
                f"system; private /tmp; only the working directory writable; rlimits; {python}"
            )
        return (
            f"rlimits only ({self.fallback_reason}): resource limits, a fresh working directory and "
            f"its own session, but the network and every file its uid can reach are reachable; {python}"
        )


def no_groups(uid: int | None) -> list[int] | None:
    """``Popen(extra_groups=...)`` for a child that runs as ``uid`` (None: keep this process's)."""
    return None if uid is None else []


@functools.cache
def detect_isolation(bwrap: str, python: str, probe_uid: int | None, tmp_bytes: int) -> Isolation:
    """Try the interpreter and bubblewrap as uid ``probe_uid``; the best isolation that works.

    Raises ``SandboxUnavailable`` when no interpreter works. Cached per process and arguments.
    """
    _require_pidfd()
    interpreter = find_interpreter(python, probe_uid)
    if not bwrap:
        reason = 'bubblewrap is off (sandbox.bwrap = "")'
        return Isolation("rlimits", interpreter, None, "", frozenset(), reason)
    path = shutil.which(bwrap)
    if path is None:
        reason = f"{bwrap!r} not found (Debian/Ubuntu: apt-get install bubblewrap)"
        return Isolation("rlimits", interpreter, None, "", frozenset(), reason)
    version, features = _bwrap_version_and_features(path)
    problem = _probe_bwrap(path, features, interpreter, probe_uid, tmp_bytes)
    if problem:
        return Isolation("rlimits", interpreter, path, version, features, problem)
    return Isolation("bwrap", interpreter, path, version, features, "")


def _require_pidfd() -> None:
    """Processes are watched through pidfds (Linux 5.3+): no thread per child, no pid-reuse race."""
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError) as exc:
        raise SandboxUnavailable(f"sandbox: needs Linux 5.3 or later (pidfd_open failed: {exc})") from exc


def find_interpreter(python: str, uid: int | None) -> Interpreter:
    """``python``, or the first of this process's base interpreter and the system's python3 that
    ``uid`` can run (a root daemon's own interpreter often lives under /root, out of its reach)."""
    candidates = [python] if python else [getattr(sys, "_base_executable", sys.executable), sys.executable]
    if not python:
        candidates += ["/usr/bin/python3", "/usr/local/bin/python3"]
    failures: list[str] = []
    for candidate in dict.fromkeys(candidates):
        found = shutil.which(candidate)
        if found is None:
            failures.append(f"{candidate}: not found")
            continue
        try:
            done = subprocess.run(
                [os.path.realpath(found), "-I", "-S", "-c", _INTERPRETER_PROBE],
                capture_output=True,
                text=True,
                timeout=PROBE_TIMEOUT_S,
                cwd="/",
                env={"PATH": PATH_INSIDE, "LANG": "C.UTF-8"},
                check=False,
                user=uid,
                group=uid,
                extra_groups=no_groups(uid),
            )
        except (OSError, subprocess.SubprocessError) as exc:
            failures.append(f"{candidate}: {exc}")
            continue
        lines = done.stdout.split()
        if done.returncode != 0 or len(lines) != 2:
            failures.append(f"{candidate}: exit {done.returncode}: {done.stderr.strip()[-200:]}")
            continue
        version = tuple(int(part) for part in lines[1].split("."))
        if version[:2] < MIN_PYTHON:
            failures.append(f"{candidate}: Python {lines[1]} is older than 3.9")
            continue
        return Interpreter(os.path.realpath(found), os.path.realpath(lines[0]), lines[1])
    who = "this user" if uid is None else f"uid {uid}"
    raise SandboxUnavailable(
        f"sandbox: no Python interpreter that {who} can run ({'; '.join(failures)}); "
        "set sandbox.python to one (world-readable when rollwise runs as root)"
    )


def _bwrap_version_and_features(path: str) -> tuple[str, frozenset[str]]:
    try:
        version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30, check=False)
        usage = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return "unknown version", frozenset()
    wanted = ("--disable-userns", "--size")
    return version.stdout.strip() or "unknown version", frozenset(f for f in wanted if f in usage.stdout)


def bwrap_argv(
    bwrap: str,
    features: frozenset[str],
    interpreter: Interpreter,
    workdir: str,
    tmp_bytes: int,
    mounts: tuple[str, ...] = (),
    binds: tuple[tuple[str, str], ...] = (),
    chdir: str = SANDBOX_DIR,
) -> list[str]:
    """The bubblewrap command line (up to ``--``) that mounts ``workdir`` at SANDBOX_DIR, each of
    ``mounts`` (host paths: directories, files, a Unix socket) read-only at the same path and each
    ``(host directory, path inside)`` of ``binds`` writable, and starts in ``chdir``."""
    argv = [bwrap, "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session"]
    if "--disable-userns" in features:
        argv.append("--disable-userns")
    argv += ["--hostname", "sandbox"]
    for directory in SYSTEM_DIRS:
        if os.path.islink(directory):
            argv += ["--symlink", os.readlink(directory), directory]
        elif os.path.isdir(directory):
            argv += ["--ro-bind", directory, directory]
    for file in SYSTEM_FILES:
        argv += ["--ro-bind-try", file, file]
    for extra in _interpreter_mounts(interpreter):
        argv += ["--ro-bind", extra, extra]
    argv += ["--proc", "/proc", "--dev", "/dev"]
    if "--size" in features:
        argv += ["--size", str(tmp_bytes)]
    argv += ["--tmpfs", "/tmp", "--bind", workdir, SANDBOX_DIR]
    for path in mounts:  # a socket stays connectable read-only: connect() needs no write access to the mount
        argv += ["--ro-bind", path, path]
    for host, inside in binds:
        argv += ["--bind", host, inside]
    argv += ["--chdir", chdir, "--remount-ro", "/"]
    argv += ["--clearenv"]
    environment = {"PATH": PATH_INSIDE, "HOME": SANDBOX_DIR, "TMPDIR": "/tmp", "LANG": "C.UTF-8"}
    for name, value in environment.items():
        argv += ["--setenv", name, value]
    return [*argv, "--"]


def _interpreter_mounts(interpreter: Interpreter) -> list[str]:
    """Paths outside the system directories the interpreter needs (a pyenv or conda prefix)."""

    def inside_system(path: str) -> bool:
        return any(Path(path).is_relative_to(d) for d in SYSTEM_DIRS if os.path.isdir(d))

    mounts = [] if inside_system(interpreter.prefix) else [interpreter.prefix]
    if not inside_system(interpreter.path) and not Path(interpreter.path).is_relative_to(interpreter.prefix):
        mounts.append(interpreter.path)
    return mounts


def _probe_bwrap(
    path: str, features: frozenset[str], interpreter: Interpreter, uid: int | None, tmp_bytes: int
) -> str:
    """'' when bubblewrap runs the interpreter here; otherwise what went wrong."""
    with tempfile.TemporaryDirectory(prefix="rollwise-sandbox-probe-") as workdir:
        if uid is not None:
            os.chown(workdir, uid, uid)
        argv = bwrap_argv(path, features, interpreter, workdir, tmp_bytes)
        argv += [interpreter.path, "-I", "-S", "-c", "import os; print(os.getcwd())"]
        try:
            done = subprocess.run(
                argv,
                capture_output=True,
                text=True,
                timeout=PROBE_TIMEOUT_S,
                check=False,
                user=uid,
                group=uid,
                extra_groups=no_groups(uid),
            )
        except (OSError, subprocess.SubprocessError) as exc:
            return f"{path} could not run: {exc}"
    if done.returncode == 0 and done.stdout.strip() == SANDBOX_DIR:
        return ""
    message = done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}, output {done.stdout!r:.80}"]
    hint = ""
    if "namespace" in message[0].lower() or "uid map" in message[0].lower():
        hint = (
            " (unprivileged user namespaces are off: sysctl kernel.unprivileged_userns_clone=1, "
            "user.max_user_namespaces > 0, or an AppArmor profile that allows bwrap)"
        )
    return f"{path} failed: {message[0]}{hint}"
