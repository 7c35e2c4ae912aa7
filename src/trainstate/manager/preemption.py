"""Preemption: a signal only sets a flag; the save happens at the next ``save()`` call, never in the handler.

A second SIGINT falls through to the previous handler (normally KeyboardInterrupt), so a user who really
wants out is not stuck.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import Any

log = logging.getLogger("trainstate")

DEFAULT_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1")


class PreemptionWatcher:
    def __init__(self, signals: tuple[str, ...] = DEFAULT_SIGNALS) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}
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
        previous = self._previous.get(signum)
        if self.signal_name is not None and signum == signal.SIGINT and callable(previous):
            previous(signum, frame)  # second Ctrl-C: behave as if we were not here
            return
        self.signal_name = signal.Signals(signum).name
        log.warning("%s received: a checkpoint will be saved at the next save() call", self.signal_name)

    def close(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for sig, previous in self._previous.items():
                signal.signal(sig, previous)
        self._previous.clear()
