"""The manager's saves in flight: the jobs, waiting for them at exit, giving back what a manager holds.

Nothing here refers to a manager: a finalizer and an exit hook must work after the manager is gone.
"""

from __future__ import annotations

import logging
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from trainstate._manager.committer import SaveRecord
from trainstate._manager.lock import DirectoryLock
from trainstate._manager.preemption import PreemptionWatcher
from trainstate._manager.staging import StagingBuffer

log = logging.getLogger("trainstate")


@dataclass
class InFlight:
    future: Future[SaveRecord]
    buffer: StagingBuffer
    step: int
    reason: str
    blocking: float
    previous: tuple[int | None, float]  # (last step, last save time) to go back to if this save fails


class InFlightJobs(list[InFlight]):
    """A manager's saves in flight, oldest first (a list an exit hook can track weakly, by identity)."""

    __hash__ = object.__hash__  # type: ignore[assignment]

    def __eq__(self, other: object) -> bool:
        return self is other


_LIVE: weakref.WeakSet[InFlightJobs] = weakref.WeakSet()


def track(jobs: InFlightJobs) -> InFlightJobs:
    """Have ``jobs`` waited for at interpreter exit."""
    _LIVE.add(jobs)
    return jobs


def _finish_saves_at_exit() -> None:
    """At interpreter exit, let async saves in flight commit (a script that ends right after ``save()``
    must not lose that save). Runs before concurrent.futures stops accepting work, which the writers need."""
    for jobs in list(_LIVE):
        for job in list(jobs):
            try:
                job.future.result()
            except Exception as e:  # noqa: BLE001 - nobody is left to raise it to
                log.error("the background save of step %d failed at exit: %r", job.step, e)


if hasattr(threading, "_register_atexit"):  # runs before concurrent.futures' own exit hook (LIFO)
    threading._register_atexit(_finish_saves_at_exit)


def release(
    lock: DirectoryLock | None,
    preemption: PreemptionWatcher | None,
    pool: ThreadPoolExecutor | None,
    in_flight: list[InFlight],
) -> None:
    """Give back what a manager holds; also its finalizer, so it must not refer to the manager.

    Saves still in flight finish first (their commits and retention run under the lock); an error one of
    them met is logged, since nobody is left to raise it to.
    """
    try:
        if preemption is not None:
            preemption.close()
        if pool is not None:
            on_pool = threading.current_thread().name.startswith("trainstate-async")
            pool.shutdown(wait=not on_pool)  # a collection on the pool's own thread cannot wait for itself
        for job in in_flight:
            error = job.future.exception() if job.future.done() else None
            if error is not None:
                log.error("the background save of step %d failed and nobody waited for it: %r", job.step, error)
    finally:
        if lock is not None:
            lock.release()
