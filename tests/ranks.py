"""Run a function on N real ranks: N spawned processes in one gloo process group on loopback.

``run(world, fn, *args)`` returns each rank's result, or the exception's type name and message where a
rank raised (a rank that died shows as its exit code). ``fn`` must be importable (a module-level function).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback
from typing import Any

TIMEOUT = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _main(rank: int, world: int, port: int, fn: Any, args: tuple[Any, ...], out: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        out.put((rank, "ok", fn(rank, world, *args)))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        out.put((rank, "error", (type(e).__name__, str(e), traceback.format_exc())))
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


class RankError:
    def __init__(self, kind: str, message: str, trace: str) -> None:
        self.kind, self.message, self.trace = kind, message, trace

    def __repr__(self) -> str:
        return f"RankError({self.kind}: {self.message[:300]})"


def run(world: int, fn: Any, *args: Any, timeout: float = TIMEOUT) -> list[Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    # not daemonic: a rank may start processes of its own (DataLoader workers); run() reaps them all
    procs = [ctx.Process(target=_main, args=(r, world, port, fn, args, out)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    import queue
    import time

    deadline = time.monotonic() + timeout
    while len(results) < world and time.monotonic() < deadline:
        try:
            rank, status, value = out.get(timeout=0.5)
        except queue.Empty:
            if all(not p.is_alive() for p in procs):
                break
            continue
        results[rank] = value if status == "ok" else RankError(*value)
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join()
    return [results.get(r, f"exit code {procs[r].exitcode}") for r in range(world)]


def ok(results: list[Any]) -> list[Any]:
    """The results, after asserting that no rank failed."""
    bad = [r for r in results if isinstance(r, (RankError, str))]
    assert not bad, "\n".join(r.trace if isinstance(r, RankError) else r for r in bad)
    return results
