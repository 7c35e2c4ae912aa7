"""Host staging for async save: copy the state's arrays into a reused buffer, so training can go on.

One buffer per save in flight, reused from save to save (grown only when the state grows), so steady-state
async saving allocates nothing. Copies run on a few threads (NumPy and torch release the GIL while
copying). Accelerator arrays are copied into page-locked (pinned) memory where their framework provides
it (its adapter's ``staging`` and ``copy_out``: nothing here names a framework).

Host memory is an anonymous mapping marked ``MADV_DONTFORK`` (Linux). A ``fork()`` -- DataLoader workers,
typically started right after the buffer was reserved -- otherwise makes every page of the buffer
copy-on-write shared with the children, and the next save's copy faults on and copies each page again
(bench/bench_fork.py, 273 MB: one fault per page, 0.5-1.1 s instead of 0.07-0.15 s). The children never use
the buffer, so they do not get it at all.

The buffer is written only under its lock, and :meth:`StagingBuffer.reserve` touches only memory it has just
allocated, so a reservation that runs late never writes into bytes a save staged.
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import numpy as np

from trainstate._cores import DEFAULT_THREADS
from trainstate._frameworks import numpy_adapter
from trainstate._save.encode import Entry, Snapshot
from trainstate.errors import CheckpointError

_ALIGN = 64

# The host mappings this module made. A forked child has not got their pages (MADV_DONTFORK) and, once it
# maps something else at the same address, freeing one of them would unmap that: so at a fork the child
# moves them to _INHERITED, which is never freed.
_MAPPINGS: weakref.WeakSet[mmap.mmap] = weakref.WeakSet()
_INHERITED: list[mmap.mmap] = []
_fork_hook_registered = False  # a race registers it twice, which is harmless


class StagingBuffer:
    """A reusable host buffer holding one snapshot's arrays."""

    def __init__(self) -> None:
        self._buf: np.ndarray | None = None
        self._pinned = False  # whether _buf is a framework's staging memory for accelerator arrays
        self._pid = os.getpid()  # the process whose memory _buf is (a forked child does not have it)
        self._lock = threading.Lock()  # held while the buffer is (re)allocated or written
        # the copying threads, kept from save to save (starting threads costs milliseconds a save on a busy host)
        self._pool: tuple[int, int, ThreadPoolExecutor] | None = None  # (pid, threads, pool)
        self._behind: tuple[int, ThreadPoolExecutor] | None = None  # (pid, pool): the copy behind training
        self.copying: Future[None] | None = None  # the last stage's copy behind training, if any
        self._check: tuple[list[tuple[Entry, Any]], list[Any]] | None = None  # its arrays and their versions
        self._settled: threading.Event | None = None  # set once settle() judged it
        self._behind_error: CheckpointError | None = None

    @property
    def capacity(self) -> int:
        return 0 if self._buf is None else int(self._buf.nbytes)

    def _ensure(self, nbytes: int, device: Entry | None) -> tuple[np.ndarray, bool]:
        """The buffer, at least ``nbytes`` long, and whether it was just allocated (no byte written yet).
        With ``device`` (an entry of an accelerator array), it is the framework's staging memory (pinned)."""
        if self._pid != os.getpid():  # a forked child: the parent's buffer is not mapped here
            self._buf, self._pinned, self._pid = None, False, os.getpid()
        if self._buf is not None and self._buf.nbytes >= nbytes and (self._pinned or device is None):
            return self._buf, False
        self._buf = None
        if device is not None:  # pragma: no cover - needs a GPU
            self._buf, self._pinned = device.adapter.staging(nbytes, device.value), True
        else:
            self._buf, self._pinned = _host_memory(nbytes), False
        return self._buf, True

    def _behind_pool(self) -> ThreadPoolExecutor:
        pid = os.getpid()
        if self._behind is None or self._behind[0] != pid:
            self._behind = (pid, _pool(1))
        return self._behind[1]

    def _copiers(self, threads: int) -> ThreadPoolExecutor:
        """The buffer's copying threads (made again in a forked child, or for another number of threads)."""
        pid = os.getpid()
        if self._pool is None or self._pool[:2] != (pid, threads):
            old, self._pool = self._pool, (pid, threads, _pool(threads))
            if old is not None and old[0] == pid:
                old[2].shutdown(wait=False)
        return self._pool[2]

    def reserve(self, snapshot: Snapshot) -> None:
        """Allocate the buffer for a state like ``snapshot`` and touch every page now, so the first
        async save does not pay for fresh memory (on some VMs that triples the copy's cost).

        A buffer that already exists is left alone: its pages are touched, and a save may have staged into
        it (this runs on a helper thread, possibly after the first save began).
        """
        total = _layout(snapshot)[1]
        with self._lock:
            buf, fresh = self._ensure(total, _on_device(snapshot))
            if fresh:
                buf[::4096] = 0

    def stage(
        self, snapshot: Snapshot, threads: int = DEFAULT_THREADS, later: Callable[[Any], bool] | None = None
    ) -> Snapshot:
        """A snapshot whose arrays live in this buffer; the originals may change freely afterwards.

        With ``later``, the arrays it picks (those an optimizer changes only in its step) are copied on a
        background thread instead, while training goes on: :attr:`copying` is that copy, which must end before
        they change (an optimizer's step-pre hook waits for it). The snapshot is written once the copy is
        *settled* (:meth:`settle`: at the next optimizer step, save, wait or close), when every in-place change
        made meanwhile has finished: one that moved an array's version counter makes :meth:`settled` raise
        CheckpointError instead of handing on a torn array."""
        offsets, total = _layout(snapshot)
        self.copying, self._check, self._settled, self._behind_error = None, None, None, None
        with self._lock:  # through the copy: nothing reallocates or writes the buffer meanwhile
            buf, _ = self._ensure(total, _on_device(snapshot))
            jobs = [(e, buf[o : o + e.nbytes]) for e, o in zip(snapshot.entries, offsets)]
            deferred = [j for j in jobs if later is not None and later(j[0].value)]
            if deferred:
                picked = {id(j[0]) for j in deferred}
                jobs_now = [j for j in jobs if id(j[0]) not in picked]
                versions = [getattr(e.value, "_version", None) for e, _ in deferred]
                self._check, self._settled = (deferred, versions), threading.Event()
                self.copying = self._behind_pool().submit(self._copy_behind, deferred)
            else:
                jobs_now = jobs
            if threads > 1 and sum(e.nbytes for e, _ in jobs_now) > (64 << 20):
                lanes: list[list[tuple[Entry, Any]]] = [[] for _ in range(threads)]
                loads = [0] * threads
                for job in sorted(jobs_now, key=lambda j: -j[0].nbytes):
                    i = loads.index(min(loads))
                    lanes[i].append(job)
                    loads[i] += job[0].nbytes
                list(self._copiers(threads).map(_copy_lane, lanes))
            else:
                _copy_lane(jobs_now)
        staged = [replace(e, value=dst.view(np.uint8), adapter=numpy_adapter) for e, dst in jobs]
        return Snapshot(snapshot.tree, snapshot.metadata, staged)

    def _copy_behind(self, jobs: list[tuple[Entry, Any]]) -> None:
        with self._lock:
            _copy_lane(jobs)

    def settle(self) -> None:
        """End the copy behind training (waiting for it) and judge it: an array whose version counter moved
        since the stage was changed in place meanwhile. Called where nothing changes them any more (the next
        optimizer step's hook, the next save, a wait, a close); idempotent."""
        if self._settled is None or self._settled.is_set() or self.copying is None:
            return
        self.copying.exception()  # waits; a failed copy is the write's to raise
        assert self._check is not None
        jobs, versions = self._check
        changed = [e.name for (e, _), v in zip(jobs, versions) if getattr(e.value, "_version", None) != v]
        if changed:
            self._behind_error = CheckpointError(
                f"{', '.join(changed[:3])}{' ...' if len(changed) > 3 else ''} changed in place after save() and "
                "before the optimizer's next step, while they were being copied behind training: this save is "
                "not consistent and was dropped. Change parameters only in optimizer.step() between saves, or "
                "copy them before save() returns (LocalTier(copy_behind=False))"
            )
        self._settled.set()

    def settled(self) -> None:
        """Block until :meth:`settle` ran; raise what the copy behind training met (on the writer's thread)."""
        if self._settled is not None:
            self._settled.wait()
        if self.copying is not None:
            self.copying.result()
        if self._behind_error is not None:
            raise self._behind_error


def _pool(threads: int) -> ThreadPoolExecutor:
    """Copying threads; idle ones end once the pool is dropped (ThreadPoolExecutor's own weak reference)."""
    return ThreadPoolExecutor(threads, thread_name_prefix="trainstate-stage")


def _host_memory(nbytes: int) -> np.ndarray:
    """``nbytes`` of fresh private memory that forked children do not inherit, where the OS allows it."""
    if not hasattr(mmap, "MAP_ANONYMOUS") or not hasattr(mmap, "MADV_DONTFORK"):  # not Linux
        return np.empty(nbytes, dtype=np.uint8)
    _register_fork_hook()
    mem = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mem.madvise(mmap.MADV_DONTFORK)
    _MAPPINGS.add(mem)
    return np.frombuffer(mem, dtype=np.uint8, count=nbytes)  # keeps ``mem`` alive; freed with the last view


def _register_fork_hook() -> None:
    global _fork_hook_registered
    if not _fork_hook_registered:
        os.register_at_fork(after_in_child=_keep_inherited_mappings)
        _fork_hook_registered = True


def _keep_inherited_mappings() -> None:
    _INHERITED.extend(_MAPPINGS)
    _MAPPINGS.clear()


def _layout(snapshot: Snapshot) -> tuple[list[int], int]:
    """Each entry's offset in the buffer (cache-line aligned) and the total size."""
    offsets, total = [], 0
    for e in snapshot.entries:
        offsets.append(total)
        total += -(-e.nbytes // _ALIGN) * _ALIGN
    return offsets, total


def _copy_lane(jobs: list[tuple[Entry, Any]]) -> None:
    """Copy each entry's bytes into its slice of the buffer, each framework's at once (its copies from
    accelerator memory overlap, then one wait)."""
    by_adapter: dict[int, tuple[Any, list[tuple[Any, Any]]]] = {}
    for entry, dst in jobs:
        by_adapter.setdefault(id(entry.adapter), (entry.adapter, []))[1].append((entry.value, dst))
    for adapter, pairs in by_adapter.values():
        adapter.copy_out(pairs)


def _on_device(snapshot: Snapshot) -> Entry | None:
    """An entry of an array in accelerator memory, or None: then the buffer need not be pinned."""
    return next((e for e in snapshot.entries if e.adapter.on_accelerator(e.value)), None)
