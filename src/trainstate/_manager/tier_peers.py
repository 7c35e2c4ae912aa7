"""The local tier under a process group: which ranks share a node, each node's local checkpoints copied to its
peers, and the agreement on the newest step every rank can restore from.

Nodes. Ranks on one machine share its local path. A node is ``LOCAL_WORLD_SIZE`` consecutive ranks (as torchrun
numbers them) when that is set, else the ranks of one host name.

Replicas. After rank r's local checkpoint of a step commits, its files go to the rank at the same place on each
of the next ``replicas`` nodes (a ring), which writes them into its own node's local path as ``rank{r}``'s
checkpoint (a staging name, then a rename: a copy is whole or absent), keeping the newest ``keep``. Every rank
sends and receives for the same steps, on a gloo group of the tier's own, on one background thread.

Restore. Every rank lists the local checkpoints its node holds, by rank folder; every rank then computes the same
answer: the newest step newer than the durable tier's for which every rank's checkpoint is on some node. A rank
whose node lacks its own (a node replaced, its path empty) is sent it by a node that holds a copy.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import struct
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from trainstate._distributed.group import Coordinator, Failure
from trainstate._format import run_dir as naming
from trainstate._format.manifest import MANIFEST_NAME
from trainstate._manager.newest import FATAL
from trainstate._storage.local import fsync_path, make_directories
from trainstate.errors import CheckpointError, DistributedError, InvalidArgumentError, StateMismatchError

log = logging.getLogger("trainstate")

_SIZES = 16  # bytes of the first message: the header's and the payload's lengths
_LARGEST = 1 << 40  # a copy announced larger than this is refused before memory is taken for it


class Nodes:
    """Which node each rank is on (ranks on one node share its local path)."""

    def __init__(self, control: Coordinator) -> None:
        self.rank, self.world = control.rank, control.world
        local = os.environ.get("LOCAL_WORLD_SIZE", "")
        if local.isdigit() and int(local) > 0 and self.world % int(local) == 0:
            size = int(local)
            self.node_of = [r // size for r in range(self.world)]
        else:
            hosts = control.all_gather(socket.gethostname(), "LocalTier (host names)")
            first: dict[str, int] = {}
            for h in hosts:
                first.setdefault(h, len(first))
            self.node_of = [first[h] for h in hosts]
        agreed = control.all_gather(self.node_of, "LocalTier (nodes)")
        if any(a != self.node_of for a in agreed):
            raise DistributedError(
                "LocalTier: the ranks disagree on which node each is on (LOCAL_WORLD_SIZE differs between them): "
                "launch every node with the same number of processes"
            )
        self.count = max(self.node_of) + 1
        self.members = [[r for r in range(self.world) if self.node_of[r] == n] for n in range(self.count)]

    def peer(self, rank: int, hops: int) -> int:
        """The rank at ``rank``'s place on the node ``hops`` nodes after its own (around the ring)."""
        node = self.node_of[rank]
        place = self.members[node].index(rank)
        there = self.members[(node + hops) % self.count]
        return there[place % len(there)]

    def targets(self, replicas: int) -> list[int]:
        """The ranks this rank sends its local checkpoints to."""
        return [self.peer(self.rank, j) for j in range(1, min(replicas, self.count - 1) + 1)]

    def sources(self, replicas: int) -> list[int]:
        """The ranks whose local checkpoints this rank receives (the ranks that send to it)."""
        return [r for r in range(self.world) if self.rank in self._targets_of(r, replicas)]

    def _targets_of(self, rank: int, replicas: int) -> list[int]:
        return [self.peer(rank, j) for j in range(1, min(replicas, self.count - 1) + 1)]


class Packed:
    """A checkpoint directory as one buffer: a header (its files' names and sizes) then their bytes, read once
    into memory taken once (every peer is sent the same buffer). Empty: no copy to send."""

    def __init__(self, body: bytearray | None = None, header_len: int = 0) -> None:
        self.body = body if body is not None else bytearray()
        self.header_len = header_len

    @property
    def empty(self) -> bool:
        return not self.body


def pack(folder: Path, step: int) -> Packed:
    """A checkpoint directory packed (see :class:`Packed`)."""
    checkpoint = folder / naming.name_for(step)
    files = sorted((p.name, p.stat().st_size) for p in checkpoint.iterdir() if p.is_file())
    header = json.dumps({"step": step, "files": [[n, size] for n, size in files]}).encode()
    body = bytearray(len(header) + sum(size for _, size in files))
    body[: len(header)] = header
    view, at = memoryview(body), len(header)
    for name, size in files:
        with open(checkpoint / name, "rb") as f:
            got = f.readinto(view[at : at + size])
        if got != size:
            raise CheckpointError(f"{checkpoint / name} changed while it was packed for a peer")
        at += size
    return Packed(body, len(header))


def unpack(folder: Path, packed: Packed, keep: int | None, fsync: bool) -> int:
    """Write a packed checkpoint into ``folder`` under its step's name (staged, then renamed); returns the step.
    With ``keep``, the folder keeps its newest ``keep`` checkpoints."""
    view = memoryview(packed.body)
    info = json.loads(bytes(view[: packed.header_len]))
    step = int(info["step"])
    files = [(str(n), int(size)) for n, size in info["files"]]
    payload = view[packed.header_len :]
    if any("/" in n or n in ("", ".", "..") for n, _ in files) or sum(s for _, s in files) != len(payload):
        raise CheckpointError(f"a damaged local checkpoint copy of step {step} was received")
    if fsync:
        make_directories(folder)
    else:
        folder.mkdir(parents=True, exist_ok=True)
    final = folder / naming.name_for(step)
    staging = folder / f".{final.name}.copy-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        at = 0
        for name, size in files:
            with open(staging / name, "wb") as f:
                f.write(payload[at : at + size])
                if fsync:
                    f.flush()  # a small file is still in the buffer: an fsync before this flushed nothing
                    os.fsync(f.fileno())
            at += size
        if fsync:  # the copy's names durable before it is renamed into place, and the rename after
            fsync_path(staging)
        if final.exists():
            shutil.rmtree(final)
        os.rename(staging, final)
        if fsync:
            fsync_path(folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if keep is not None:
        for old in held_steps(folder)[:-keep]:
            shutil.rmtree(folder / naming.name_for(old), ignore_errors=True)
    return step


def held_steps(folder: Path) -> list[int]:
    """The committed checkpoints (a manifest present) in a rank's folder, by step."""
    if not folder.is_dir():
        return []
    steps = []
    for p in folder.iterdir():
        step = naming.step_of(p.name)
        if step is not None and (p / MANIFEST_NAME).is_file():
            steps.append(step)
    return sorted(steps)


def send_and_receive(coord: Coordinator, sends: dict[int, Packed], receives: list[int], what: str) -> dict[int, Packed]:
    """Packed checkpoints to ``sends``' ranks, and one from each of ``receives``' (an empty one: none to send).
    A buffer sent to several peers is sent as it is, never copied."""
    sizes_out = {peer: bytearray(struct.pack("<qq", p.header_len, len(p.body))) for peer, p in sends.items()}
    sizes_in = {peer: bytearray(_SIZES) for peer in receives}
    coord.exchange(
        [(memoryview(b), peer, 1) for peer, b in sizes_out.items()],
        [(memoryview(b), peer, 1) for peer, b in sizes_in.items()],
        what,
    )
    lengths = {peer: struct.unpack("<qq", b) for peer, b in sizes_in.items()}
    if any(not 0 <= n <= m <= _LARGEST for n, m in lengths.values()):
        raise CheckpointError(f"{what}: a peer announced a copy of {lengths} bytes")
    bodies_in = {peer: bytearray(m) for peer, (_, m) in lengths.items()}
    coord.exchange(
        [(memoryview(p.body), peer, 2) for peer, p in sends.items() if p.body],
        [(memoryview(b), peer, 2) for peer, b in bodies_in.items() if b],
        what,
    )
    return {peer: Packed(b, lengths[peer][0]) for peer, b in bodies_in.items()}


def rank_folder(rank: int) -> str:
    return f"rank{rank:05d}"


def listing(world_root: Path, usable: Callable[[Path], dict[int, int]]) -> dict[int, dict[int, int]]:
    """The local checkpoints this node holds that may be restored, by the rank that wrote them: step -> the
    tier's own commit number (``usable`` says, of each rank folder)."""
    found: dict[int, dict[int, int]] = {}
    if world_root.is_dir():
        for p in world_root.iterdir():
            if p.name.startswith("rank") and p.name[4:].isdigit():
                steps = usable(p)
                if steps:
                    found[int(p.name[4:])] = steps
    return found


class Agreement:
    """Where each rank's local checkpoint of each step is, as every rank listed its node: the same on every rank."""

    def __init__(self, nodes: Nodes, listings: list[dict[int, dict[int, int]]]) -> None:
        self.nodes = nodes
        self.where: dict[tuple[int, int], set[int]] = {}  # (rank, step) -> the nodes that hold it
        self.order: dict[int, int] = {}  # step -> the tier's commit number (what "newest" means)
        for reporter, held in enumerate(listings):
            for rank, steps in held.items():
                for step, seq in steps.items():
                    self.where.setdefault((int(rank), int(step)), set()).add(nodes.node_of[reporter])
                    self.order[int(step)] = max(self.order.get(int(step), -1), int(seq))

    def drop(self, rank: int, step: int, node: int) -> None:
        """A copy that did not restore: not offered again."""
        self.where.get((rank, step), set()).discard(node)

    def newest(self) -> int | None:
        """The newest step (by the tier's commits) whose checkpoint every rank has on some node."""
        for step in sorted(self.order, key=lambda s: (self.order[s], s), reverse=True):
            if all(self.where.get((r, step)) for r in range(self.nodes.world)):
                return step
        return None

    def fetches(self, step: int) -> dict[int, int]:
        """For each rank whose node lacks its own checkpoint of ``step``: the rank that sends it a copy (the
        first rank of the lowest node holding one)."""
        plan = {}
        for rank in range(self.nodes.world):
            holders = self.where[(rank, step)]
            if self.nodes.node_of[rank] not in holders:
                plan[rank] = self.nodes.members[min(holders)][0]
        return plan


class Peers:
    """A local tier's work with the other ranks: copies to the peers (on a background thread, one step at a
    time) and the restore every rank agrees on."""

    def __init__(
        self,
        world_root: Path,
        nodes: Nodes,
        control: Coordinator,
        copies: Coordinator,
        replicas: int,
        keep: int,
        fsync: bool,
        every_steps: int = 1,
    ) -> None:
        settings = (every_steps, replicas, keep)
        differ = [
            r for r, theirs in enumerate(control.all_gather(settings, "LocalTier (settings)")) if theirs != settings
        ]
        if differ:
            raise InvalidArgumentError(
                f"LocalTier: rank {differ[0]} has every_steps, replicas, keep = {settings if not differ else '...'} other "
                "than this rank's: every rank saves and copies the same steps, so give every rank the same LocalTier"
            )
        self.world_root, self.nodes, self.control, self.copies = world_root, nodes, control, copies
        self.keep, self.fsync = keep, fsync
        self.rank = control.rank
        self.targets = nodes.targets(replicas)
        self.sources = nodes.sources(replicas)
        self.on_my_node = len(nodes.members[nodes.node_of[self.rank]])
        _check_paths_apart(world_root, nodes, control)
        _sweep_copies(world_root, nodes, self.rank)
        if replicas and nodes.count == 1 and self.rank == 0:
            log.warning(
                "LocalTier(replicas=%d): every rank is on one node (LOCAL_WORLD_SIZE, or one host name), so no local "
                "checkpoint is copied anywhere: losing this machine loses the local tier",
                replicas,
            )
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="trainstate-tier-copies")
        self._pending: Future[None] | None = None

    def agree_on(self, error: BaseException | None, what: str) -> None:
        """Every rank raises if one has ``error`` (that rank its own): one cheap reduction when none has."""
        if self.control.max([int(error is not None)], what)[0]:
            self.control.agree(error, what)

    @property
    def own(self) -> Path:
        return self.world_root / rank_folder(self.rank)

    def wait(self) -> None:
        """Wait for the copies in flight; raise their error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def replicate(self, step: int, saved: Future[Any] | None) -> None:
        """Once this rank's save of ``step`` (``saved``) committed, exchange it with the peers, in the background."""
        self._pending = self._pool.submit(self._exchange, step, saved)

    def _exchange(self, step: int, saved: Future[Any] | None) -> None:
        try:
            if saved is not None:
                saved.result()
            packed = pack(self.own, step)
        except BaseException:  # noqa: BLE001 - this rank's save failed (the manager raises it): send no copy
            packed = Packed()
        got = send_and_receive(
            self.copies, {t: packed for t in self.targets}, self.sources, f"LocalTier copies of step {step}"
        )
        del packed
        for source, copy in got.items():
            if not copy.empty:
                unpack(self.world_root / rank_folder(source), copy, self.keep, self.fsync)

    def restore_newest(self, restore: Callable[[int], None], usable: Callable[[Path], dict[int, int]]) -> int | None:
        """Every rank: find the newest step every rank's local checkpoint is on some node for (of those
        ``usable`` lets through), fetch what a node lacks from one that has it, restore it (``restore(step)``);
        past copies that do not restore, to older steps. None when no such step restores on every rank."""
        listings = self.control.all_gather(listing(self.world_root, usable), "LocalTier restore (listing)")
        agreement = Agreement(self.nodes, listings)
        for _ in range(4 * self.nodes.world + 4):  # each failed attempt drops a copy: bounded
            step = agreement.newest()
            if step is None:
                return None
            plan = agreement.fetches(step)
            sends = {}
            for rank, sender in plan.items():
                if sender == self.rank:
                    try:
                        sends[rank] = pack(self.world_root / rank_folder(rank), step)
                    except (OSError, CheckpointError):
                        sends[rank] = Packed()
            receives = [plan[self.rank]] if self.rank in plan else []
            got = send_and_receive(self.control, sends, receives, f"LocalTier restore (copies of step {step})")
            mine: Failure | None = None
            error: CheckpointError | None = None
            try:
                if receives:
                    copy = got[receives[0]]
                    if copy.empty:
                        raise CheckpointError(f"rank {receives[0]} could not send its copy of step {step}")
                    unpack(self.own, copy, None, self.fsync)
                restore(step)
            except StateMismatchError as e:  # a misplaced copy, or a job laid out otherwise: not this copy
                mine, error = Failure(self.rank, str(e).splitlines()[0][:300]), e
            except FATAL as e:
                mine, error = Failure(self.rank, str(e), fatal=True), e
            except (CheckpointError, OSError) as e:  # damaged, or a fetched copy that cannot be written here
                mine, error = Failure(self.rank, str(e).splitlines()[0][:300]), None
            failures = [f for f in self.control.all_gather(mine, "LocalTier restore") if f is not None]
            fatal = next((f for f in failures if f.fatal), None)
            if fatal is not None:
                if error is not None and mine is not None and mine.fatal:
                    raise error
                raise DistributedError(f"LocalTier restore of step {step} failed on rank {fatal.rank}: {fatal.message}")
            if not failures:
                log.info("resumed from the local tier: step %d (%d copies fetched from peers)", step, len(plan))
                return step
            for f in failures:
                log.warning("local tier: rank %d's copy of step %d does not restore (%s)", f.rank, step, f.message)
                agreement.drop(f.rank, step, self.nodes.node_of[f.rank])
                if f.rank in plan:
                    agreement.drop(f.rank, step, self.nodes.node_of[plan[f.rank]])
        return None

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)


def _check_paths_apart(world_root: Path, nodes: Nodes, control: Coordinator) -> None:
    """Refuse a local path that several nodes share (a network filesystem, or one path given to simulated nodes
    on one machine): a node's loss would take every copy with it, and the copies would overwrite each other.
    Each node's first rank leaves a mark of this job's in its path; every rank learns whether a node saw
    another's."""
    token = control.broadcast(uuid.uuid4().hex if control.rank == 0 else None, "LocalTier (paths)")
    node = nodes.node_of[control.rank]
    first = nodes.members[node][0] == control.rank
    marks = world_root.parent / "_nodes"
    mine = marks / f"{token}-{node}"
    if first:
        marks.mkdir(parents=True, exist_ok=True)
        mine.touch()
    control.all_gather(None, "LocalTier (paths)")  # every mark made before any is looked at
    seen = sorted({p.name.rsplit("-", 1)[1] for p in marks.glob(f"{token}-*")}) if first else []
    shared = control.all_gather(seen if len(seen) > 1 else None, "LocalTier (paths)")
    if first:
        mine.unlink(missing_ok=True)
    others = next((s for s in shared if s), None)
    if others is not None:
        raise InvalidArgumentError(
            f"LocalTier: the local path {world_root.parent} is shared by nodes {', '.join(others)} (a network "
            "filesystem, or one path for several machines): give each node a path on its own disk or tmpfs "
            "(/dev/shm/...), or leave local= out"
        )


def _sweep_copies(world_root: Path, nodes: Nodes, rank: int) -> None:
    """Each node's first rank removes the staging folders of copies a kill cut short (``.step_N.copy-*``)."""
    if nodes.members[nodes.node_of[rank]][0] != rank or not world_root.is_dir():
        return
    for folder in world_root.iterdir():
        if folder.is_dir() and folder.name.startswith("rank"):
            for leftover in folder.glob(".step_*.copy-*"):
                shutil.rmtree(leftover, ignore_errors=True)
