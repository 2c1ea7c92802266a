"""The three machines of docs/scale_out.md ("Three machines"), each a network namespace with a directory
of its own, and every connection between them through the fault proxy:

    sup      B: `rollwise run` (scheduler, spool, Flight, admin; starts the learner on C by its launcher)
    learner  C: the learner (`learner.remote.run_dir`), its weight server
    eng1     A: an embedded engine serving from the start (its own fetcher: weights over HTTP)
    eng2     D: an embedded engine added with `rollwise engines add` while the run goes on, then drained
    wire     P: the fault proxy (pipeline.tools.hosts.fault_proxy); its routes:
             eng1, eng2 -> the engines; admin -> B's admin endpoint (the fetchers' weights);
             flight -> B's Flight service (the learner's spool); weights -> C's weight server

Nothing is shared but the network: each process reads and writes only its host's directory (the
engines get a copy of the initial model, as a machine with its own disk would), and each namespace
routes only 10.77.0.0/24. The learner is started through `learner.distributed.launcher = ["ip", "netns",
"exec", <C>]`, as ssh would start it on another machine. With `tls` every door speaks TLS with
certificates of a private CA, and every secret is watched on the wire (`FleetOnHosts.secrets_seen`).

`FleetOnHosts` starts it all (`start`), follows the supervisor's JSON progress (`steps`, `messages`),
adds and drains the second engine, and stops it (`stop`), leaving the books to check
(pipeline.tools.bench.soak_books.reconcile over the two run directories). `close` kills what is left by
PID and deletes the namespaces, whatever happened before.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from pipeline.contracts.run_dir import RunDir
from pipeline.contracts.tls import TlsFiles
from pipeline.tools.bench.soak_books import Books, reconcile
from pipeline.tools.hosts.fault_proxy import FaultProxy
from pipeline.tools.hosts.namespaces import Network
from pipeline.tools.hosts.private_ca import PrivateCA

HOSTS = ("sup", "learner", "eng1", "eng2", "wire")
ENGINE_PORT, ADMIN_PORT, FLIGHT_PORT, WEIGHTS_PORT = 30000, 9401, 8815, 8816
SECRETS = {
    "ROLLWISE_ADMIN_TOKEN": "admin-token-on-the-wire-never-0001",
    "ROLLWISE_TRANSPORT_TOKEN": "transport-token-on-the-wire-never-02",
    "ROLLWISE_LEARNER_TOKEN": "learner-token-on-the-wire-never-0003",
    "ROLLWISE_ENGINE_API_KEY": "engine-key-on-the-wire-never-000004",
}
# Small enough that a learner step takes well under a second on two busy cores.
TINY_RUN = """
[run]
seed = 0
shutdown_grace_s = 5.0
[model]
preset = "tiny"
[sampling]
max_new_tokens = 4
[env]
group_size = 4
max_context_tokens = 256
[rollout]
max_concurrent_groups = 4
[async]
max_staleness = 1
[learner]
batch_groups = 2
mini_batches = 1
checkpoint_every = 1
threads = 1
[learner.loss]
clip_low = 0.2
clip_high = 0.28
[logs]
max_bytes = 262144
keep = 2
check_every_s = 2.0
"""


@dataclass
class Started:
    """One process started in a host's namespace, its output in a file of that host's directory."""

    name: str
    proc: subprocess.Popen[bytes]
    log: IO[bytes]


class FleetOnHosts:
    """The fleet across namespaces (module docstring). Use as a context manager, or call `close`."""

    def __init__(self, root: Path, *, tls: bool = True, extra_config: str = "", seed: int = 0) -> None:
        self.root = root
        self.tls = tls
        self.extra_config = extra_config
        self.net = Network(HOSTS)
        self.proxy = FaultProxy(self.net.address("wire"), seed=seed, enter=lambda: self.net.enter("wire"))
        self.processes: dict[str, Started] = {}
        self.events: list[tuple[float, dict[str, Any]]] = []
        self._events_lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self.t0 = time.monotonic()
        self.certs: dict[str, TlsFiles] = {}
        self.dirs = {host: root / host for host in HOSTS}
        for directory in self.dirs.values():
            directory.mkdir(parents=True, exist_ok=True)

    # --- addresses -----------------------------------------------------------------------------------------
    def addr(self, host: str) -> str:
        return self.net.address(host)

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    def via_proxy(self, route: str, scheme: str | None = None) -> str:
        return f"{scheme or self.scheme}://{self.proxy.address(route)}"

    def engine_url(self, host: str) -> str:
        """How the supervisor reaches an engine: through the proxy."""
        return self.via_proxy(host)

    @property
    def admin_url(self) -> str:
        """B's admin endpoint as B's operator reaches it (its own address)."""
        return f"{self.scheme}://{self.addr('sup')}:{ADMIN_PORT}"

    @property
    def sup_run(self) -> RunDir:
        return RunDir.at(self.dirs["sup"] / "run")

    @property
    def learner_run(self) -> RunDir:
        return RunDir.at(self.dirs["learner"] / "run")

    # --- start ---------------------------------------------------------------------------------------------
    def start(self, *, ready_timeout_s: float = 300.0) -> None:
        """Proxy, certificates, models, the first engine and the supervisor; returns once the engine
        answers and the supervisor printed its first progress line."""
        wire = self.addr("wire")
        self.proxy.add("eng1", (self.addr("eng1"), ENGINE_PORT))
        self.proxy.add("eng2", (self.addr("eng2"), ENGINE_PORT))
        self.proxy.add("admin", (self.addr("sup"), ADMIN_PORT))
        self.proxy.add("flight", (self.addr("sup"), FLIGHT_PORT))
        self.proxy.add("weights", (self.addr("learner"), WEIGHTS_PORT))
        self.proxy.watch(*SECRETS.values())
        self.proxy.start()
        if self.tls:
            ca = PrivateCA.create(self.root / "ca")
            for host in ("sup", "learner", "eng1", "eng2"):
                # Reached through the proxy too: the certificate names the proxy's address (its VIP).
                self.certs[host] = ca.issue(host, [self.addr(host), wire])
                private = self.dirs[host] / "tls"
                private.mkdir(exist_ok=True)
                for path in (self.certs[host].cert_file, self.certs[host].key_file, self.certs[host].ca_file):
                    shutil.copy(str(path), private)  # each machine holds its own copy
                cert = self.certs[host]
                self.certs[host] = TlsFiles(
                    str(private / Path(str(cert.cert_file)).name),
                    str(private / Path(str(cert.key_file)).name),
                    str(private / "ca.pem"),
                )
        self._build_models()
        self.start_engine("eng1")
        self._write_config()
        self._start_supervisor()

    def _build_models(self) -> None:
        """The initial model on each engine machine's own disk (the same preset and seed as B and C)."""
        model = self.dirs["eng1"] / "model"
        argv = [
            sys.executable,
            "-m",
            "learner.model.model_init",
            "--out",
            str(model),
            "--preset",
            "tiny",
            "--seed",
            "0",
        ]
        subprocess.run([*argv, "--keep-existing"], check=True, capture_output=True, timeout=300)
        shutil.copytree(model, self.dirs["eng2"] / "model", dirs_exist_ok=True)

    def _env(self) -> dict[str, str]:
        return {**os.environ, **SECRETS, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}

    def _spawn(
        self, host: str, name: str, argv: list[str], *, stdout: int | IO[bytes] | None = None
    ) -> Started:
        log = open(self.dirs[host] / f"{name}.log", "ab")  # noqa: SIM115 - closed in close()
        proc = subprocess.Popen(
            self.net.argv(host, *argv),
            stdout=stdout if stdout is not None else log,
            stderr=log,
            env=self._env(),
            start_new_session=True,
        )
        started = Started(name, proc, log)
        self.processes[name] = started
        return started

    def start_engine(self, host: str) -> None:
        d = self.dirs[host]
        argv = [
            sys.executable, "-m", "pipeline.engine", "--model", str(d / "model"), "--host", self.addr(host),
            "--port", str(ENGINE_PORT), "--weight-version", "0", "--threads", "1", "--max-batch", "16",
            "--seed", "0", "--weights-dir", str(d / "weights"), "--enable-metrics",
        ]  # fmt: skip
        if self.tls:
            cert = self.certs[host]
            argv += ["--ssl-certfile", str(cert.cert_file), "--ssl-keyfile", str(cert.key_file)]
            argv += ["--ssl-ca-certs", str(cert.ca_file)]
        else:
            argv.append("--allow-plaintext")
        self._spawn(host, f"engine-{host}", argv)

    def _write_config(self) -> None:
        sup, learner = self.certs.get("sup"), self.certs.get("learner")
        tls = ""
        learner_tls = ""
        if sup is not None and learner is not None:
            tls = (
                f'[tls]\ncert_file = "{sup.cert_file}"\nkey_file = "{sup.key_file}"\n'
                f'ca_file = "{sup.ca_file}"\n'
            )
            learner_tls = (
                f'tls_cert_file = "{learner.cert_file}"\ntls_key_file = "{learner.key_file}"\n'
                f'tls_ca_file = "{learner.ca_file}"\n'
            )
        else:
            tls = "[tls]\nallow_plaintext = true\n"
        flight_scheme = "grpc+tls" if self.tls else "grpc"
        text = f"""{TINY_RUN}
[engine]
kind = "external"
urls = ["{self.engine_url("eng1")}"]
weight_transport = "http"
request_timeout_s = 20.0
drain_timeout_s = 5.0
unavailable_timeout_s = 900.0
[metrics]
port = 9400
[admin]
host = "{self.addr("sup")}"
port = {ADMIN_PORT}
advertise_url = "{self.via_proxy("admin")}"
[transport]
kind = "flight"
flight_host = "{self.addr("sup")}"
flight_port = {FLIGHT_PORT}
[learner.distributed]
launcher = ["ip", "netns", "exec", "{self.net.namespace("learner")}"]
[learner.remote]
run_dir = "{self.learner_run.root}"
spool_url = "{self.via_proxy("flight", flight_scheme)}"
weights_host = "{self.addr("learner")}"
weights_port = {WEIGHTS_PORT}
weights_url = "{self.via_proxy("weights")}"
{learner_tls}
{tls}
{self.extra_config}
"""
        (self.dirs["sup"] / "fleet.toml").write_text(text)

    def _start_supervisor(self) -> None:
        argv = [
            sys.executable, "-m", "pipeline.cli", "run", "--config", str(self.dirs["sup"] / "fleet.toml"),
            "--run-dir", str(self.sup_run.root), "--log-format", "json",
        ]  # fmt: skip
        started = self._spawn("sup", "supervisor", argv, stdout=subprocess.PIPE)
        self._reader = threading.Thread(target=self._read_events, args=(started.proc,), daemon=True)
        self._reader.start()

    def _read_events(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            try:
                event = json.loads(raw)
            except ValueError:
                continue
            if isinstance(event, dict):
                with self._events_lock:
                    self.events.append((time.monotonic() - self.t0, event))

    # --- following the run ---------------------------------------------------------------------------------
    def now(self) -> float:
        return time.monotonic() - self.t0

    def snapshot(self, kind: str | None = None) -> list[tuple[float, dict[str, Any]]]:
        with self._events_lock:
            return [(t, e) for t, e in self.events if kind is None or e.get("event") == kind]

    def steps(self) -> list[tuple[float, int]]:
        return [(t, int(e["step"])) for t, e in self.snapshot("step")]

    def messages(self, since_s: float = 0.0) -> list[str]:
        return [str(e.get("text")) for t, e in self.snapshot("message") if t >= since_s]

    def wait_until(self, condition: Callable[[], bool], timeout_s: float, why: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            proc = self.processes["supervisor"].proc
            if proc.poll() is not None:
                raise AssertionError(f"the supervisor exited ({proc.returncode}) before {why}\n{self.tail()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {why}\n{self.tail()}")
            time.sleep(0.2)

    def wait_steps(self, n: int, timeout_s: float) -> None:
        """Until `n` more learner steps than now have been reported."""
        target = len(self.steps()) + n
        self.wait_until(lambda: len(self.steps()) >= target, timeout_s, f"{n} more learner steps")

    def tail(self, n: int = 30) -> str:
        parts = []
        for name in ("supervisor",):
            path = self.dirs["sup"] / f"{name}.log"
            if path.exists():
                parts.append(f"--- {path}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-n:]))
        learner_log = self.sup_run.logs / "learner.log"
        if learner_log.exists():
            parts.append(
                "--- learner.log\n" + "\n".join(learner_log.read_text(errors="replace").splitlines()[-n:])
            )
        parts.append("--- last events\n" + "\n".join(json.dumps(e)[:300] for _, e in self.snapshot()[-8:]))
        return "\n".join(parts)

    def rollwise_engines(self, *args: str, timeout_s: float = 300.0) -> subprocess.CompletedProcess[str]:
        """`rollwise engines ...` run on B against its admin endpoint, as its operator would."""
        argv = [
            sys.executable,
            "-m",
            "pipeline.cli",
            "engines",
            "--admin",
            self.admin_url,
            "--timeout",
            "280",
        ]
        if self.tls:
            argv += ["--ca-file", str(self.certs["sup"].ca_file)]
        return subprocess.run(
            self.net.argv("sup", *argv, *args),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=self._env(),
        )

    # --- stop ----------------------------------------------------------------------------------------------
    def stop(self, timeout_s: float = 120.0) -> int:
        """SIGTERM the supervisor (it checkpoints and stops the learner), then the engines; its exit code."""
        sup = self.processes["supervisor"].proc
        if sup.poll() is None:
            sup.send_signal(signal.SIGTERM)
        try:
            code = sup.wait(timeout_s)
        except subprocess.TimeoutExpired:
            sup.kill()
            code = sup.wait()
        for name, started in self.processes.items():
            if name != "supervisor" and started.proc.poll() is None:
                started.proc.send_signal(signal.SIGTERM)
        for started in self.processes.values():
            try:
                started.proc.wait(30)
            except subprocess.TimeoutExpired:
                started.proc.kill()
                started.proc.wait()
        return code

    def books(self) -> Books:
        return reconcile(self.sup_run, learner=self.learner_run)

    def close(self) -> None:
        """Kill what still runs (by PID), stop the proxy, delete the namespaces. Idempotent."""
        for started in self.processes.values():
            if started.proc.poll() is None:
                started.proc.kill()
                started.proc.wait()
            started.log.close()
        if self._reader is not None:
            self._reader.join(10)  # the supervisor's stdout ends with it
        for started in self.processes.values():
            if started.proc.stdout is not None:
                started.proc.stdout.close()
        self.proxy.stop()
        self.net.close()

    def __enter__(self) -> FleetOnHosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
