"""Host staging for async save: copy the state's arrays into a reused buffer, so training can go on.

One buffer per save in flight, reused from save to save (grown only when the state grows), so steady-state
async saving allocates nothing. Copies run on a few threads (NumPy and torch release the GIL while
copying). Accelerator tensors are copied into page-locked (pinned) memory when torch can provide it.

The buffer is written only under its lock, and :meth:`StagingBuffer.reserve` touches only memory it has just
allocated, so a reservation that runs late never writes into bytes a save staged.
"""

from __future__ import annotations

import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import numpy as np

from ..frameworks import numpy_adapter
from ..save import Snapshot, _Entry

_ALIGN = 64


class StagingBuffer:
    """A reusable host buffer holding one snapshot's arrays."""

    def __init__(self) -> None:
        self._buf: np.ndarray | None = None
        self._pinned: Any = None  # torch tensor keeping pinned memory alive
        self.in_use = threading.Event()
        self._lock = threading.Lock()  # held while the buffer is (re)allocated or written

    @property
    def capacity(self) -> int:
        return 0 if self._buf is None else int(self._buf.nbytes)

    def _ensure(self, nbytes: int, pinned: bool) -> tuple[np.ndarray, bool]:
        """The buffer, at least ``nbytes`` long, and whether it was just allocated (no byte written yet)."""
        if self._buf is not None and self._buf.nbytes >= nbytes and (self._pinned is not None or not pinned):
            return self._buf, False
        self._buf, self._pinned = None, None
        if pinned:  # pragma: no cover - needs a GPU
            import torch

            self._pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            self._buf = self._pinned.numpy()
        else:
            self._buf = np.empty(nbytes, dtype=np.uint8)
        return self._buf, True

    def reserve(self, snapshot: Snapshot) -> None:
        """Allocate the buffer for a state like ``snapshot`` and touch every page now, so the first
        async save does not pay for fresh memory (on some VMs that triples the copy's cost).

        A buffer that already exists is left alone: its pages are touched, and a save may have staged into
        it (this runs on a helper thread, possibly after the first save began).
        """
        total = _layout(snapshot)[1]
        on_device = any(_on_accelerator(e.value) for e in snapshot.entries)
        with self._lock:
            buf, fresh = self._ensure(total, pinned=on_device)
            if fresh:
                buf[::4096] = 0

    def stage(self, snapshot: Snapshot, threads: int = 2) -> Snapshot:
        """A snapshot whose arrays live in this buffer; the originals may change freely afterwards."""
        offsets, total = _layout(snapshot)
        on_device = any(_on_accelerator(e.value) for e in snapshot.entries)
        with self._lock:  # through the copy: nothing reallocates or writes the buffer meanwhile
            buf, _ = self._ensure(total, pinned=on_device)
            jobs = [(e, buf[o : o + e.nbytes]) for e, o in zip(snapshot.entries, offsets)]
            if threads > 1 and total > (64 << 20):
                lanes: list[list[tuple[_Entry, Any]]] = [[] for _ in range(threads)]
                loads = [0] * threads
                for job in sorted(jobs, key=lambda j: -j[0].nbytes):
                    i = loads.index(min(loads))
                    lanes[i].append(job)
                    loads[i] += job[0].nbytes
                with ThreadPoolExecutor(threads, thread_name_prefix="trainstate-stage") as pool:
                    list(pool.map(_copy_lane, lanes))
            else:
                _copy_lane(jobs)
            if on_device:  # pragma: no cover - needs a GPU
                import torch

                torch.cuda.synchronize()
        staged = [replace(e, value=dst.view(np.uint8), adapter=numpy_adapter) for e, dst in jobs]
        return Snapshot(snapshot.tree, snapshot.metadata, staged)


def _layout(snapshot: Snapshot) -> tuple[list[int], int]:
    """Each entry's offset in the buffer (cache-line aligned) and the total size."""
    offsets, total = [], 0
    for e in snapshot.entries:
        offsets.append(total)
        total += -(-e.nbytes // _ALIGN) * _ALIGN
    return offsets, total


def _copy_lane(jobs: list[tuple[_Entry, Any]]) -> None:
    for entry, dst in jobs:
        if _on_accelerator(entry.value):  # pragma: no cover - needs a GPU
            import torch

            src = entry.value.detach().contiguous().reshape(-1).view(torch.uint8)
            torch.from_numpy(dst).copy_(src, non_blocking=True)
        else:
            np.copyto(dst, np.frombuffer(entry.adapter.byte_view(entry.value), dtype=np.uint8))


def _on_accelerator(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor) and value.device.type not in ("cpu", "meta")
