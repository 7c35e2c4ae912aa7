"""Each byte read once per job: in a collective load, a part of the state that several ranks hold is read from
storage by one of them and sent to the others.

Under a process group every rank restores what it holds; data-parallel replicas (and the replicated dims of a
DTensor) hold the same bytes, so N ranks reading their own would read the checkpoint N times. Here the ranks
first list their reads (host memory only); a part listed by several ranks gets one owner among them, chosen
the same way on every rank and spread by bytes, as saves spread their writes. Each rank reads, with the usual
read path (checksums and all), its own parts and the shared parts it owns, straight into its live target.
Once every rank's reads are done, the owners send those bytes to the other holders, which receive them straight
into their live targets, point to point on the coordination (gloo) group.

Three steps, every rank taking each: (1) every rank's list of reads, (2) every rank's outcome, (3) the
transfers. A rank that fails before (2) takes part in the next agreement with its failure
(:meth:`Share.abandon`), so no rank waits for one that gave up. Any failure makes every rank raise an error
of the same kind (a :class:`CorruptCheckpointError` stays one, so a manager moves every rank on to the older
checkpoint together) and nothing is sent: a byte that failed its checksum reaches no rank's live state.

Reads into accelerator memory (a DDP model on GPUs) are shared the same way among the ranks that read them
into accelerators: the owner reads its parts through the ring (ring.py), and after the agreement each part
crosses in pieces of :data:`PIECE` bytes -- device to a host buffer on the owner, the gloo group, a host
buffer to the device on each receiver -- one piece at a time, in the same global order on every rank, so
host memory stays at one buffer. (NCCL could move them device to device; that path is not built, since it
could not be tested here: one GPU cannot hold two NCCL ranks.) Arrays that cannot be filled in parts (JAX
arrays, non-contiguous tensors) are read by each rank that holds them.

Parts are matched by what the manifest says of their bytes (dtype, shape, the chunks' checksums), the box read
and whether it lands in accelerator memory, never by path alone: ranks loading different checkpoints share
only what is the same. Not shared: the processes of a ``jax.distributed`` job (their coordinator moves no
tensor bytes).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from trainstate import errors
from trainstate._distributed import Coordinator
from trainstate._format import manifest
from trainstate._restore.files import Box
from trainstate._restore.ring import Staged
from trainstate.errors import CheckpointError, DistributedError

Read = tuple[str, memoryview, "Box | None"]  # a tensor's name, the flat bytes it lands in, its box (None: whole)
_DONE = 2  # agreements taken when the protocol is over: (1) what each rank reads, (2) how it went
PIECE = 32 << 20  # an accelerator part crosses in pieces of this size, through one host buffer per rank


class Key(NamedTuple):
    """One part's bytes, the same on every rank that reads them."""

    content: str  # a digest of the tensor's dtype, shape and chunk checksums
    name: str
    box: Box | None
    nbytes: int
    device: bool = False  # read into accelerator memory (through the ring), not host memory


@dataclass(frozen=True)
class _Failed:
    """What a rank sends instead of its reads or its outcome when its part of the load failed."""

    rank: int
    kind: str  # the error's class name
    message: str


class Share:
    """One collective load's sharing of reads over ``coord``; :meth:`run` reads, :meth:`abandon` gives up."""

    def __init__(self, coord: Coordinator) -> None:
        self.coord = coord
        self.taken = 0  # agreements taken so far (of _DONE)
        self.reading = False  # whether this rank began reading (else a failure left its target as it was)

    def run(
        self,
        tensors: Mapping[str, manifest.TensorEntry],
        reads: Sequence[Read],
        staged: Sequence[Staged],
        read: Callable[[list[Read], list[Staged]], None],
        verified: bool = True,
    ) -> None:
        """Fill every view of ``reads`` and every accelerator target of ``staged``: ``read`` is given what this
        rank reads itself (its own parts and the shared ones it owns); the rest arrives from their owners once
        every rank's ``read`` succeeded. Raises on every rank if any rank failed. A part is shared only between
        ranks that read it with the same ``verified`` (``load(verify=)``): a rank that checks its checksums never
        takes bytes that another rank read unchecked."""
        rank = self.coord.rank
        digests: dict[str, str] = {}
        unchecked = not verified
        keys = [_key(tensors, digests, name, view.nbytes, box, unchecked=unchecked) for name, view, box in reads]
        device_keys = [
            _key(tensors, digests, s.name, s.nbytes, s.box, device=True, unchecked=unchecked) if s.cuttable else None
            for s in staged
        ]
        listed = self._agree(
            sorted({k for k in [*keys, *device_keys] if k is not None}, key=_order),
            None,
            "load (what each rank reads)",
        )
        owners = assign(listed)
        mine: list[Read] = []
        first: dict[Key, memoryview] = {}  # the memory a key is read or received into; others copy it
        copies: list[tuple[memoryview, memoryview]] = []
        for r, k in zip(reads, keys):
            if k is None or k not in owners or owners[k][0] == rank:
                mine.append(r)
                if k is not None:
                    first.setdefault(k, r[1])
            elif k in first:
                copies.append((first[k], r[1]))
            else:
                first[k] = r[1]
        mine_staged: list[Staged] = []
        held: dict[Key, Staged] = {}  # the accelerator target a key is read or received into
        later: list[tuple[Staged, Staged]] = []  # the same part twice on this rank's accelerators
        for s, k in zip(staged, device_keys):
            if k is not None and k in held:
                later.append((held[k], s))
                continue
            if k is None or k not in owners or owners[k][0] == rank:
                mine_staged.append(s)
            if k is not None:
                held[k] = s
        error: BaseException | None = None
        self.reading = True
        try:
            read(mine, mine_staged)
        except BaseException as e:  # noqa: BLE001 - every rank learns of it below, this one re-raises it
            error = e
        self._agree(None, error, "load (reading)")
        sends: list[tuple[Any, int, int]] = []
        receives: list[tuple[Any, int, int]] = []
        ordered = sorted(owners.items(), key=lambda kv: _order(kv[0]))
        for tag, (k, (owner, members)) in enumerate(ordered):
            if k.device:
                continue
            if owner == rank:
                sends += [(first[k], m, tag) for m in members if m != rank]
            elif rank in members:
                receives.append((first[k], owner, tag))
        if sends or receives:
            self.coord.exchange(sends, receives, "load (sending the shared tensors)")
        for src, dst in copies:  # the same part twice in this rank's state, in separate memory
            np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))
        self._send_device_parts([(k, o, m) for k, (o, m) in ordered if k.device and rank in m], held)
        for src_staged, dst_staged in later:  # a second accelerator home of one part: copied on this rank
            _copy_device_part(src_staged, dst_staged)

    def _send_device_parts(self, parts: list[tuple[Key, int, tuple[int, ...]]], held: Mapping[Key, Staged]) -> None:
        """Each shared accelerator part this rank holds, piece by piece through one host buffer, in the global
        order every rank walks: the owner copies a piece to the host and sends it to each member, a member
        receives it and copies it to its device."""
        if not parts:
            return
        rank = self.coord.rank
        first = held[parts[0][0]]
        buffer = first.adapter.staging(min(PIECE, max(k.nbytes for k, _, _ in parts)), like=first.local)
        tag = 1 << 20  # above the host parts' tags
        for k, owner, members in parts:
            s = held[k]
            for lo in range(0, k.nbytes, PIECE):
                tag += 1
                piece = buffer[: min(PIECE, k.nbytes - lo)]
                data = piece.data
                if owner == rank:
                    s.adapter.copy_range_out(s.local, lo, piece)
                    sends = [(data, m, tag) for m in members if m != rank]
                    self.coord.exchange(sends, [], "load (sending the shared tensors)")
                else:
                    self.coord.exchange([], [(data, owner, tag)], "load (receiving the shared tensors)")
                    s.adapter.copy_in_async([(s.local, lo, piece)])()

    def abandon(self, error: BaseException) -> None:
        """This rank failed outside :meth:`run`'s reads: tell the others at the next agreement (they raise there)."""
        if self.taken >= _DONE:
            return
        try:
            self._agree(None, error, "load")
        except BaseException:  # noqa: BLE001 - ``error`` is what this rank raises
            pass

    def _agree(self, mine: Any, error: BaseException | None, what: str) -> list[Any]:
        """Every rank's ``mine`` (this rank's failure instead, where ``error``); raises on every rank if any failed."""
        self.taken += 1
        sent = mine if error is None else _Failed(self.coord.rank, type(error).__name__, str(error)[:4000])
        try:
            got = self.coord.all_gather(sent, what)
        except BaseException:
            self.taken = _DONE
            raise
        if error is not None:
            self.taken = _DONE
            raise error
        failed = [g for g in got if isinstance(g, _Failed)]
        if failed:
            self.taken = _DONE
            raise _error_of(failed[0], self.coord.world)
        return got


def assign(listed: list[list[Key]]) -> dict[Key, tuple[int, tuple[int, ...]]]:
    """Each key listed by several ranks -> (its owner, the ranks that hold it).

    Biggest first, each to the member with the fewest bytes to read so far (its unshared parts count), ties
    to the lowest rank: the same answer on every rank, and the reading spread over the ranks.
    """
    members: dict[Key, list[int]] = {}
    for rank, keys in enumerate(listed):
        for k in keys:
            members.setdefault(k, []).append(rank)
    load = [0] * len(listed)
    for k, ranks in members.items():
        if len(ranks) == 1:
            load[ranks[0]] += k.nbytes
    out: dict[Key, tuple[int, tuple[int, ...]]] = {}
    for k in sorted((k for k, ranks in members.items() if len(ranks) > 1), key=_order):
        owner = min(members[k], key=lambda r: (load[r], r))
        load[owner] += k.nbytes
        out[k] = (owner, tuple(members[k]))
    return out


def _copy_device_part(src: Staged, dst: Staged) -> None:
    """One accelerator part into a second target on this rank (a tensor the state holds twice), via the host."""
    buffer = src.adapter.staging(min(PIECE, src.nbytes), like=src.local)
    for lo in range(0, src.nbytes, PIECE):
        piece = buffer[: min(PIECE, src.nbytes - lo)]
        src.adapter.copy_range_out(src.local, lo, piece)
        dst.adapter.copy_in_async([(dst.local, lo, piece)])()


def _key(
    tensors: Mapping[str, manifest.TensorEntry],
    digests: dict[str, str],
    name: str,
    nbytes: int,
    box: Box | None,
    *,
    device: bool = False,
    unchecked: bool = False,
) -> Key | None:
    if not nbytes:
        return None
    t = tensors[name]
    if box is not None and tuple(box[1]) == tuple(t.shape):
        box = None  # a part that is the whole tensor
    digest = digests.get(name)
    if digest is None:
        described = repr((t.dtype, tuple(t.shape), [(tuple(c.offset), tuple(c.shape), c.checksum) for c in t.chunks]))
        digest = hashlib.blake2b(described.encode(), digest_size=16).hexdigest()
        digest = digests[name] = digest + "-unchecked" if unchecked else digest  # read with verify=False
    return Key(digest, name, None if box is None else (tuple(box[0]), tuple(box[1])), nbytes, device)


def _order(k: Key) -> tuple[int, str, str, str, bool]:
    return (-k.nbytes, k.name, k.content, repr(k.box), k.device)


def _error_of(failed: _Failed, world: int) -> CheckpointError:
    """Another rank's failure, raised here as the same kind where its class takes a message, else as a
    :class:`DistributedError`."""
    message = f"rank {failed.rank} of {world} could not load its part: {failed.kind}: {failed.message}"
    cls = getattr(errors, failed.kind, None)
    if (
        isinstance(cls, type)
        and issubclass(cls, CheckpointError)
        and all("__init__" not in vars(c) for c in cls.__mro__ if issubclass(c, CheckpointError))
    ):
        return cls(message)
    return DistributedError(message)
