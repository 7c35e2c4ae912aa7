"""Jobs run one after another on one background thread, each holding a staging buffer until it ends.

This is what an async save is made of, and its one owner: the thread, the reused host buffers a save's arrays
are copied into (``staging.py``), which buffers are busy, and letting the jobs in flight finish when
the interpreter exits (a script that ends right after an async save must not lose that save). Two callers
build on it: the manager's writer (``_manager/async_writer.py``, which adds the run's record of saves) and the
saver behind framework hooks (``background.py``, which adds jobs that act on a save's result).

Nothing here refers to its owner: the exit hook and a manager's finalizer must work after the owner is gone.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from trainstate._save.staging import StagingBuffer

log = logging.getLogger("trainstate")


@dataclass
class Job:
    future: Future[Any]
    buffer: StagingBuffer | None  # the buffer the job's arrays sit in until it ends, if it has any
    what: str  # for messages: "the save of step 5"
    info: Any = None  # the owner's own record of the job


class _Jobs(list[Job]):
    """A queue's jobs in flight, oldest first (a list the exit hook can track weakly, by identity)."""

    __hash__ = object.__hash__  # type: ignore[assignment]

    def __eq__(self, other: object) -> bool:
        return self is other


_LIVE: weakref.WeakSet[_Jobs] = weakref.WeakSet()


def _finish_at_exit() -> None:
    """At interpreter exit, let the jobs in flight finish. Runs before concurrent.futures stops accepting
    work, which the queues need."""
    if os.getpid() != _OWNER:  # a forked child (a DataLoader worker) exits without waiting: see _forked
        return
    for jobs in list(_LIVE):
        for job in list(jobs):
            try:
                job.future.result()
            except Exception as e:  # noqa: BLE001 - nobody is left to raise it to
                log.error("%s failed at exit: %r", job.what, e)


def _forked() -> None:
    """In a forked child, forget the parent's jobs: their thread was not forked, so they never end here.

    A DataLoader worker forked while an async save is in flight inherits the exit hook and the jobs; waiting
    for them at its exit hung it forever (torch gives up on it after 5 s at the end of an epoch; after a
    SIGKILL of the trainer it lived on, holding the trainer's stdout). The parent still writes the save.
    """
    global _OWNER
    _OWNER = os.getpid()
    for jobs in list(_LIVE):
        jobs.clear()


_OWNER = os.getpid()  # the process whose jobs _LIVE holds
os.register_at_fork(after_in_child=_forked)

if hasattr(threading, "_register_atexit"):  # runs before concurrent.futures' own exit hook (LIFO)
    threading._register_atexit(_finish_at_exit)


class BackgroundQueue:
    """One background thread (started by the first job) and ``buffers`` staging buffers.

    Example:
        >>> queue = BackgroundQueue(buffers=1, name="trainstate-async")
        >>> buffer = queue.free_buffer()                  # None while every buffer holds a job's arrays
        >>> staged = buffer.stage(snapshot, threads=4)
        >>> queue.submit(lambda: write(staged), buffer, "the save of step 5")
        >>> done = queue.finished(block=True)             # the jobs that ended, oldest first
    """

    def __init__(self, buffers: int, name: str) -> None:
        self.buffers = [StagingBuffer() for _ in range(buffers)]
        self.jobs = _Jobs()
        _LIVE.add(self.jobs)
        self._name = name
        self._pool: ThreadPoolExecutor | None = None
        self._pid = os.getpid()  # the process that started the pool's thread

    def free_buffer(self) -> StagingBuffer | None:
        """A buffer no job in the queue holds, or None if every one is held. A job that ended still holds its
        buffer until :meth:`finished` takes it out of the queue."""
        busy = {id(job.buffer) for job in self.jobs if job.buffer is not None}
        return next((b for b in self.buffers if id(b) not in busy), None)

    def submit(self, run: Callable[[], Any], buffer: StagingBuffer | None, what: str, info: Any = None) -> Job:
        """Queue ``run`` behind every job submitted before it; ``buffer`` stays busy until it ends."""
        if self._pool is None or self._pid != os.getpid():  # a forked copy's pool has no thread: start one
            self._pool = ThreadPoolExecutor(1, thread_name_prefix=self._name)
            self._pid = os.getpid()
        job = Job(self._pool.submit(run), buffer, what, info)
        self.jobs.append(job)
        return job

    def finished(self, block: bool, first_only: bool = False) -> list[Job]:
        """Take the jobs that ended out of the queue, oldest first: their buffers are free again, their
        errors the caller's to read (``job.future.exception()``). With ``block``, wait for every job first
        (``first_only``: for the oldest). Waiting is interruptible: a Ctrl-C goes through to the caller."""
        done, still = [], []
        for i, job in enumerate(self.jobs):
            if block and (not first_only or i == 0):
                job.future.exception()  # waits; the error is read by the caller
            if not job.future.done():
                still.append(job)
                continue
            done.append(job)
        self.jobs[:] = still  # in place: the exit hook tracks this list
        return done

    def on_own_thread(self) -> bool:
        """Whether the caller runs on this queue's thread (a job there cannot wait for itself)."""
        return threading.current_thread().name.startswith(self._name)

    def shutdown(self) -> None:
        """Let the jobs in flight finish and stop the thread; a later job starts a new one."""
        if self._pool is not None:
            if self._pid == os.getpid():  # a forked copy's pool has no thread to stop
                self._pool.shutdown(wait=not self.on_own_thread())
            self._pool = None
