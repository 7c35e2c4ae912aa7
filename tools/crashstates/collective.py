"""A collective save's commit: the crash states of several ranks' recordings combined.

Two ranks (spawned processes in one gloo group on loopback, as ``torchrun`` would start them) run a workload
together in one directory, each under a :class:`~.record.Recorder` of its own; each also notes where, in its own
recording, it called each of trainstate's collective exchanges (``Coordinator.gather``, ``scatter``,
``broadcast``, ``all_gather``, ``max``, ``exchange``).

A crash of the whole job (a machine's power, a node that takes the shared disk's client with it) stops each rank
at some point of its own recording. The pairs of points that can happen together are the *consistent cuts* of
what the ranks told each other: a rank that recorded something after an exchange returned, in which it received
from other ranks, stops only after those ranks did everything they recorded before they entered that exchange
(``gather``: rank 0 receives from every rank; ``scatter`` and ``broadcast``: every rank from rank 0;
``all_gather``, ``max`` and ``exchange``: every rank from every rank, which makes fewer cuts than point-to-point
sends would). What a rank's other threads recorded while it waited in an exchange is not ordered after it. For each consistent cut the
ranks' operations up to it are merged in the order they ran (the machine's monotonic clock, which both
processes share), and :func:`~.states.states_after` gives the trees a crash there may leave. Each distinct tree
is judged by the workload's oracle in one process: any world size restores a collective checkpoint.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .record import Image, Op, Recorder
from .states import digest, states_after
from .workloads import KEY, Place, Workload, oracle, saves

RANKS = 2
# who receives from whom in each exchange: "to0" (rank 0 from every rank), "from0", or "all"
EXCHANGES = {"gather": "to0", "scatter": "from0", "broadcast": "from0", "all_gather": "all", "max": "all"}
EXCHANGES["exchange"] = "all"

COLLECTIVE = [
    Workload("collective, 2 ranks: saves, retention (keep_last=2)", saves([0, 1, 2, 3]), {"keep_last": 2}, ranks=RANKS),
    Workload(
        "collective, 2 ranks: saves, zstd + encryption",
        saves([0, 1, 2]),
        {"compression": "zstd", "key": KEY},
        ranks=RANKS,
    ),
    Workload(
        "collective, 2 ranks: local tier (fsync=True), each rank's copy on the other node",
        saves([0, 1, 2], force=False),
        {"every_steps": 2},
        local=True,
        local_fsync=True,
        ranks=RANKS,
    ),
]


class RankRecording:
    """One rank's recording: the tree before, its operations, its marks, and for each collective exchange it
    called (operations recorded when it entered, when it returned, the exchange, its channel)."""

    def __init__(
        self, before: Image, ops: list[Op], marks: list[tuple[int, str]], calls: list[tuple[int, int, str, str]]
    ) -> None:
        self.before, self.ops, self.marks, self.calls = before, ops, marks, calls


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _join(rank: int, port: int) -> None:
    """Join the ranks' gloo group as one node of its own (the local tier's peers are other nodes)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    os.environ["TRAINSTATE_DIST_TIMEOUT"] = "60"  # a judge that fails on one rank must not hang the other long
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=RANKS)


def _note_calls(recorder: Recorder, calls: list[tuple[int, int, str, str]]) -> None:
    """Note each exchange trainstate's coordinators make, on which channel (a gloo group of its own: the
    manager's control, its background saves, the local tier's copies run on separate threads)."""
    from trainstate._distributed.group import GlooCoordinator

    init = GlooCoordinator.__init__

    def named(self: Any, group: Any, timeout: float, channel: str = "save") -> None:
        init(self, group, timeout, channel)
        self.crash_channel = channel

    GlooCoordinator.__init__ = named  # type: ignore[method-assign]
    for exchange in EXCHANGES:
        real = getattr(GlooCoordinator, exchange)

        def noted(self: Any, *args: Any, _real: Any = real, _name: str = exchange, **kwargs: Any) -> Any:
            at = len(calls)
            calls.append((len(recorder.ops), -1, _name, self.crash_channel))  # in the order they were entered
            try:
                return _real(self, *args, **kwargs)
            finally:
                calls[at] = (calls[at][0], len(recorder.ops), _name, self.crash_channel)

        setattr(GlooCoordinator, exchange, noted)


def _rank(rank: int, port: int, root: str, name: str, work: str) -> None:
    """One rank: join the group, record the workload, write the recording into ``work``."""
    _join(rank, port)
    import torch.distributed as dist

    try:
        w = next(w for w in COLLECTIVE if w.name == name)
        recorder = Recorder(Path(root))
        calls: list[tuple[int, int, str, str]] = []
        _note_calls(recorder, calls)
        dist.barrier()  # the tree is empty when every rank's recorder takes it
        with recorder:
            dist.barrier()
            w.run(Place(Path(root)), recorder, w)
            dist.barrier()
        with open(Path(work) / f"rank{rank}.pkl", "wb") as f:
            pickle.dump(RankRecording(recorder.before, recorder.ops, recorder.marks, calls), f)
    finally:
        dist.destroy_process_group()


def _spawn(target: Any, *args: Any) -> list[Any]:
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, *args)) for r in range(RANKS)]
    for p in procs:
        p.start()
    return procs


def record(w: Workload, root: Path, work: Path) -> list[RankRecording]:
    """Run ``w`` on :data:`RANKS` spawned ranks in ``root``; their recordings."""
    procs = _spawn(_rank, _free_port(), str(root), w.name, str(work))
    for p in procs:
        p.join(300)
        if p.is_alive():
            p.kill()
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"a rank of {w.name!r} failed: exit codes {[p.exitcode for p in procs]}")
    recordings = []
    for r in range(RANKS):
        with open(work / f"rank{r}.pkl", "rb") as f:
            recordings.append(pickle.load(f))
    _matched(recordings)
    return recordings


def _matched(recordings: list[RankRecording]) -> list[tuple[str, list[tuple[int, int]]]]:
    """Each exchange the ranks made together: (its name, (entered, returned) in each rank's recording),
    matched by channel and order on it."""
    channels = sorted({c for r in recordings for *_, c in r.calls})
    out = []
    for channel in channels:
        each = [[(a, b, name) for a, b, name, c in r.calls if c == channel] for r in recordings]
        names = [[name for *_, name in calls] for calls in each]
        if any(n != names[0] for n in names):
            raise RuntimeError(f"the ranks made different exchanges on channel {channel!r}: {names}")
        out += [(names[0][j], [(calls[j][0], calls[j][1]) for calls in each]) for j in range(len(names[0]))]
    return out


def _consistent(cut: tuple[int, ...], exchanges: list[tuple[str, list[tuple[int, int]]]]) -> bool:
    """Whether every rank's point in ``cut`` can be where it stopped, given the others' (see the module doc)."""
    ranks = range(len(cut))
    for name, at in exchanges:
        who = EXCHANGES[name]
        receivers = [0] if who == "to0" else ranks
        senders = [0] if who == "from0" else ranks
        for a in receivers:  # a recorded something after the exchange returned; b had not entered it
            if cut[a] > at[a][1] and any(cut[b] < at[b][0] for b in senders):
                return False
    return True


def crash_states(recordings: list[RankRecording]) -> Iterator[tuple[str, str, list[str], Image]]:
    """(the cut, how the state was made, rank 0's marks made before the cut, the tree), each distinct (tree,
    marks) once."""
    assert len(recordings) == 2
    first, second = recordings
    exchanges = _matched(recordings)
    seen: set[tuple[str, tuple[int, ...]]] = set()
    for p0 in range(len(first.ops) + 1):
        for p1 in range(len(second.ops) + 1):
            if not _consistent((p0, p1), exchanges):
                continue
            merged = sorted([*first.ops[:p0], *second.ops[:p1]], key=lambda op: op.at)
            told = [label for at, label in first.marks if at <= p0]
            for how, image in states_after(first.before, merged):
                key = (digest(image), tuple(told))
                if key not in seen:
                    seen.add(key)
                    yield f"ranks at ops ({p0}, {p1})", how, told, image


def _judge(rank: int, port: int, name: str, inboxes: list[Any], outbox: Any) -> None:
    """One rank of the judges: the workload's oracle, run collectively on each state it is told of."""
    _join(rank, port)
    import logging
    import traceback

    import torch.distributed as dist

    logging.getLogger("trainstate").setLevel(logging.CRITICAL)
    w = next(w for w in COLLECTIVE if w.name == name)
    try:
        while (task := inboxes[rank].get()) is not None:
            root, seen, saved = task
            try:
                oracle(Place(Path(root)), w, seen, saved)
                outbox.put((rank, None))
            except Exception as e:  # noqa: BLE001 - a finding, reported with its rank
                outbox.put((rank, f"rank {rank}: " + traceback.format_exception_only(type(e), e)[-1].strip()))
    finally:
        dist.destroy_process_group()


class Judges:
    """:data:`RANKS` processes in one group judging states together: a local tier restores at the world size
    that wrote it. After a state fails on a rank the group may be out of step, so fresh judges are started."""

    def __init__(self, w: Workload) -> None:
        self.w = w
        self.procs: list[Any] = []

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.inboxes, self.outbox = [ctx.Queue() for _ in range(RANKS)], ctx.Queue()
        self.procs = _spawn(_judge, _free_port(), self.w.name, self.inboxes, self.outbox)

    def judge(self, place: Place, w: Workload, seen: list[str], saved: set[int]) -> None:
        """Raise AssertionError naming each rank's failure on this state (laid out at ``place``)."""
        if not self.procs:
            self._start()
        for inbox in self.inboxes:
            inbox.put((str(place.root), seen, saved))
        failures = []
        for _ in range(RANKS):
            try:
                _, failure = self.outbox.get(timeout=180)
            except queue.Empty:
                failure = "a rank did not answer in 180 s"
            if failure is not None:
                failures.append(failure)
        if failures:
            self.close()
            raise AssertionError("; ".join(failures))

    def close(self) -> None:
        for p in self.procs:
            p.kill()
            p.join()
        self.procs = []
