"""The first code that runs inside a sandbox: apply the limits, then run the untrusted ``main.py``.

The sandbox passes this file's source to the interpreter with ``-c`` and one argument of ``key=value``
words (``encode_config``; not JSON, whose import costs more than the rest of the launcher)::

    owner=4242 status_fd=3 main=main.py max_processes=32 count_user_tasks=0 supervise=0 drop_to=
    RLIMIT_CPU=10:11 RLIMIT_AS=536870912:536870912 ...

``owner`` (the pid of the rollwise process that started it) is unused here: it tells ``ps`` whose sandbox
a process is. Status lines on ``status_fd``, each one ``write``: ``started <pid>`` once the limits hold;
``error <text>`` when they could not be applied (the sandbox raises); when supervising also ``child <pid>``
and ``exit <code>``. The untrusted code never holds ``status_fd``.

- In place (bubblewrap): limits on this process, then the code runs in it; the PID namespace takes every
  process the code starts down with it.
- Supervising (rlimits only): this process stays the parent and a subreaper, runs the code in a child with
  its own process group, then kills and reaps everything it left behind (also on SIGTERM). With
  ``drop_to`` the parent stays root and only the child becomes that uid and takes the limits.

Only the standard library, and syntax any Python 3.9+ understands.
"""

from __future__ import annotations

# rollwise-sandbox-launcher: this comment travels in the command line (-c), so ps and tests can tell
# a sandbox's processes (and whatever they fork) from everything else.
import builtins
import os
import sys
import types

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is not imported at run time: it costs the launcher a few milliseconds
    from collections.abc import Callable
    from typing import Any

LAUNCHER_TAG = "rollwise-sandbox-launcher"
SIGTERM = 15
SIGKILL = 9  # Linux; the signal module is not imported: it pulls in enum, a few milliseconds
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
EXIT_LAUNCHER_FAILED = 125


def _report(status_fd: int, *words: str) -> None:
    os.write(status_fd, (" ".join(words) + "\n").encode())


def _prctl(option: int, value: int) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}, {value}) failed")


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _read_status(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as status:
        return dict(line.split(":", 1) for line in status if ":" in line)


def _user_tasks(uid: int) -> int:
    """Tasks (threads included) whose real uid is ``uid``: what RLIMIT_NPROC counts for them."""
    count = 0
    for pid in _pids():
        try:
            fields = _read_status(pid)
            if int(fields["Uid"].split()[0]) == uid:
                count += int(fields["Threads"])
        except (OSError, KeyError, ValueError):
            continue  # the process ended while we looked
    return count


def apply_limits(config: dict[str, Any]) -> None:
    """Become ``drop_to`` (if set), forbid privilege gains, and lower every limit (hard and soft)."""
    import resource

    uid = config["drop_to"]
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    if config["supervise"]:  # bubblewrap has already set no_new_privs (and ctypes costs an import)
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
    nproc = int(config["max_processes"])
    if config["count_user_tasks"]:
        # Without a user namespace or a uid of its own, RLIMIT_NPROC counts every task of the user:
        # allow what the user runs now plus the sandbox's share.
        nproc += _user_tasks(os.getuid()) - 1  # this process is the code's own, counted in max_processes
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    for name, (soft, hard) in config["rlimits"].items():
        resource.setrlimit(getattr(resource, name), (int(soft), int(hard)))


def run_main(path: str) -> None:
    """Run ``path`` as ``python path`` would (``__main__``, argv, sys.path[0]); exit with its status."""
    sys.argv = [path]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    module = types.ModuleType("__main__")
    module.__dict__.update(__file__=path, __builtins__=builtins)
    sys.modules["__main__"] = module
    try:
        with open(path, "rb") as source:
            code = compile(source.read(), path, "exec")
        exec(code, module.__dict__)
    except SystemExit:
        raise
    except BaseException as exc:
        _print_exception(exc, path)
        sys.exit(1)
    sys.exit(0)


def _print_exception(exc: BaseException, path: str) -> None:
    """The traceback Python prints for ``python path``, without the launcher's own frames."""
    import traceback

    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != path:
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb)
    sys.stderr.flush()


def _parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after it.
        return int(stat.read().rsplit(")", 1)[1].split()[1])


def _children() -> list[int]:
    """This process's children: the code, what it started, and every orphan of it (we are a subreaper)."""
    me = os.getpid()
    try:
        with open(f"/proc/{me}/task/{me}/children") as children:
            return [int(pid) for pid in children.read().split()]
    except OSError:  # a kernel without CONFIG_PROC_CHILDREN: look at every process
        found = []
        for pid in _pids():
            try:
                if _parent_of(pid) == me:
                    found.append(pid)
            except (OSError, IndexError, ValueError):
                continue
        return found


def _kill(send: Callable[[int, int], None], target: int) -> None:
    # try/except rather than contextlib.suppress here and below: importing contextlib costs start-up time
    try:  # noqa: SIM105
        send(target, SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # already gone


def _kill_leftovers() -> None:
    """Kill and reap every child until none is left (ends when waitpid says we have no child).

    Every process the code started is a descendant of this subreaper: killing our children orphans
    their children, which become ours, so each round goes one generation deeper; the process limit
    bounds how many there can be. No scan of /proc, no signal to anything that is not ours.
    """
    while True:
        for pid in _children():
            _kill(os.kill, pid)
        try:
            os.waitpid(-1, 0)
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            return
        except InterruptedError:
            continue


class _Halt(BaseException):
    """SIGTERM from the sandbox (a limit was reached, or the call was cancelled): end the code now."""


def _halt(_signum: int, _frame: object) -> None:
    raise _Halt


def supervise(config: dict[str, Any], status_fd: int) -> None:
    import _signal  # type: ignore[import-not-found]  # C module: the signal module's enums cost start-up time

    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    child = os.fork()
    if child == 0:
        try:
            os.setpgid(0, 0)
            apply_limits(config)
            _prctl(PR_SET_PDEATHSIG, SIGKILL)  # after the uid change, which clears it
        except BaseException as exc:
            _report(status_fd, "error", f"{type(exc).__name__}: {exc}".replace("\n", " "))
            os._exit(EXIT_LAUNCHER_FAILED)
        _report(status_fd, "started", str(os.getpid()))
        os.close(status_fd)
        run_main(config["main"])
    code = 128 + SIGKILL  # unless the code ends by itself: the sandbox stopped it
    try:
        _signal.signal(SIGTERM, _halt)
        try:  # noqa: SIM105
            os.setpgid(child, child)  # both sides set it: whichever runs first wins the race
        except OSError:  # the child already did, or already ended
            pass
        _report(status_fd, "child", str(child))
        # WNOWAIT: the child stays a zombie, so its process group id cannot be reused before the kill.
        while True:
            try:
                ended = os.waitid(os.P_PID, child, os.WEXITED | os.WNOWAIT)
                break
            except InterruptedError:
                continue
        if ended is not None:  # None only with WNOHANG, which is not asked for
            code = ended.si_status if ended.si_code == os.CLD_EXITED else 128 + ended.si_status
    except _Halt:
        pass
    _signal.signal(SIGTERM, _signal.SIG_IGN)  # the cleanup below must finish
    _kill(os.killpg, child)
    _kill_leftovers()
    _report(status_fd, "exit", str(code))
    os._exit(code)


def encode_config(
    *,
    owner: int,
    status_fd: int,
    main: str,
    max_processes: int,
    count_user_tasks: bool,
    supervise: bool,
    drop_to: int | None,
    rlimits: dict[str, tuple[int, int]],
) -> str:
    """The launcher's argument (see the module docstring); ``main`` must hold no whitespace."""
    if not main or any(c.isspace() or c == "=" for c in main):
        raise ValueError(f"launcher: main file name {main!r} must hold no whitespace or '='")
    words = [
        f"owner={owner}",
        f"status_fd={status_fd}",
        f"main={main}",
        f"max_processes={max_processes}",
        f"count_user_tasks={int(count_user_tasks)}",
        f"supervise={int(supervise)}",
        f"drop_to={'' if drop_to is None else drop_to}",
    ]
    words += [f"{name}={soft}:{hard}" for name, (soft, hard) in rlimits.items()]
    return " ".join(words)


def decode_config(text: str) -> dict[str, Any]:
    fields = dict(word.split("=", 1) for word in text.split())
    fields.pop("owner", None)
    config: dict[str, Any] = {
        "status_fd": int(fields.pop("status_fd")),
        "main": fields.pop("main"),
        "max_processes": int(fields.pop("max_processes")),
        "count_user_tasks": fields.pop("count_user_tasks") == "1",
        "supervise": fields.pop("supervise") == "1",
    }
    drop_to = fields.pop("drop_to")
    config["drop_to"] = int(drop_to) if drop_to else None
    config["rlimits"] = {name: tuple(int(v) for v in value.split(":")) for name, value in fields.items()}
    return config


def main() -> None:
    config = decode_config(sys.argv[1])
    status_fd = int(config["status_fd"])
    if config["supervise"]:
        try:
            _prctl(PR_SET_PDEATHSIG, SIGKILL)  # the daemon dies -> so does the supervisor
        except OSError as exc:
            _report(status_fd, "error", f"{exc}")
            os._exit(EXIT_LAUNCHER_FAILED)
        supervise(config, status_fd)
    try:
        apply_limits(config)
    except BaseException as exc:
        _report(status_fd, "error", f"{type(exc).__name__}: {exc}".replace("\n", " "))
        os._exit(EXIT_LAUNCHER_FAILED)
    _report(status_fd, "started", str(os.getpid()))
    os.close(status_fd)
    run_main(config["main"])


if __name__ == "__main__":
    main()
