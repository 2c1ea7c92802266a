"""The learner as several processes under torchrun: which rank this is, its device, the process group, and
the few collectives the learner's own logic needs (the model's are FSDP2's: learner.sharding).

torchrun gives every rank RANK, WORLD_SIZE and LOCAL_RANK plus the rendezvous; `join` turns them into a
`Ranks`. Rank 0 leads: it alone reads the supervisor's stdin, tails the spool, decides what happens next and
broadcasts it (learner.process), so every rank enters the same collectives in the same order. Objects and
counts travel over a gloo group even when the model's collectives run on NCCL, so they need no GPU and no
device synchronisation.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist

log = logging.getLogger("rollwise.learner")

T = TypeVar("T")
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Ranks:
    """This process's place among the learner's ranks. `control` is the gloo group for objects and counts
    (None when the default group is gloo already)."""

    rank: int
    world: int
    local_rank: int
    device: torch.device
    control: dist.ProcessGroup | None = None

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def broadcast(self, obj: T) -> T:
        """Rank 0's `obj`, on every rank (the others pass anything, e.g. None)."""
        box: list[Any] = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control, device=torch.device("cpu"))
        return box[0]

    def gather(self, obj: T) -> list[T]:
        """Every rank's `obj`, in rank order, on every rank."""
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.control)
        return out

    def sum_counts(self, counts: Sequence[int]) -> list[int]:
        """Element-wise sum of integer counts over the ranks (exact: int64)."""
        tensor = torch.tensor(list(counts), dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.control)
        return [int(v) for v in tensor.tolist()]

    def all_true(self, flag: bool) -> bool:
        """True when `flag` is true on every rank: a decision every rank must take alike."""
        return self.sum_counts([0 if flag else 1])[0] == 0


def share(indices: Sequence[int], rank: int, world: int) -> list[int]:
    """The part of a mini-batch (sequence indices) rank `rank` of `world` trains: every `world`-th one from
    position `rank`. Disjoint across ranks, together exactly `indices`, and a pure function of its inputs."""
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, {world}), got {rank}")
    return list(indices[rank::world])


def rank_environment() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) as torchrun sets them; None when not started by it."""
    if "WORLD_SIZE" not in os.environ:
        return None
    try:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    except (KeyError, ValueError) as exc:
        raise RuntimeError(f"torchrun's RANK, WORLD_SIZE and LOCAL_RANK are incomplete: {exc}") from exc


def rank_device(device_name: str, local_rank: int) -> torch.device:
    """The device of one rank: `cuda` (or `auto` with a GPU) is the local rank's GPU, else the CPU."""
    if device_name == "auto":
        device_name = "cuda" if torch.cuda.is_available() else "cpu"
    if device_name == "cpu":
        return torch.device("cpu")
    if device_name != "cuda":
        raise ValueError(f"unknown device {device_name!r}; expected 'auto', 'cpu' or 'cuda'")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise ValueError(
            f"learner rank with local rank {local_rank} needs a GPU of its own, this node has {count}: "
            "learner.distributed.nproc must not exceed the GPUs per node"
        )
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def join(world_size: int, device_name: str) -> Ranks | None:
    """Join the learner's process group; None when the config asks for one process and torchrun did not
    start this one. Raises when the two disagree (the supervisor starts torchrun with the config's sizes)."""
    found = rank_environment()
    if found is None or (found[1] == 1 and world_size == 1):
        if world_size > 1:
            raise RuntimeError(
                f"learner.distributed.nproc x learner.distributed.nnodes = {world_size}, but torchrun did "
                "not start this process (no WORLD_SIZE); `rollwise run` starts the learner through torchrun"
            )
        return None
    rank, world, local_rank = found
    if world != world_size:
        raise RuntimeError(
            f"torchrun started {world} ranks, the config's learner.distributed.nproc x "
            f"learner.distributed.nnodes is {world_size}"
        )
    device = rank_device(device_name, local_rank)
    if device.type == "cuda":
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device)
        control = dist.new_group(backend="gloo")
    else:
        dist.init_process_group("gloo")
        control = None
    log.info("rank %d of %d (local rank %d) on %s", rank, world, local_rank, device)
    return Ranks(rank=rank, world=world, local_rank=local_rank, device=device, control=control)


def leave(ranks: Ranks | None) -> None:
    """Tear the process group down together (a clean exit; torchrun kills the ranks of a failed one): no
    rank closes its connections while another still uses them."""
    if ranks is not None and dist.is_initialized():
        dist.barrier(group=ranks.control)
        dist.destroy_process_group()


def follow_launcher() -> None:
    """For a rank: die with the torchrun agent that started it (as the agent dies with the supervisor), and
    never write to the supervisor's event stream, which carries rank 0's events alone."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() == 1:  # the agent was gone before the request above
        raise SystemExit("learner rank: its torchrun agent has exited")


def quiet_stdout() -> None:
    """Point this process's stdout at its stderr: a stray print must never reach the supervisor."""
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    sys.stdout = sys.stderr


CommandKind = Literal["train", "publish", "checkpoint", "wait", "stop"]


@dataclass(frozen=True)
class Command:
    """What rank 0 tells the other ranks to do next, so that all enter the same collectives: train the
    spool groups `seqs`, publish (with the served-policy check's `probe` ids: its forward is a collective
    too), checkpoint, wait (nothing: it keeps their idle broadcast from timing out) or stop."""

    kind: CommandKind
    seqs: tuple[int, ...] = ()
    probe: tuple[int, ...] = ()
