"""A Harbor runtime without Docker: each trial's environment is one long-lived bubblewrap namespace.

Harbor (Python 3.12, its own venv: `make env-harbor`) imports this class by path, so its own CLI,
oracle and agents run Harbor task directories on the host's userland:

    LITELLM_LOCAL_MODEL_COST_MAP=True PYTHONPATH=<rollwise checkout> <harbor venv>/bin/harbor run \\
        --env envs.ecosystems.harbor_bwrap_runtime:BwrapEnvironment -p envs/harbor_tasks -a oracle

(envs/ecosystems/harbor-run.sh does exactly this.) The module runs in Harbor's interpreter: it imports
Harbor and the standard library, and from rollwise only `envs.ecosystems.harbor_task_dir` (standard
library only), never rollwise's own dependencies.

Rules:

- What runs: the task's environment/Dockerfile is read by rollwise's parser (harbor_task_dir), never
  built. FROM any base (the host's /usr stands in for it), WORKDIR (where commands start, unless
  task.toml's `workdir` says otherwise), COPY (files of environment/ copied into the WORKDIR tree before
  the sandbox starts) and ENV (every command's environment, under Harbor's task and exec variables) are
  applied. A task whose Dockerfile changes the image (RUN, ADD, USER, ...), a prebuilt `docker_image`, a
  docker-compose environment or bind mounts (`--mounts`, `auto_mounting`) fails its trials at `start`
  with every reason (SandboxBuildFailedError, which Harbor does not retry; the job's other tasks run);
  an allowlist network policy, GPUs, TPUs and Windows are refused by Harbor's own checks.
- Network: the host's, only when both the task (`allow_internet = true` or `network_mode = "public"`)
  and Harbor's policy for the trial say public; otherwise a network namespace of its own (loopback).
- One namespace per trial: `start` launches `bwrap ... sleep infinity` (own user, mount, PID, IPC, UTS
  and cgroup namespaces, and network as above) and every `exec` and transfer joins it with `nsenter`,
  so files, /tmp and background processes (a tmux server, say) persist from one command to the next.
  Commands run as root of that namespace; when Harbor itself runs as root the namespace belongs to an
  unprivileged uid (`--ek sandbox_uid=N`, default 65534), so its root is nobody outside, and the
  trial's directory must be reachable by that uid (`--ek sandbox_dir=...`, default the temporary
  directory). `exec(user=...)` accepts only root (None, "root", 0).
- Filesystem: `/` is a fresh per-trial host directory, writable (so /app, /tests, /solution, /logs,
  /root, /tmp and anything an agent creates live there), with the host's /usr, /etc and the /bin, /lib
  links read-only on top, a fresh /proc and a minimal /dev. Harbor's output directories (/logs/agent,
  /logs/verifier, /logs/artifacts and every auto-mount target) exist, mode 777, before the first command.
- Limits per command (prlimit, inherited by everything the command starts): the task's `memory_mb`
  caps each process's address space (unless `--memory ignore` or `request`), `storage_mb` each file's
  size, `max_processes` (`--ek`, default 1024) the processes of the namespace's user (RLIMIT_NPROC,
  counted per user namespace on Linux 5.14 and later); `cpus` is not enforced. A command past its
  `timeout_sec` is killed with its process group and raises RuntimeError, as Harbor's Docker runtime
  does; a command whose caller is cancelled is killed the same way.
- Transfers go through the namespace (tar or cat inside, a pipe to or from the host), so a symlink an
  agent leaves behind resolves inside the sandbox, never to a host file, and uploaded files belong to the
  sandbox's uid. `upload_dir`/`download_dir` copy a directory's contents, as `docker cp src/.` does; a
  downloaded link that would point outside its target directory is skipped with a warning.
- `stop` kills the namespace (every process in it) and, when `delete`, removes the trial's directory;
  otherwise the directory is kept and its path logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import select
import shutil
import signal
import subprocess
import tarfile
import tempfile
from pathlib import Path, PurePosixPath
from typing import IO, Any

from harbor.environments.base import (  # type: ignore[import-not-found]
    BaseEnvironment,
    ExecResult,
    SandboxBuildFailedError,
)
from harbor.environments.capabilities import (  # type: ignore[import-not-found]
    EnvironmentCapabilities,
    EnvironmentResourceCapabilities,
)
from harbor.models.task.config import NetworkMode  # type: ignore[import-not-found]
from harbor.models.trial.config import ResourceMode  # type: ignore[import-not-found]
from harbor.models.trial.paths import EnvironmentPaths  # type: ignore[import-not-found]

from envs.ecosystems.harbor_task_dir import read_dockerfile

ENVIRONMENT_TYPE = "rollwise-bwrap"
PATH_INSIDE = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
BASE_ENV = {"PATH": PATH_INSIDE, "HOME": "/root", "LANG": "C.UTF-8"}
READ_ONLY_DIRS = ("/usr", "/etc")
SYSTEM_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ROOT_SANDBOX_UID = 65534
DEFAULT_MAX_PROCESSES = 1024
START_TIMEOUT_S = 60.0
TRANSFER_TIMEOUT_S = 600.0
STOP_WAIT_S = 10.0
OUTPUT_LIMIT_BYTES = 32 << 20
READY = b"rollwise-bwrap-ready\n"


@functools.cache
def bwrap_features(bwrap: str) -> frozenset[str]:
    """The optional bubblewrap flags this binary has (of those the runtime uses)."""
    try:
        usage = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return frozenset()
    return frozenset(flag for flag in ("--disable-userns",) if flag in usage.stdout)


def namespace_argv(bwrap: str, root: Path, workdir: str, network: bool) -> list[str]:
    """The bubblewrap command line (up to `--`) of a trial's namespace: `root` (a host directory) is the
    writable `/`, the host's system directories are read-only over it, and it starts in `workdir`."""
    argv = [bwrap, "--unshare-all", "--unshare-user", "--uid", "0", "--gid", "0", "--die-with-parent"]
    if network:
        argv.append("--share-net")
    if "--disable-userns" in bwrap_features(bwrap):
        argv.append("--disable-userns")
    argv += ["--hostname", "sandbox", "--bind", str(root), "/"]
    for directory in READ_ONLY_DIRS:
        argv += ["--ro-bind", directory, directory]
    for link in SYSTEM_LINKS:
        if os.path.islink(link):
            argv += ["--symlink", os.readlink(link), link]
        elif os.path.isdir(link):
            argv += ["--ro-bind", link, link]
    argv += ["--proc", "/proc", "--dev", "/dev", "--chdir", workdir]
    return [*argv, "--"]


def limit_argv(memory_bytes: int | None, file_bytes: int | None, processes: int) -> list[str]:
    """`prlimit ... --`: the limits every command of the sandbox runs under (module docstring)."""
    argv = ["prlimit", f"--nproc={processes}", "--core=0"]
    if memory_bytes:
        argv.append(f"--as={memory_bytes}")
    if file_bytes:
        argv.append(f"--fsize={file_bytes}")
    return [*argv, "--"]


def _skip_unsafe(member: tarfile.TarInfo, destination: str) -> tarfile.TarInfo | None:
    """tarfile's `data` filter, except that what it refuses (a link out of the target, a device) is
    skipped instead of ending the whole download."""
    try:
        return tarfile.data_filter(member, destination)
    except tarfile.FilterError:
        return None


def _remove_tree(path: Path) -> None:
    """Remove `path` even where the sandbox left directories without write or search permission."""
    for directory, _, _ in os.walk(path):
        with contextlib.suppress(OSError):
            os.chmod(directory, 0o700)
    shutil.rmtree(path, ignore_errors=True)


def _chown_tree(path: Path, uid: int) -> None:
    os.lchown(path, uid, uid)
    for directory, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            os.lchown(os.path.join(directory, name), uid, uid)


def _searchable_by(directory: Path, uid: int) -> bool:
    """Whether `uid` (no supplementary groups, its gid equal to it) can reach `directory`: every
    directory from / down has the search bit for it (ACLs aside)."""
    for path in (directory, *directory.parents):
        mode = path.stat()
        if mode.st_uid == uid:
            bit = 0o100
        elif mode.st_gid == uid:
            bit = 0o010
        else:
            bit = 0o001
        if not mode.st_mode & bit:
            return False
    return True


def _wait_for_exit(pidfd: int, seconds: float) -> None:
    select.select([pidfd], [], [], seconds)


class BwrapEnvironment(BaseEnvironment):
    """Harbor's environment for one trial, run in a persistent bubblewrap namespace (module docstring).

    Harbor builds it from `--env envs.ecosystems.harbor_bwrap_runtime:BwrapEnvironment`; `--ek`
    options: `bwrap` (the binary), `sandbox_uid` (the uid that owns the namespace when Harbor runs as
    root), `max_processes`, `sandbox_dir` (where trials' directories go; default: the temporary
    directory, which that uid must be able to reach).
    """

    def __init__(
        self,
        *args: Any,
        bwrap: str = "bwrap",
        sandbox_uid: int | str | None = None,
        max_processes: int | str = DEFAULT_MAX_PROCESSES,
        sandbox_dir: str | None = None,
        **kwargs: Any,
    ) -> None:
        # Set before Harbor's __init__, which calls _validate_definition.
        self._bwrap = bwrap
        self._sandbox_dir = sandbox_dir
        self._uid = self._choose_uid(sandbox_uid)
        self._max_processes = int(max_processes)
        self._workdir = "/"
        self._copy_root = "/"
        self._copies: list[tuple[Path, str]] = []
        self._image_env: dict[str, str] = {}
        self._problems: list[str] = []
        self._trial_dir: Path | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._pid = 0
        self._pidfd = -1
        super().__init__(*args, **kwargs)

    @staticmethod
    def _choose_uid(sandbox_uid: int | str | None) -> int | None:
        """The uid the namespace runs as: None (this process's own) unless this process is root."""
        if sandbox_uid not in (None, ""):
            uid = int(sandbox_uid)
            if os.geteuid() != 0 and uid != os.geteuid():
                raise ValueError(f"sandbox_uid={uid}: only root can run the sandbox as another uid")
            return None if uid == os.geteuid() else uid
        return ROOT_SANDBOX_UID if os.geteuid() == 0 else None

    @staticmethod
    def type() -> str:
        return ENVIRONMENT_TYPE

    @property
    def capabilities(self) -> Any:
        return EnvironmentCapabilities(disable_internet=True)

    @classmethod
    def resource_capabilities(cls) -> Any:
        return EnvironmentResourceCapabilities(memory_limit=True)

    def _validate_definition(self) -> None:
        """Read the Dockerfile subset rollwise applies and note every reason the task cannot run here
        (module docstring); `start` raises them, so that one such task costs its trials, not the job."""
        problems: list[str] = []
        if self.task_env_config.docker_image:
            problems.append(
                f"task.toml [environment] docker_image = {self.task_env_config.docker_image!r}: "
                "a prebuilt image"
            )
        workdir, copies, image_env, found = read_dockerfile(Path(self.environment_dir))
        problems += found
        if self._host_mounts:
            targets = ", ".join(str(mount["target"]) for mount in self._host_mounts)
            problems.append(f"bind mounts ({targets}) are not supported by the bubblewrap runtime")
        if shutil.which(self._bwrap) is None:
            problems.append(f"{self._bwrap!r} not found (Debian/Ubuntu: apt-get install bubblewrap)")
        for tool in ("nsenter", "prlimit"):
            if shutil.which(tool) is None:
                problems.append(f"{tool!r} not found (util-linux)")
        self._problems = problems
        self._copy_root = workdir or "/"
        self._workdir = self.task_env_config.workdir or self._copy_root
        self._copies = copies
        self._image_env = image_env

    # -- start and stop ---------------------------------------------------------------------------------

    async def start(self, force_build: bool) -> None:
        """Lay out the trial's root directory and start its namespace (no image is built, whatever
        `force_build` says). A task that cannot run here raises SandboxBuildFailedError with every
        reason (Harbor does not retry it)."""
        if self._problems:
            raise SandboxBuildFailedError(
                f"{self.environment_name} cannot run on the bubblewrap runtime: " + "; ".join(self._problems)
            )
        self._trial_dir = await asyncio.to_thread(self._make_trial_dir)
        await asyncio.to_thread(self._lay_out, self._trial_dir / "root")
        self._process, self._pid = await asyncio.to_thread(self._launch, self._trial_dir)
        self._pidfd = os.pidfd_open(self._pid)
        self.logger.debug(f"bubblewrap namespace {self._pid} for {self.session_id} in {self._trial_dir}")

    def _make_trial_dir(self) -> Path:
        parent = Path(self._sandbox_dir or tempfile.gettempdir()).resolve()
        if self._uid is not None and not _searchable_by(parent, self._uid):
            raise RuntimeError(
                f"{parent} is not reachable by uid {self._uid}, the sandbox's: name a directory that is "
                "(--ek sandbox_dir=/tmp, or TMPDIR)"
            )
        trial_dir = Path(tempfile.mkdtemp(prefix="rollwise-harbor-", dir=parent))
        os.chmod(trial_dir, 0o711)  # the sandbox's uid reaches root/ (its own), nothing else here
        return trial_dir

    def _launch(self, trial_dir: Path) -> tuple[subprocess.Popen[bytes], int]:
        """Start the namespace over `trial_dir`/root; (bwrap's process, the host pid of the namespace's
        init) once the namespace runs its first command."""
        network = NetworkMode.PUBLIC == self._network_policy.network_mode == self.task_env_config.network_mode
        argv = namespace_argv(self._bwrap, trial_dir / "root", self._workdir, network)
        ready = f"echo {READY.decode().strip()}; exec sleep infinity </dev/null >/dev/null 2>&1"
        info_read, info_write = os.pipe()
        try:
            with open(trial_dir / "bwrap.log", "wb") as log:
                process = subprocess.Popen(
                    [*argv[:-1], "--info-fd", str(info_write), "--", "/bin/sh", "-c", ready],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=log,
                    pass_fds=(info_write,),
                    start_new_session=True,
                    **self._as_sandbox_uid(),
                )
            os.close(info_write)
            info_write = -1
            assert process.stdout is not None
            readable, _, _ = select.select([process.stdout], [], [], START_TIMEOUT_S)
            line = process.stdout.readline() if readable else b""
            if line != READY:
                process.kill()
                process.wait()
                process.stdout.close()
                message = (trial_dir / "bwrap.log").read_text(errors="replace").strip()[-500:]
                raise RuntimeError(f"bubblewrap could not start the sandbox: {message or 'no output'}")
            info = json.loads(os.read(info_read, 1 << 16).decode())
            return process, int(info["child-pid"])
        finally:
            os.close(info_read)
            if info_write >= 0:
                os.close(info_write)

    def _as_sandbox_uid(self) -> dict[str, Any]:
        if self._uid is None:
            return {}
        return {"user": self._uid, "group": self._uid, "extra_groups": []}

    def _lay_out(self, root: Path) -> None:
        """The trial's `/` before the namespace starts: /tmp, /root, the WORKDIR with its COPY files,
        Harbor's output directories; owned by the sandbox's uid."""
        root.mkdir()
        for path, mode in (("tmp", 0o1777), ("root", 0o700)):
            (root / path).mkdir()
            os.chmod(root / path, mode)
        (root / self._workdir.lstrip("/")).mkdir(parents=True, exist_ok=True)
        copy_root = root / self._copy_root.lstrip("/")
        paths = EnvironmentPaths.for_os(self.os)
        outputs = {str(p) for p in (paths.agent_dir, paths.verifier_dir, paths.artifacts_dir)}
        outputs.update(str(target) for target in self._mount_targets())
        for output in sorted(outputs):
            directory = root / output.lstrip("/")
            directory.mkdir(parents=True, exist_ok=True)
            os.chmod(directory, 0o777)
        for source, relative in self._copies:
            target = copy_root / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
        if self._uid is not None:
            _chown_tree(root, self._uid)

    async def stop(self, delete: bool) -> None:
        """Kill the namespace and everything in it; remove the trial's directory when `delete`."""
        if self._pidfd >= 0:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
        if self._process is not None:
            with contextlib.suppress(ProcessLookupError):
                self._process.kill()
            await asyncio.to_thread(self._process.wait)
            if self._process.stdout is not None:
                self._process.stdout.close()
            self._process = None
        if self._pidfd >= 0:
            await asyncio.to_thread(_wait_for_exit, self._pidfd, STOP_WAIT_S)
            os.close(self._pidfd)
            self._pidfd = -1
        if self._trial_dir is not None:
            if delete:
                await asyncio.to_thread(_remove_tree, self._trial_dir)
            else:
                self.logger.info(f"kept the sandbox's files in {self._trial_dir / 'root'}")
            self._trial_dir = None

    # -- commands -------------------------------------------------------------------------------------

    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: int | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        """Run `command` with bash in the namespace, from `cwd` (default: the WORKDIR), under the
        task's limits (module docstring)."""
        who = self._resolve_user(user)
        if who not in (None, "root", 0, "0"):
            raise RuntimeError(
                f"the bubblewrap runtime runs every command as root of its namespace; user {who!r} "
                "does not exist there"
            )
        environment = {**BASE_ENV, **self._image_env, **(self._merge_env(env) or {})}
        directory = str(PurePosixPath(self._workdir) / (cwd or self._workdir))
        inner = ["/usr/bin/env", "-C", directory, "/bin/bash", "-c", command]
        code, out, err = await self._run(inner, environment, timeout_sec, limited=True)
        return ExecResult(
            stdout=out.decode(errors="replace") if out else None,
            stderr=err.decode(errors="replace") if err else None,
            return_code=code,
        )

    def _limits(self) -> list[str]:
        memory_mb = self._resource_limit_value("memory", auto_mode=ResourceMode.LIMIT)
        storage_mb = self._effective_storage_mb
        return limit_argv(
            memory_mb * 2**20 if memory_mb else None,
            storage_mb * 2**20 if storage_mb else None,
            self._max_processes,
        )

    async def _run(
        self,
        inner: list[str],
        environment: dict[str, str],
        timeout_sec: float | None,
        *,
        limited: bool,
        stdin: IO[bytes] | None = None,
        stdout: IO[bytes] | None = None,
    ) -> tuple[int, bytes, bytes]:
        """Run `inner` in the namespace: (exit code, stdout, stderr). Output goes to files, so a
        background process that keeps it open does not hold the command; a timeout or a cancelled
        caller kills the command's process group."""
        if self._process is None or self._trial_dir is None or self._process.poll() is not None:
            raise RuntimeError(f"the sandbox of {self.session_id} is not running")
        argv = [*(self._limits() if limited else []), "nsenter", "--target", str(self._pid), "--all"]
        argv += ["--root", "--wd", "--", *inner]
        with (
            tempfile.TemporaryFile(dir=self._trial_dir) as out,
            tempfile.TemporaryFile(dir=self._trial_dir) as err,
        ):
            process = await asyncio.create_subprocess_exec(
                *argv,
                stdin=stdin if stdin is not None else subprocess.DEVNULL,
                stdout=stdout if stdout is not None else out,
                stderr=err,
                env=environment,
                start_new_session=True,
            )
            try:
                await asyncio.wait_for(process.wait(), timeout_sec)
            except TimeoutError:
                raise RuntimeError(f"Command timed out after {timeout_sec} seconds") from None
            finally:
                if process.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(process.pid, signal.SIGKILL)
                    await asyncio.shield(process.wait())
            out.seek(0)
            err.seek(0)
            stdout_bytes, stderr_bytes = out.read(OUTPUT_LIMIT_BYTES), err.read(OUTPUT_LIMIT_BYTES)
        code = process.returncode
        assert code is not None
        return (128 - code if code < 0 else code), stdout_bytes, stderr_bytes

    # -- transfers ------------------------------------------------------------------------------------

    def _inside(self, path: str) -> str:
        return str(PurePosixPath(self._workdir) / path)

    async def _transfer(
        self, inner: list[str], what: str, stdin: IO[bytes] | None = None, stdout: IO[bytes] | None = None
    ) -> None:
        code, _, err = await self._run(
            inner, dict(BASE_ENV), TRANSFER_TIMEOUT_S, limited=False, stdin=stdin, stdout=stdout
        )
        if code != 0:
            raise RuntimeError(f"{what} failed (exit {code}): {err.decode(errors='replace').strip()[-500:]}")

    async def _upload_tar(self, members: list[tuple[Path, str]], target_dir: str, what: str) -> None:
        with tempfile.TemporaryFile(dir=self._trial_dir) as archive:

            def pack() -> None:
                with tarfile.open(fileobj=archive, mode="w") as tar:
                    for source, name in members:
                        tar.add(source, arcname=name)
                archive.seek(0)

            await asyncio.to_thread(pack)
            unpack = 'mkdir -p -- "$1" && exec tar -x -f - --no-same-owner -C "$1"'
            await self._transfer(["/bin/sh", "-c", unpack, "sh", target_dir], what, stdin=archive)

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        target = PurePosixPath(self._inside(target_path))
        await self._upload_tar([(Path(source_path), target.name)], str(target.parent), f"upload to {target}")

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        source = Path(source_dir)
        children = await asyncio.to_thread(lambda: sorted(source.iterdir()))
        members = [(child, child.name) for child in children]
        target = self._inside(target_dir)
        await self._upload_tar(members, target, f"upload of {source} to {target}")

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        source = self._inside(source_path)
        target = Path(target_path)

        def create() -> IO[bytes]:
            target.parent.mkdir(parents=True, exist_ok=True)
            return target.open("wb")

        try:
            with await asyncio.to_thread(create) as file:
                await self._transfer(["/bin/cat", "--", source], f"download of {source}", stdout=file)
        except BaseException:
            await asyncio.to_thread(target.unlink, missing_ok=True)
            raise

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        source = self._inside(source_dir)
        target = Path(target_dir)
        await asyncio.to_thread(target.mkdir, parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=self._trial_dir) as archive:
            await self._transfer(
                ["/usr/bin/env", "tar", "-c", "-f", "-", "-C", source, "."],
                f"download of {source}",
                stdout=archive,
            )

            def unpack() -> list[str]:
                archive.seek(0)
                skipped: list[str] = []
                with tarfile.open(fileobj=archive, mode="r") as tar:
                    for member in tar:
                        kept = _skip_unsafe(member, str(target))
                        if kept is None:
                            skipped.append(member.name)
                        else:
                            tar.extract(kept, target, filter="fully_trusted")
                return skipped

            skipped = await asyncio.to_thread(unpack)
        if skipped:
            self.logger.warning(
                f"download of {source}: skipped {', '.join(skipped[:10])} (links out or devices)"
            )
