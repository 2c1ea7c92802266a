"""Weight exports written on a thread while the learner trains on (learner.export_in_background).

Writing a version is I/O on a copy: the learner copies its weights into a `WeightSnapshot` (buffers
allocated once, on the CPU), hands the write to `BackgroundExport` and starts its next step. One export
runs at a time, and a publish waits for the previous one before it snapshots: versions are published in
order and none is skipped, the same ones the inline export published; the learner waits only when
writing a version takes longer than training one. The cost is one CPU copy of the weights.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

import torch


def _alias_key(tensor: torch.Tensor) -> tuple[object, ...]:
    """Two state-dict entries with the same key are one tensor (tied embeddings): one buffer for both."""
    return (
        tensor.device,
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.dtype,
    )


class WeightSnapshot:
    """CPU copies of a model's state dict, refreshed in place by `take`.

    Entries that share their tensor in the model share their buffer here, so `save_pretrained` sees the
    same tied weights it sees in the model. Pinned buffers for CUDA tensors (a faster copy to the host).
    """

    def __init__(self) -> None:
        self._names: tuple[str, ...] = ()
        self._layout: tuple[tuple[object, ...], ...] = ()
        self._state: dict[str, torch.Tensor] = {}

    def take(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copy `state` (a model's `state_dict()`) into the buffers; returns them by name. The buffers are
        overwritten by the next `take`: a writer must be done with them first."""
        # Parameters are updated in place, so this layout holds from one step to the next; anything else
        # (a reloaded model) allocates afresh.
        layout = tuple(_alias_key(t) for t in state.values())
        if tuple(state) != self._names or layout != self._layout:
            self._allocate(state, layout)
            self._names, self._layout = tuple(state), layout
        with torch.no_grad():
            copied: set[int] = set()
            for name, tensor in state.items():
                buffer = self._state[name]
                if id(buffer) not in copied:
                    buffer.copy_(tensor.detach())
                    copied.add(id(buffer))
        return dict(self._state)

    def _allocate(self, state: Mapping[str, torch.Tensor], keys: tuple[tuple[object, ...], ...]) -> None:
        buffers: dict[tuple[object, ...], torch.Tensor] = {}
        self._state = {}
        for (name, tensor), key in zip(state.items(), keys, strict=True):
            if key not in buffers:
                pin = tensor.is_cuda and torch.cuda.is_available()
                buffers[key] = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
            self._state[name] = buffers[key]


class BackgroundExport:
    """At most one export job on a thread of its own; its failure is raised in the learner's thread."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, job: Callable[[], None], *, name: str) -> None:
        """Run `job` on a new thread once the previous job is done (`wait`)."""
        self.wait()
        thread = threading.Thread(target=self._run, args=(job,), name=name)
        self._thread = thread
        thread.start()

    def _run(self, job: Callable[[], None]) -> None:
        try:
            job()
        except BaseException as exc:  # raised again in the learner's thread: `check`, `wait`
            self._error = exc

    def wait(self) -> None:
        """Block until the running job is done; raise what it raised."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.check()

    def check(self) -> None:
        """Raise what a finished job raised (once)."""
        if self._error is not None:
            error, self._error = self._error, None
            raise error
