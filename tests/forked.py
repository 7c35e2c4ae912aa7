"""Rank processes (and the conversion tests' peak-memory child) forked from a server that imported torch once.

A fresh ``python`` that imports torch spends seconds of CPU before the test's first line runs; on a 2-core
CI machine the suite's rank processes would spend minutes on that alone. The multiprocessing fork server
imports torch, NumPy and trainstate once (importing starts no threads, so forking it is safe) and each rank
is forked from it. It imports torch._dynamo too: torch imports it the first time any optimizer is built
(``Optimizer.add_param_group`` is wrapped to keep dynamo out), seconds of CPU in every rank that builds one.
The SIGKILLed training scripts stay fresh ``python`` processes: a fresh process is what they test (forked
from here they also measured slower, 10-18 s a run against 7-8 s).
"""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "torch.utils.data", "numpy", "trainstate"]


def context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx
