"""The manager's writer: runs its saves one after another, on the caller's thread or in the background.

An async save is the synchronous core (:meth:`Committer.write`) run on a background queue
(``_save/queue.py``: one thread, reused staging buffers, the jobs in flight finished at exit) after the
state's arrays were copied into a free buffer, so training goes on while it writes. The writer adds what a
run needs: the error a background save met (raised at the next call), the record of finished saves and the
step last saved. At most ``max_in_flight`` saves run at once, and a synchronous save first waits for all of
them: retention never races itself.

Nothing here refers to a manager: a finalizer and an exit hook must work after the manager is gone, and a
manager dropped with a save in flight must be collectable at once (its finalizer waits for the save).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trainstate._format import run_dir as naming
from trainstate._history.log import SaveRecord
from trainstate._manager.committer import Committer
from trainstate._save import Snapshot
from trainstate._save.background import raise_background
from trainstate._save.queue import BackgroundQueue
from trainstate._save.staging import StagingBuffer
from trainstate.errors import CheckpointError

log = logging.getLogger("trainstate")


@dataclass
class InFlight:
    step: int
    reason: str
    blocking: float
    previous: tuple[int | None, float]  # (last step, last save time) to go back to if this save fails


class AsyncWriter:
    """Writes a manager's snapshots through its committer, in the background when its settings say so."""

    def __init__(self, committer: Committer) -> None:
        config = committer.config
        self.committer = committer
        self.history: list[SaveRecord] = []  # finished saves, background ones once collected
        self.last_step: int | None = None  # saved or being saved; taken back if a background save fails
        self.last_save_time = time.monotonic()  # a clock that never steps back
        self.queue = BackgroundQueue(config.max_in_flight if config.async_save else 0, "trainstate-async")
        self._error: BaseException | None = None
        # Under a process group a background save's error is raised only where every rank agreed to raise it
        # (the next save()'s decision): a rank raising it on its own, at the moment its thread happened to
        # finish, would leave the others in the next collective until the timeout.
        self.agreed_errors_only = False
        self.behind: StagingBuffer | None = None  # the buffer of the last save copied behind training, unsettled

    def reserve(self, snapshot: Callable[[], Snapshot]) -> None:
        """Allocate and touch the first staging buffer on a helper thread, unless there is none to reserve
        or it exists already (``snapshot`` is only called when there is work to do)."""
        if not self.queue.buffers or self.queue.buffers[0].capacity:
            return
        threading.Thread(
            target=self.queue.buffers[0].reserve, args=(snapshot(),), name="trainstate-reserve", daemon=True
        ).start()

    def ready(self, background: bool) -> None:
        """Make room before a save: a free buffer for a background one (raising the error of a save that
        finished meanwhile), every save in flight committed for a synchronous one."""
        if background:
            while self.queue.free_buffer() is None:
                self.collect(block=True, first_only=True)
            if not self.agreed_errors_only:
                self.raise_pending()  # the save we just waited for may have failed
        else:
            self.collect(block=True)

    def write(
        self,
        step: int,
        reason: str,
        snapshot: Snapshot,
        background: bool,
        start: float,
        facts: dict[str, Any] | None = None,
        later: Callable[[Any], bool] | None = None,
    ) -> None:
        """Write ``snapshot`` as ``step``, after :meth:`ready`; ``start`` is when the caller's save began,
        ``facts`` what its manifest records (for the run's history, see Committer.write). ``later`` picks the
        arrays a background save copies behind training (staging.py; :meth:`wait_copy` waits for them)."""
        budget = self.committer.config.staging_budget_bytes
        if background and budget is not None and snapshot.nbytes > budget:
            log.warning(
                "step %d: state is %d bytes, over the staging budget of %d; saving synchronously",
                step,
                snapshot.nbytes,
                budget,
            )
            background = False
            self.collect(block=True)
            if not self.agreed_errors_only:
                self.raise_pending()
        previous = (self.last_step, self.last_save_time)
        if not background:
            record = self.committer.write(step, reason, snapshot, False, start, facts=facts)
            self.history.append(record)  # only now is the step saved: a failed save leaves it unsaved
            self.last_step, self.last_save_time = step, time.monotonic()
            return
        buffer = self.queue.free_buffer()
        assert buffer is not None  # ready() made room
        staged = buffer.stage(snapshot, threads=self.committer.config.options.threads, later=later)
        blocking = time.perf_counter() - start
        # the background job holds the committer, never the manager: a manager dropped with a save in
        # flight is collected at once, and its finalizer waits for the save before letting go of the lock
        job = functools.partial(self.committer.write, step, reason, staged, True, None, blocking, facts)
        self.behind = buffer if buffer.copying is not None else None
        if self.behind is not None:  # the write starts once the copy behind training is settled
            job = functools.partial(_after, step, buffer, job)
        self.queue.submit(
            job, buffer, f"the background save of step {step}", InFlight(step, reason, blocking, previous)
        )
        self.last_step, self.last_save_time = step, time.monotonic()  # taken back if the write fails
        log.debug("step %d: async save started, blocked %.3fs", step, blocking)

    def wait_copy(self) -> None:
        """Settle the last save's copy behind training (an optimizer's step-pre hook calls it: the step changes
        what is being copied; so do the next save, a wait and a close); its error is the save's, raised with it."""
        behind, self.behind = self.behind, None
        if behind is not None:
            behind.settle()

    def collect(self, block: bool, first_only: bool = False) -> None:
        """Move finished background saves into the history; remember the first error.

        Waiting is interruptible: a second Ctrl-C (KeyboardInterrupt) goes through to the caller.
        """
        if block:
            self.wait_copy()  # a write waiting for its copy to settle would wait for this very call
        for job in self.queue.finished(block, first_only):
            error = job.future.exception()
            if error is None:
                self.history.append(job.future.result())
                continue
            self._error = self._error or error
            saved: InFlight = job.info
            if self.last_step == saved.step:  # the step is not saved: a later save(step) must write it
                self.last_step, self.last_save_time = saved.previous
            path = self.committer.catalog.path(naming.name_for(saved.step))
            self.history.append(SaveRecord(saved.step, saved.reason, path, True, saved.blocking, error=repr(error)))

    def failed(self) -> bool:
        """Whether a finished background save failed and the error was not raised yet."""
        self.collect(block=False)
        return self._error is not None

    def take_error(self) -> BaseException | None:
        """The first error a finished background save met since the last call, now reported."""
        self.collect(block=False)
        error, self._error = self._error, None
        return error

    def raise_pending(self) -> None:
        error = self.take_error()
        if error is not None:
            raise_background(error)

    def wait(self) -> None:
        """Block until every save in flight has committed; raise if one failed."""
        self.collect(block=True)
        self.raise_pending()

    def close(self) -> None:
        """Let the saves in flight finish and stop the thread; part of a manager's finalizer, so an error
        nobody waited for is logged, since nobody is left to raise it to."""
        self.wait_copy()
        self.queue.shutdown()
        for job in self.queue.jobs:
            error = job.future.exception() if job.future.done() else None
            if error is not None:
                log.error("%s failed and nobody waited for it: %r", job.what, error)


def _after(step: int, buffer: StagingBuffer, write: Callable[[], SaveRecord]) -> SaveRecord:
    try:
        buffer.settled()  # raises if what was copied behind training changed meanwhile: nothing is written
    except CheckpointError as e:
        raise CheckpointError(f"the save of step {step} was dropped: {e}") from None
    return write()
