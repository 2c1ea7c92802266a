"""The spool over the network: an Arrow Flight service beside the durable spool, and its reader.

The spool stays the source of truth (Contract 4); Flight only serves it, so exactly-once is the
local reader's rule carried over a connection:

- `get_flight_info(command {"after_seq": n, "limit": k, "wait_s": w})` lists the complete spool files
  with seq > n in sequence order (at most k; waiting up to w seconds on the server for the first one),
  one endpoint each, whose ticket is the file's sequence number (`{"seq": s}`).
- `do_get(ticket)` streams that one group: its record batch under the file's own schema, metadata
  (`rollwise.group_id`, schema version) included. A file that cannot be used is quarantined by the
  service (the supervisor owns the directory) and the stream carries no batch and the schema metadata
  `rollwise.quarantined` = {"file", "kind", "reason"}; a file pruned in between carries
  `rollwise.missing`.
- `do_action("depth", {"after_seq", "consumed"?})` -> {"groups", "bytes"} (`consumed`: seqs after it the
  learner took out of order, not counted); `do_action("prune", {"through_seq"})` applies retention
  (`prune_consumed`) for a learner whose checkpoints say what it consumed.

`FlightSpoolReader` has SpoolReader's interface. Its position is the last sequence number it returned
(or reported quarantined); each poll asks for files after it, so a broken connection costs a retry,
never a group: a group is returned only once its whole batch arrived, and then never again. The
learner's checkpoint records the same consumed sequence as with the local reader.

Auth: with `token`, every call needs the header `authorization: Bearer <token>`.
"""

from __future__ import annotations

import hmac
import json
import logging
import threading
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.flight as flight

from pipeline.contracts.http_guard import CannotListen, check_port_free
from pipeline.transport.spool import (
    QuarantinedFile,
    SpoolItem,
    _listed,
    _Unusable,
    prune_consumed,
    read_group_file,
    spool_depth,
    spool_name,
)

log = logging.getLogger(__name__)

QUARANTINED_KEY = b"rollwise.quarantined"
MISSING_KEY = b"rollwise.missing"
LIST_POLL_S = 0.02
LIST_GRACE_S = 10.0
# gRPC keepalive: a connection whose peer vanished (a partition) fails its calls within about
# KEEPALIVE_MS + KEEPALIVE_TIMEOUT_MS instead of waiting for each call's timeout.
KEEPALIVE_MS, KEEPALIVE_TIMEOUT_MS = 10_000, 5_000
_EMPTY = pa.schema([])
_CONNECTION_ERRORS = (flight.FlightUnavailableError, flight.FlightTimedOutError, flight.FlightCancelledError)


class _TokenMiddlewareFactory(flight.ServerMiddlewareFactory):
    def __init__(self, token: str) -> None:
        super().__init__()
        self._expected = f"Bearer {token}"

    def start_call(self, info: Any, headers: dict[str, list[str]]) -> None:
        given = headers.get("authorization", [""])
        if not given or not hmac.compare_digest(given[0].encode(), self._expected.encode()):
            raise flight.FlightUnauthenticatedError("missing or wrong token (authorization: Bearer ...)")
        return None


class _SpoolServer(flight.FlightServerBase):
    def __init__(
        self, spool_dir: Path, location: str, token: str | None, tls: tuple[bytes, bytes] | None
    ) -> None:
        middleware = {"token": _TokenMiddlewareFactory(token)} if token else {}
        certificates = [flight.CertKeyPair(*tls)] if tls is not None else []
        super().__init__(location, middleware=middleware, tls_certificates=certificates)
        self.spool_dir = spool_dir
        self._quarantine_lock = threading.Lock()  # do_get calls run on gRPC's thread pool

    # --- listing ------------------------------------------------------------------------------------------
    def get_flight_info(self, context: Any, descriptor: flight.FlightDescriptor) -> flight.FlightInfo:
        try:
            command = json.loads(descriptor.command)
            after_seq, limit = int(command["after_seq"]), int(command.get("limit", 64))
            wait_s = min(30.0, max(0.0, float(command.get("wait_s", 0.0))))
        except (ValueError, KeyError, TypeError) as exc:
            raise flight.FlightServerError(
                f"bad spool listing command {descriptor.command!r}: {exc}"
            ) from exc
        deadline = time.monotonic() + wait_s
        while True:
            found = [(seq, path) for seq, path in _listed(self.spool_dir) if seq > after_seq][: max(1, limit)]
            if found or time.monotonic() >= deadline or context.is_cancelled():
                break
            time.sleep(LIST_POLL_S)
        endpoints = [flight.FlightEndpoint(json.dumps({"seq": seq}).encode(), []) for seq, _ in found]
        return flight.FlightInfo(_EMPTY, descriptor, endpoints, -1, -1)

    # --- one group ----------------------------------------------------------------------------------------
    def do_get(self, context: Any, ticket: flight.Ticket) -> flight.RecordBatchStream:
        try:
            seq = int(json.loads(ticket.ticket)["seq"])
        except (ValueError, KeyError, TypeError) as exc:
            raise flight.FlightServerError(f"bad ticket {ticket.ticket!r}: {exc}") from exc
        path = self.spool_dir / spool_name(seq)
        try:
            _, batch = read_group_file(path)
        except FileNotFoundError:
            return _note(MISSING_KEY, {"seq": seq})
        except _Unusable as bad:
            with self._quarantine_lock:
                moved = _quarantine(self.spool_dir, seq, path, bad.kind, bad.reason)
            return _note(
                QUARANTINED_KEY, {"seq": seq, "file": moved.file, "kind": moved.kind, "reason": moved.reason}
            )
        return flight.RecordBatchStream(pa.Table.from_batches([batch]))

    # --- depth and retention -------------------------------------------------------------------------------
    def do_action(self, context: Any, action: flight.Action) -> list[bytes]:
        try:
            body = json.loads(action.body.to_pybytes() or b"{}")
            if action.type == "depth":
                consumed = {int(s) for s in body.get("consumed", [])}
                groups, nbytes = spool_depth(self.spool_dir, int(body["after_seq"]), consumed=consumed)
                return [json.dumps({"groups": groups, "bytes": nbytes}).encode()]
            if action.type == "prune":
                deleted = prune_consumed(self.spool_dir, int(body["through_seq"]))
                return [json.dumps({"deleted": deleted}).encode()]
        except (ValueError, KeyError, TypeError) as exc:
            raise flight.FlightServerError(f"bad {action.type} action: {exc}") from exc
        raise flight.FlightServerError(f"unknown action {action.type!r} (depth, prune)")

    def list_actions(self, context: Any) -> list[tuple[str, str]]:
        return [("depth", "groups and bytes after a sequence number"), ("prune", "delete consumed files")]


def _note(key: bytes, value: dict[str, Any]) -> flight.RecordBatchStream:
    schema = pa.schema([], metadata={key: json.dumps(value).encode()})
    return flight.RecordBatchStream(pa.Table.from_batches([], schema=schema))


def _quarantine(spool_dir: Path, seq: int, path: Path, kind: str, reason: str) -> QuarantinedFile:
    from pipeline.transport.spool import SpoolReader

    # The local reader's quarantine, so the directory looks the same whoever found the file unusable.
    return SpoolReader(spool_dir, after_seq=seq - 1)._quarantine(seq, path, kind, reason)


class SpoolFlightService:
    """The Flight service over `spool_dir`, served from its own threads (`start`, `stop`). With `tls`
    (PEM certificate, PEM key) it speaks gRPC over TLS (grpc+tls://)."""

    def __init__(
        self,
        spool_dir: str | Path,
        *,
        host: str,
        port: int,
        token: str | None = None,
        tls: tuple[bytes, bytes] | None = None,
    ) -> None:
        self.spool_dir = Path(spool_dir)
        self.spool_dir.mkdir(parents=True, exist_ok=True)
        self.host = host
        self.scheme = "grpc+tls" if tls is not None else "grpc"
        # gRPC reports a failed bind as "Server did not start properly": the probe names the cause.
        check_port_free("the Flight spool service", host, port, "transport.flight_port")
        location = f"{'grpc+tls' if tls is not None else 'grpc+tcp'}://{host}:{port}"
        try:
            self._server = _SpoolServer(self.spool_dir, location, token, tls)
        except pa.ArrowException as exc:
            raise CannotListen(
                f"the Flight spool service cannot listen on {host}:{port}: {exc}; check "
                "transport.flight_host and transport.flight_port"
            ) from None
        self.port = int(self._server.port)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"

    def start(self) -> None:
        self._thread = threading.Thread(target=self._server.serve, name="spool-flight", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop serving (in-flight calls end); idempotent. Blocks: async callers use a thread."""
        self._server.shutdown()
        if self._thread is not None:
            self._thread.join(timeout=10.0)
            self._thread = None


class FlightSpoolReader:
    """SpoolReader's interface over a SpoolFlightService (module docstring). Not thread-safe."""

    def __init__(
        self,
        url: str,
        *,
        after_seq: int,
        token: str | None = None,
        wait_s: float = 1.0,
        timeout_s: float = 60.0,
        clock: Callable[[], float] = time.perf_counter,
        tls_root_certs: bytes | None = None,
    ) -> None:
        self.url = url
        self._tls_root_certs = tls_root_certs  # the CA bundle a grpc+tls:// service is checked against
        self.after_seq = after_seq
        self.wait_s = wait_s
        self.quarantined: list[QuarantinedFile] = []
        self.read_seconds = 0.0
        self.reconnects = 0
        self._lost_in_a_row = 0  # failed polls since the last one that answered: the retry's backoff
        self.unreachable_since: float | None = None  # monotonic time of the first failed poll in a row
        self._reachability: list[tuple[bool, str]] = []  # (blocked, message), for drain_reachability
        self._clock = clock
        headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
        self._options = flight.FlightCallOptions(timeout=timeout_s + wait_s, headers=headers)
        # A listing that the server answers within wait_s: past LIST_GRACE_S more, the network is gone (a
        # partition drops packets without a word), and the learner should say so, not hang a minute.
        self._list_options = flight.FlightCallOptions(
            timeout=wait_s + min(timeout_s, LIST_GRACE_S), headers=headers
        )
        self._client: flight.FlightClient | None = None

    def _connection(self) -> flight.FlightClient:
        if self._client is None:
            location = self.url.replace("grpc://", "grpc+tcp://", 1)
            roots = {"tls_root_certs": self._tls_root_certs} if self._tls_root_certs is not None else {}
            keepalive = [
                ("grpc.keepalive_time_ms", KEEPALIVE_MS),
                ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
            ]
            self._client = flight.FlightClient(location, generic_options=keepalive, **roots)
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def take_read_seconds(self) -> float:
        seconds, self.read_seconds = self.read_seconds, 0.0
        return seconds

    def poll(self, limit: int | None = None, *, wait: bool = True) -> list[SpoolItem]:
        """Groups after the last one returned, in sequence order (at most `limit`); waits up to `wait_s`
        on the server for the first, or not at all with `wait=False` (a caller that has work in hand).
        A broken connection returns what fully arrived before it."""
        items: list[SpoolItem] = []
        try:
            self._poll(limit, items, self.wait_s if wait else 0.0)
        except (
            flight.FlightUnavailableError,
            flight.FlightTimedOutError,
            flight.FlightCancelledError,
        ) as exc:
            self.reconnects += 1
            self._lost_in_a_row += 1
            log.warning(
                "spool service %s unreachable (%s); resuming after seq %d", self.url, exc, self.after_seq
            )
            self._lost(exc)
            self.close()
            time.sleep(min(1.0, 0.1 * self._lost_in_a_row))
        except (flight.FlightInternalError, OSError) as exc:
            self.reconnects += 1
            log.warning("spool service %s: %s; resuming after seq %d", self.url, exc, self.after_seq)
            self._lost(exc)
            self.close()
        else:
            self._lost_in_a_row = 0
            if self.unreachable_since is not None:
                lasted = time.monotonic() - self.unreachable_since
                self.unreachable_since = None
                self._reachability.append(
                    (False, f"the spool service {self.url} answers again after {lasted:.1f} s")
                )
        return items

    def _lost(self, exc: Exception) -> None:
        if self.unreachable_since is None:
            self.unreachable_since = time.monotonic()
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            self._reachability.append(
                (
                    True,
                    f"the spool service {self.url} is unreachable ({first_line}); the learner retries and "
                    f"resumes after seq {self.after_seq}",
                )
            )

    def drain_reachability(self) -> list[tuple[bool, str]]:
        """Changes of reachability since the last call: (blocked, message), one per outage and recovery."""
        out, self._reachability = self._reachability, []
        return out

    def _poll(self, limit: int | None, items: list[SpoolItem], wait_s: float) -> None:
        client = self._connection()
        command = {"after_seq": self.after_seq, "limit": limit or 64, "wait_s": wait_s}
        descriptor = flight.FlightDescriptor.for_command(json.dumps(command))
        info = client.get_flight_info(descriptor, self._list_options)
        started = self._clock()
        try:
            for endpoint in info.endpoints:
                seq = int(json.loads(endpoint.ticket.ticket)["seq"])
                table = client.do_get(endpoint.ticket, self._options).read_all()
                metadata = table.schema.metadata or {}
                if QUARANTINED_KEY in metadata:
                    note = json.loads(metadata[QUARANTINED_KEY])
                    self.quarantined.append(QuarantinedFile(seq, note["file"], note["kind"], note["reason"]))
                    self.after_seq = seq
                    # As SpoolReader: a quarantine follows every group returned with it, never precedes one.
                    return
                if MISSING_KEY not in metadata:
                    batch = _one_batch(table)
                    items.append(
                        SpoolItem(seq=seq, group_id=_group_id(batch), batch=batch, nbytes=batch.nbytes)
                    )
                self.after_seq = seq
        finally:
            self.read_seconds += self._clock() - started

    def drain_quarantined(self) -> list[QuarantinedFile]:
        out, self.quarantined = self.quarantined, []
        return out

    def depth(self, after_seq: int | None = None, *, consumed: Collection[int] = ()) -> tuple[int, int]:
        position = self.after_seq if after_seq is None else after_seq
        reply = self._action("depth", {"after_seq": position, "consumed": sorted(consumed)})
        return (int(reply["groups"]), int(reply["bytes"])) if reply else (0, 0)

    def prune(self, through_seq: int) -> int:
        reply = self._action("prune", {"through_seq": through_seq})
        return int(reply["deleted"]) if reply else 0

    def _action(self, name: str, body: dict[str, Any]) -> dict[str, Any] | None:
        try:
            results = list(
                self._connection().do_action(flight.Action(name, json.dumps(body).encode()), self._options)
            )
        except (flight.FlightUnavailableError, flight.FlightTimedOutError, flight.FlightInternalError) as exc:
            log.warning("spool service %s: %s failed: %s", self.url, name, exc)
            self.close()
            return None
        return dict(json.loads(results[0].body.to_pybytes())) if results else None


def _one_batch(table: pa.Table) -> pa.RecordBatch:
    """The group's single record batch, under the file's schema (metadata included); a group whose
    episodes all failed has no rows."""
    batches = table.to_batches()
    if len(batches) == 1:
        return batches[0]
    return pa.RecordBatch.from_arrays(
        [table.column(i).combine_chunks() for i in range(table.num_columns)], schema=table.schema
    )


def _group_id(batch: pa.RecordBatch) -> str:
    stamped = (batch.schema.metadata or {}).get(b"rollwise.group_id")
    return stamped.decode() if stamped is not None else str(batch.column("group_id")[0].as_py())
