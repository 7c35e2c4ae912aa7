"""Preemption: a signal only sets a flag; the save happens at the next ``save()`` call, never in the handler.

What Ctrl-C does under a manager with ``save_on_preemption=True`` (the default):

* the first SIGINT (like SIGTERM or SIGUSR1) is remembered; the next ``mgr.save(...)`` writes a checkpoint
  at once (synchronously, whatever the policies say) and ``mgr.preempted`` turns True: the loop should
  then ``break``;
* a second SIGINT goes to the handler that was installed before the manager (normally it raises
  KeyboardInterrupt), also while the manager waits for an async save in flight: a user who really wants
  out is never stuck;
* once the manager is closed — or dropped without ``close()`` — signals go to the previous handlers again;
* forked children (DataLoader workers) inherit the handler but do not act on it: there signals go to the
  previous handlers, as if no manager existed.

Sending SIGTERM to the whole process group (as some schedulers do) also reaches the DataLoader workers,
which PyTorch's own worker handler ends at once: the training loop then fails on its next batch before it
can call ``save()``. Signal the training process only (e.g. SLURM ``--signal=B:TERM@60`` with a batch
script that forwards it to the trainer's pid), or send SIGUSR1 to the trainer.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import weakref
from types import FrameType
from typing import Any

log = logging.getLogger("trainstate")

DEFAULT_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1")

_watchers: weakref.WeakSet[PreemptionWatcher] = weakref.WeakSet()


def _not_in_child() -> None:
    for watcher in list(_watchers):
        watcher._closed = True


os.register_at_fork(after_in_child=_not_in_child)


class PreemptionWatcher:
    def __init__(self, signals: tuple[str, ...] = DEFAULT_SIGNALS) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}
        self._closed = False
        _watchers.add(self)
        if threading.current_thread() is not threading.main_thread():
            log.warning("preemption signals can only be watched from the main thread; not watching")
            return
        for name in signals:
            sig = getattr(signal, name, None)
            if sig is not None:
                self._previous[sig] = signal.signal(sig, self._handle)

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._closed or (self.signal_name is not None and signum == signal.SIGINT):
            self._forward(signum, frame)  # closed, or a second Ctrl-C: behave as if we were not here
            return
        self.signal_name = signal.Signals(signum).name
        log.warning("%s received: a checkpoint will be saved at the next save() call", self.signal_name)

    def _forward(self, signum: int, frame: FrameType | None) -> None:
        previous = self._previous.get(signum, signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def close(self) -> None:
        """Stop watching: the previous handlers come back (or, off the main thread, are forwarded to)."""
        self._closed = True
        if threading.current_thread() is threading.main_thread():
            for sig, previous in self._previous.items():
                if signal.getsignal(sig) == self._handle:
                    signal.signal(sig, previous)
