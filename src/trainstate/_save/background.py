"""Saves to paths a caller names, written on a background thread, with later jobs queued behind them in order.

A framework's checkpoint hook (Lightning's ``CheckpointIO``) names each checkpoint itself and deletes old ones
itself, right after asking for the next save. Run in the background without order, that delete could land
before the new checkpoint commits, and a crash in between would leave neither. Here every job runs on one
thread in the order it was asked for, and a job queued behind a save that failed is skipped: nothing is
deleted on the strength of a checkpoint that was never written.

The thread and the reused host buffers are the background queue's (``queue.py``, the manager's async save
runs on one too). A save copies the state's arrays into a free buffer before it returns, so the caller may
change them at once; the bytes are written and
committed by :func:`trainstate._save.write.write_checkpoint`, the synchronous save's own core. The first
error a background job meets is raised by the next call (``save``, ``then``, ``wait`` or ``close``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from trainstate import _gc
from trainstate._save.encode import encode_state
from trainstate._save.options import SaveOptions
from trainstate._save.queue import BackgroundQueue
from trainstate._save.staging import StagingBuffer
from trainstate._save.write import SaveResult, write_checkpoint
from trainstate._storage import Storage, resolve
from trainstate.errors import CheckpointError


class BackgroundSaver:
    """One background thread that writes checkpoints and runs the jobs queued behind them, in order.

    Example:
        >>> saver = BackgroundSaver()
        >>> saver.save("ckpt/epoch=0-step=10.ckpt", state, options=save_options(overwrite=True))  # once copied
        >>> saver.then(lambda: delete("ckpt/epoch=0-step=5.ckpt"))  # runs after that save committed
        >>> saver.wait()  # raises if a job failed
    """

    def __init__(self, *, max_in_flight: int = 1) -> None:
        self._queue = BackgroundQueue(max_in_flight, "trainstate-background")
        self._error: BaseException | None = None
        self._lock = threading.Lock()  # guards _error: a job sets it on the pool's thread

    @property
    def in_flight(self) -> int:
        """Jobs queued or running."""
        self._queue.finished(block=False)
        return len(self._queue.jobs)

    def save(
        self,
        path: str,
        state: Any,
        *,
        options: SaveOptions,
        metadata: Any = None,
        storage: Storage | None = None,
        around: Callable[[Callable[[], Any]], Any] | None = None,
    ) -> float:
        """Copy ``state``'s arrays and write them as a checkpoint at ``path`` in the background, as
        ``options`` say; returns the seconds the caller was blocked. ``around``, if given, is called on the
        background thread with the write (a function) and calls it: to prepare the path before and tidy up
        after."""
        start = time.perf_counter()
        self._raise_pending()
        buffer = self._free_buffer()
        backend, root = resolve(path, storage)
        with _gc.paused():
            snapshot = encode_state(state, metadata)
        staged = buffer.stage(snapshot, threads=options.threads)
        blocking = time.perf_counter() - start

        def write() -> SaveResult:
            return write_checkpoint(root, staged, storage=backend, options=options, start=time.perf_counter())

        self._submit(write if around is None else lambda: around(write), buffer, f"the background save of {path}")
        return blocking

    def then(self, job: Callable[[], Any], what: str) -> None:
        """Run ``job`` once every job asked for before it is done; skipped if one of those failed."""
        self._raise_pending()
        self._submit(job, None, what)

    def wait(self) -> None:
        """Block until every job has run; raise the first error one met."""
        self._queue.finished(block=True)
        self._raise_pending()

    def close(self) -> None:
        """Wait for every job, stop the thread (a later call starts a new one), raise the first error."""
        try:
            self.wait()
        finally:
            self._queue.shutdown()

    # -- inside ----------------------------------------------------------------------------------

    def _submit(self, job: Callable[[], Any], buffer: StagingBuffer | None, what: str) -> None:
        def run() -> Any:
            with self._lock:
                failed = self._error is not None
            if failed:  # an earlier job failed: do not act on its result (delete the checkpoint it replaced)
                return None
            try:
                return job()
            except BaseException as e:
                with self._lock:
                    self._error = self._error or e
                raise

        self._queue.submit(run, buffer, what)

    def _free_buffer(self) -> StagingBuffer:
        """A buffer no job holds, once one is free (raising the error of a job that failed meanwhile)."""
        while True:
            self._queue.finished(block=False)
            buffer = self._queue.free_buffer()
            if buffer is not None:
                return buffer
            self._queue.finished(block=True, first_only=True)
            self._raise_pending()

    def _raise_pending(self) -> None:
        self._queue.finished(block=False)
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise_background(error)


def raise_background(error: BaseException) -> None:
    """Raise what a background save failed with, in the caller's thread: a CheckpointError as it is."""
    if isinstance(error, CheckpointError):
        raise error
    raise CheckpointError(f"a background save failed: {error!r}") from error
