"""Run a function on N real ranks: N spawned processes in one gloo process group on loopback.

``run(world, fn, *args)`` returns each rank's result, or the exception's type name and message where a
rank raised (a rank that died shows as its exit code). ``fn`` must be importable (a module-level function).

Starting ranks costs seconds (each imports torch and joins the group), so the ranks of a world size are
kept for the next ``run`` while every run on them ends with every rank returning normally. A run in which a
rank raised, died or did not answer in time may have left the group out of step: those ranks are killed
and the next run starts fresh ones. A function must therefore leave nothing behind that the next could
trip over (managers closed, signal handlers put back), as a well-behaved training script does.
"""

from __future__ import annotations

import atexit
import multiprocessing.util  # noqa: F401 - its exit hook must be registered before ours
import os
import queue
import socket
import time
import traceback
from typing import Any

import forked

TIMEOUT = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(rank: int, world: int, port: int, inbox: Any, out: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        while (task := inbox.get()) is not None:
            fn, args = task
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


class _Ranks:
    """``world`` live rank processes in one process group, each taking functions from its own queue."""

    def __init__(self, world: int) -> None:
        ctx = forked.context()
        self.world = world
        self.out = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(world)]
        port = free_port()
        # not daemonic: a rank may start processes of its own (DataLoader workers)
        self.procs = [
            ctx.Process(target=_serve, args=(r, world, port, self.inboxes[r], self.out)) for r in range(world)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn: Any, args: tuple[Any, ...], timeout: float) -> tuple[list[Any], bool]:
        """Each rank's result, and whether these ranks can take another function."""
        for inbox in self.inboxes:
            inbox.put((fn, args))
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(results) < self.world and time.monotonic() < deadline:
            try:
                rank, status, value = self.out.get(timeout=0.5)
            except queue.Empty:
                if any(not p.is_alive() for p in self.procs) and all(
                    not p.is_alive() or r in results for r, p in enumerate(self.procs)
                ):
                    break  # a rank died and every live one answered: nobody else will
                continue
            results[rank] = value if status == "ok" else RankError(*value)
        healthy = len(results) == self.world and not any(isinstance(v, RankError) for v in results.values())
        if not healthy:
            self.close()
        return [results.get(r, f"exit code {self.procs[r].exitcode}") for r in range(self.world)], healthy

    def close(self) -> None:
        for inbox, p in zip(self.inboxes, self.procs, strict=True):
            if p.is_alive():
                inbox.put(None)
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()


_live: dict[int, _Ranks] = {}


def _close_all() -> None:
    for ranks in _live.values():
        ranks.close()
    _live.clear()


# At exit, before multiprocessing joins its children (which would wait for these ranks' next task forever):
# multiprocessing.util registered its exit hook when imported above, and exit hooks run last-in first-out.
atexit.register(_close_all)


def run(world: int, fn: Any, *args: Any, timeout: float = TIMEOUT) -> list[Any]:
    ranks = _live.pop(world, None) or _Ranks(world)
    results, healthy = ranks.run(fn, args, timeout)
    if healthy:
        _live[world] = ranks
    return results


def ok(results: list[Any]) -> list[Any]:
    """The results, after asserting that no rank failed."""
    bad = [r for r in results if isinstance(r, (RankError, str))]
    assert not bad, "\n".join(r.trace if isinstance(r, RankError) else r for r in bad)
    return results
