"""Rank functions for the tests of a rank that is gone before a collective call (run by ``ranks.run``)."""

from __future__ import annotations

import os
import time
from typing import Any

import torch

import trainstate


def exits_before_the_save(rank: int, world: int, directory: str, how: str) -> Any:
    """Every rank opens a manager; rank 1 then exits without a word; rank 0 saves. Returns rank 0's error
    and how long it took to come."""
    os.environ["TRAINSTATE_DIST_ARRIVAL_TIMEOUT"] = "3"  # the default is 60 s: the test does not wait that long
    if how == "before_manager" and rank == 1:
        os._exit(0)
    start = time.monotonic()
    try:
        mgr = trainstate.CheckpointManager(directory, every_steps=1)
    except trainstate.CheckpointError as e:
        del os.environ["TRAINSTATE_DIST_ARRIVAL_TIMEOUT"]
        return {"error": type(e).__name__, "message": str(e), "seconds": time.monotonic() - start}
    if rank == 1:
        os._exit(0)  # a crash after setup: no close(), no goodbye
    start = time.monotonic()
    try:
        mgr.save(1, {"w": torch.zeros(8), "mine": trainstate.PerRank(torch.zeros(4))}, force=True)
    except trainstate.CheckpointError as e:
        return {"error": type(e).__name__, "message": str(e), "seconds": time.monotonic() - start}
    finally:
        del os.environ["TRAINSTATE_DIST_ARRIVAL_TIMEOUT"]
        try:
            mgr.close()
        except trainstate.CheckpointError:
            pass
    return {"error": None, "seconds": time.monotonic() - start}
