"""A collective save's commit: the crash states of several ranks' recordings combined.

Two ranks (spawned processes in one gloo group on loopback, as ``torchrun`` would start them) run a workload
together in one directory, each under a :class:`~.record.Recorder` of its own; each also notes where, in its own
recording, it called each of trainstate's collective exchanges (``Coordinator.gather``, ``scatter``,
``broadcast``, ``all_gather``, ``max``, ``exchange``).

A crash of the whole job (a machine's power, a node that takes the shared disk's client with it) stops each rank
at some point of its own recording. The pairs of points that can happen together are the *consistent cuts* of
what the ranks told each other: a rank that went on past an exchange in which it received from other ranks
stops only after those ranks did everything they did before that exchange (``gather``: rank 0 receives from
every rank; ``scatter`` and ``broadcast``: every rank from rank 0; ``all_gather``, ``max`` and ``exchange``:
every rank from every rank, which makes fewer cuts than point-to-point sends would). For each consistent cut the
ranks' operations up to it are merged in the order they ran (the machine's monotonic clock, which both
processes share), and :func:`~.states.states_after` gives the trees a crash there may leave. Each distinct tree
is judged by the workload's oracle in one process: any world size restores a collective checkpoint.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .record import Image, Op, Recorder
from .states import digest, states_after
from .workloads import KEY, Place, Workload, saves

RANKS = 2
# who receives from whom in each exchange: "to0" (rank 0 from every rank), "from0", or "all"
EXCHANGES = {"gather": "to0", "scatter": "from0", "broadcast": "from0", "all_gather": "all", "max": "all"}
EXCHANGES["exchange"] = "all"

COLLECTIVE = [
    Workload("collective save, 2 ranks, retention (keep_last=2)", saves([0, 1, 2, 3]), {"keep_last": 2}, ranks=RANKS),
    Workload(
        "collective save, 2 ranks, zstd + encryption",
        saves([0, 1, 2]),
        {"compression": "zstd", "key": KEY},
        ranks=RANKS,
    ),
]


class RankRecording:
    """One rank's recording: the tree before, its operations, its marks, and (operations so far, name) at each
    collective exchange it called."""

    def __init__(self, before: Image, ops: list[Op], marks: list[tuple[int, str]], calls: list[tuple[int, str]]):
        self.before, self.ops, self.marks, self.calls = before, ops, marks, calls


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, port: int, root: str, name: str, out: str) -> None:
    """One rank: join the group, record the workload, write the recording to ``out``."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch.distributed as dist

    from trainstate._distributed.group import GlooCoordinator

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=RANKS)
    try:
        w = next(w for w in COLLECTIVE if w.name == name)
        recorder = Recorder(Path(root))
        calls: list[tuple[int, str]] = []
        for exchange in EXCHANGES:
            real = getattr(GlooCoordinator, exchange)

            def noted(self: Any, *args: Any, _real: Any = real, _name: str = exchange, **kwargs: Any) -> Any:
                calls.append((len(recorder.ops), _name))
                return _real(self, *args, **kwargs)

            setattr(GlooCoordinator, exchange, noted)
        dist.barrier()  # the tree is empty when every rank's recorder takes it
        with recorder:
            dist.barrier()
            w.run(Place(Path(root)), recorder, w)
            dist.barrier()
        with open(out, "wb") as f:
            pickle.dump(RankRecording(recorder.before, recorder.ops, recorder.marks, calls), f)
    finally:
        dist.destroy_process_group()


def record(w: Workload, root: Path, work: Path) -> list[RankRecording]:
    """Run ``w`` on :data:`RANKS` spawned ranks in ``root``; their recordings."""
    port = _free_port()
    ctx = multiprocessing.get_context("spawn")
    outs = [work / f"rank{r}.pkl" for r in range(RANKS)]
    procs = [ctx.Process(target=_rank, args=(r, port, str(root), w.name, str(outs[r]))) for r in range(RANKS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
        if p.is_alive():
            p.kill()
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"a rank of {w.name!r} failed: exit codes {[p.exitcode for p in procs]}")
    recordings = []
    for out in outs:
        with open(out, "rb") as f:
            recordings.append(pickle.load(f))
    names = [[name for _, name in r.calls] for r in recordings]
    if any(n != names[0] for n in names):
        raise RuntimeError(f"the ranks called different exchanges: {names}")
    return recordings


def _consistent(cut: tuple[int, ...], recordings: list[RankRecording]) -> bool:
    """Whether every rank's point in ``cut`` can be where it stopped, given the others' (see the module doc)."""
    for j, (_, name) in enumerate(recordings[0].calls):
        who = EXCHANGES[name]
        ranks = range(len(recordings))
        receivers = [0] if who == "to0" else ranks
        senders = [0] if who == "from0" else ranks
        for a in receivers:
            if cut[a] > recordings[a].calls[j][0]:  # a did something after receiving
                if any(cut[b] < recordings[b].calls[j][0] for b in senders):
                    return False
    return True


def crash_states(recordings: list[RankRecording]) -> Iterator[tuple[str, str, list[int], Image]]:
    """(the cut, how the state was made, the steps committed before the cut (rank 0's marks), the tree), each
    distinct (tree, committed) once."""
    assert len(recordings) == 2
    first, second = recordings
    seen: set[tuple[str, tuple[int, ...]]] = set()
    for p0 in range(len(first.ops) + 1):
        for p1 in range(len(second.ops) + 1):
            if not _consistent((p0, p1), recordings):
                continue
            merged = sorted([*first.ops[:p0], *second.ops[:p1]], key=lambda op: op.at)
            committed = [int(label.split()[1]) for at, label in first.marks if at <= p0 and "committed" in label]
            for how, image in states_after(first.before, merged):
                key = (digest(image), tuple(committed))
                if key not in seen:
                    seen.add(key)
                    yield f"ranks at ops ({p0}, {p1})", how, committed, image
