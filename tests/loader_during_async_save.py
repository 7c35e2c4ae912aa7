"""A training script whose DataLoader forks its workers while an async save is still being written.

    python tests/loader_during_async_save.py DIR shutdown   # prints one JSON line: the workers' exit codes
    python tests/loader_during_async_save.py DIR kill       # prints the worker pids, then SIGKILLs itself

The save is held in flight by a storage whose writes wait for an event the script sets once the loaders are
done with, so the workers are always forked mid-save.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import torch
from torch.utils.data import DataLoader, Dataset

import trainstate
from trainstate._storage.local import LocalStorage

RELEASE = threading.Event()


class HeldStorage(LocalStorage):
    """Local storage whose writes wait (at most 20 s) until RELEASE is set: a save that is slow to write."""

    def _write(self, fd: int, view: memoryview) -> int:
        RELEASE.wait(20)
        return super()._write(fd, view)


class Numbers(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((4,), float(i))


def main(directory: str, mode: str) -> None:
    mgr = trainstate.CheckpointManager(directory, async_save=True, storage=HeldStorage())
    mgr.save(1, {"w": torch.zeros(64)}, force=True)  # in flight until RELEASE
    if mode == "kill":
        loader = DataLoader(Numbers(), batch_size=2, num_workers=2, persistent_workers=True)
        it = iter(loader)
        next(it)
        print(json.dumps({"workers": [w.pid for w in it._workers]}), flush=True)  # type: ignore[attr-defined]
        os.kill(os.getpid(), signal.SIGKILL)
    codes = {}
    for persistent in (False, True):
        loader = DataLoader(Numbers(), batch_size=2, num_workers=2, persistent_workers=persistent)
        it = iter(loader)
        start = time.monotonic()
        assert sum(1 for _ in it) == 8
        it._shutdown_workers()  # type: ignore[attr-defined] # what the end of an epoch / del loader does
        codes["persistent" if persistent else "per_epoch"] = {
            "exitcodes": [w.exitcode for w in it._workers],  # type: ignore[attr-defined]
            "seconds": round(time.monotonic() - start, 2),
        }
    RELEASE.set()
    mgr.close()
    print(json.dumps(codes), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
