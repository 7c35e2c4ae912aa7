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

Parts are matched by what the manifest says of their bytes (dtype, shape, the chunks' checksums) and the box
read, never by path alone: ranks loading different checkpoints share only what is the same. Not shared: reads
into accelerator memory (each rank reads its own through host staging) and the processes of a
``jax.distributed`` job (their coordinator moves no tensor bytes).
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
from trainstate.errors import CheckpointError, DistributedError

Read = tuple[str, memoryview, "Box | None"]  # a tensor's name, the flat bytes it lands in, its box (None: whole)
_DONE = 2  # agreements taken when the protocol is over: (1) what each rank reads, (2) how it went


class Key(NamedTuple):
    """One part's bytes, the same on every rank that reads them."""

    content: str  # a digest of the tensor's dtype, shape and chunk checksums
    name: str
    box: Box | None
    nbytes: int


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
        self, tensors: Mapping[str, manifest.TensorEntry], reads: Sequence[Read], read: Callable[[list[Read]], None]
    ) -> None:
        """Fill every view of ``reads``: ``read`` is given what this rank reads itself (its own parts and the
        shared ones it owns, and does any other local reading, e.g. into accelerators); the rest arrives
        from their owners once every rank's ``read`` succeeded. Raises on every rank if any rank failed."""
        rank = self.coord.rank
        digests: dict[str, str] = {}
        keys = [_key(tensors, digests, name, view, box) for name, view, box in reads]
        listed = self._agree(
            sorted({k for k in keys if k is not None}, key=_order), None, "load (what each rank reads)"
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
        error: BaseException | None = None
        self.reading = True
        try:
            read(mine)
        except BaseException as e:  # noqa: BLE001 - every rank learns of it below, this one re-raises it
            error = e
        self._agree(None, error, "load (reading)")
        sends: list[tuple[Any, int, int]] = []
        receives: list[tuple[Any, int, int]] = []
        for tag, (k, (owner, members)) in enumerate(sorted(owners.items(), key=lambda kv: _order(kv[0]))):
            if owner == rank:
                sends += [(_bytes(first[k]), m, tag) for m in members if m != rank]
            elif rank in members:
                receives.append((_bytes(first[k]), owner, tag))
        if sends or receives:
            self.coord.exchange(sends, receives, "load (sending the shared tensors)")
        for src, dst in copies:  # the same part twice in this rank's state, in separate memory
            np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))

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


def _key(
    tensors: Mapping[str, manifest.TensorEntry], digests: dict[str, str], name: str, view: memoryview, box: Box | None
) -> Key | None:
    if not view.nbytes:
        return None
    t = tensors[name]
    if box is not None and tuple(box[1]) == tuple(t.shape):
        box = None  # a part that is the whole tensor
    digest = digests.get(name)
    if digest is None:
        described = repr((t.dtype, tuple(t.shape), [(tuple(c.offset), tuple(c.shape), c.checksum) for c in t.chunks]))
        digest = digests[name] = hashlib.blake2b(described.encode(), digest_size=16).hexdigest()
    return Key(digest, name, None if box is None else (tuple(box[0]), tuple(box[1])), view.nbytes)


def _order(k: Key) -> tuple[int, str, str, str]:
    return (-k.nbytes, k.name, k.content, repr(k.box))


def _bytes(view: memoryview) -> Any:
    import torch

    return torch.from_numpy(np.frombuffer(view, np.uint8))


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
