"""Collective save: every rank writes its own data files in parallel, then rank 0 commits one manifest.

The protocol (docs/distributed.md), on the coordination group:

1. *plan*: every rank encodes its state and sends rank 0 its boxes and the digest of its tree; rank 0
   checks that the ranks agree, assigns each box one writer (:mod:`plan`), opens the staging location and
   sends each rank its share.
2. *write*: every rank writes its share into files of its own (``data-r00003-00000.safetensors``), in the
   staging location, and sends rank 0 their entries and its per-rank values.
3. *commit*: rank 0 merges the entries into one manifest, writes it and commits; every rank learns the
   outcome. Nothing is committed unless every rank wrote its share; a failure anywhere (or a rank that
   falls silent past the timeout) raises on every rank, and rank 0 removes the staging location.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple, Protocol

import numpy as np

from trainstate import _gc
from trainstate._distributed import per_rank
from trainstate._distributed.group import Coordinator, Failure
from trainstate._distributed.plan import Assignment, RankPlan, assign, rank_plan
from trainstate._format import manifest
from trainstate._format.chunk_table import ChunkTable
from trainstate._save.encode import Entry, Snapshot, encode_state
from trainstate._save.options import SaveOptions
from trainstate._save.write import SaveResult, commit_manifest, plan_data, write_data
from trainstate._storage import Storage
from trainstate._transforms import aes_gcm
from trainstate.errors import DistributedError


class ShareWriter(Protocol):
    """Writes a rank's share of a collective save somewhere other than the staging location (an
    incremental run's pool, ``trainstate._incremental.save``), and hears how the save ended."""

    def write_share(
        self, entries: list[Entry], rank: int, options: SaveOptions
    ) -> tuple[tuple[manifest.FileEntry, ...], dict[str, manifest.TensorEntry]]: ...

    def settle(self, committed: bool) -> None: ...


def save_collective(
    coord: Coordinator,
    root: str,
    state: Any,
    *,
    metadata: Any,
    storage: Storage,
    options: SaveOptions,
    start: float,
) -> SaveResult:
    """Encode this rank's ``state`` and write it with the other ranks' (:func:`write_collective`).

    As a single-process save: the collector paused throughout. Rank 0 receives every rank's plan and
    entries (millions of small objects at 1,024 ranks), none of them in a cycle.
    """
    with _gc.paused():
        snapshot: Snapshot | None = None
        error: Exception | None = None
        try:
            snapshot = encode_state(state, metadata, rank=coord.rank)
        except Exception as e:  # noqa: BLE001 - every rank still takes part, so the others hear why
            error = e
        return write_collective(coord, root, snapshot, error, storage=storage, options=options, start=start)


def write_collective(
    coord: Coordinator,
    root: str,
    snapshot: Snapshot | None,
    error: Exception | None,
    *,
    storage: Storage,
    options: SaveOptions,
    start: float,
    share_writer: ShareWriter | None = None,
) -> SaveResult:
    """Write this rank's encoded ``snapshot`` (or report ``error``, its encoding's failure) with the other
    ranks' as one checkpoint at ``root``; every rank returns the same result or raises.

    ``options`` come from :func:`~trainstate._save.options.save_options`. With compression or a key each
    rank cuts its boxes into chunks and compresses / encrypts them as a single process does
    (``_save/chunked.py``: a fresh random nonce per chunk, from the kernel's generator, so ranks forked with
    the same seeds still draw different ones); rank 0's merge lists each box's chunks in its place, checks
    that no nonce repeats, and authenticates the one manifest under a salt of its own. ``share_writer``
    writes this rank's share instead (incremental runs: into the pool, sharing what did not change), and
    hears whether the save committed."""
    try:
        result = _write_collective(coord, root, snapshot, error, storage, options, start, share_writer)
    except BaseException:
        if share_writer is not None:
            share_writer.settle(False)
        raise
    if share_writer is not None:
        share_writer.settle(True)
    return result


def _write_collective(
    coord: Coordinator,
    root: str,
    snapshot: Snapshot | None,
    error: Exception | None,
    storage: Storage,
    options: SaveOptions,
    start: float,
    share_writer: ShareWriter | None,
) -> SaveResult:
    rank = coord.rank
    mine: Any
    if error is None:
        assert snapshot is not None
        try:
            digests, parts = per_rank.split(snapshot.tree)
            mine = (_plan_of(snapshot), digests, str(root), _key_identity(options))
        except Exception as e:  # noqa: BLE001 - every rank still takes part, so the others hear why
            error = e
    if error is not None:
        mine = Failure(rank, f"{type(error).__name__}: {error}")
    sent = coord.gather(mine, "checkpoint save (planning)")
    reply: list[Any] | None = None
    plan: Assignment | None = None
    if rank == 0:
        assert sent is not None
        reply, plan = _decide(sent, storage, root, options.overwrite)
    share = coord.scatter(reply, "checkpoint save (planning)")
    if isinstance(share, Failure):
        if error is not None:
            raise error
        raise DistributedError(f"checkpoint save of {root} failed on rank {share.rank}: {share.message}")
    tmp, indices = share
    assert snapshot is not None
    entries = [snapshot.entries[i] for i in indices]
    names: list[str] = []  # the data files this rank writes in the staging location
    try:
        if share_writer is None:
            groups, names = plan_data(storage, entries, options, prefix=f"data-r{rank:05d}")
            files, tensors = write_data(storage, tmp, entries, groups, names, options)
        else:
            files, tensors = share_writer.write_share(entries, rank, options)
        result: Any = (_written(files, tensors, options.encoding is not None), names, parts)
    except Exception as e:  # noqa: BLE001 - reported to rank 0, which aborts the save for every rank
        _remove(storage, tmp, names)
        result, error = Failure(rank, f"{type(e).__name__}: {e}"), e
    try:
        written = coord.gather(result, "checkpoint save (writing)")
    except DistributedError:  # a rank died or fell silent: nothing will be committed
        _take_back(storage, tmp, names, rank)
        raise
    outcome: Any = None
    if rank == 0:
        assert written is not None
        assert plan is not None
        outcome = _commit(written, plan, snapshot, storage, tmp, root, options, start)
    outcome = coord.broadcast(outcome, "checkpoint save (commit)")
    if isinstance(outcome, Failure):
        if error is not None:
            raise error
        raise DistributedError(f"checkpoint save of {root} failed on rank {outcome.rank}: {outcome.message}")
    return SaveResult(str(root), *outcome)


def _plan_of(snapshot: Snapshot) -> RankPlan:
    return rank_plan(
        [(e.name, (e.dtype, e.kind, e.global_shape), e.offset, e.shape, e.nbytes) for e in snapshot.entries]
    )


_KEY_IDENTITY_INFO = b"trainstate collective key identity v1"


def _key_identity(options: SaveOptions) -> bytes | None:
    """What rank 0 compares of each rank's key: a subkey for this purpose alone (it tells nothing of the
    key, and is only sent to rank 0, never written), or None without a key."""
    return None if options.key is None else options.key.derive(_KEY_IDENTITY_INFO, length=16)


def _keys_differ(rank: int, theirs: bytes | None, ours: bytes | None) -> str:
    if theirs is None or ours is None:
        has, lacks = (0, rank) if theirs is None else (rank, 0)
        found = f"rank {has} saves with a key, rank {lacks} without one"
    else:
        found = f"rank {rank} saves with another key than rank 0"
    return (
        f"{found}: each rank encrypts its own chunks, so an encrypted collective save needs the same key on "
        "every rank (else rank 0 would commit chunks its key cannot decrypt, or plaintext ones in an encrypted "
        "checkpoint). Pass the same key= (or key_env= naming a variable that holds it on every node)"
    )


def _decide(sent: list[Any], storage: Storage, root: str, overwrite: bool) -> tuple[list[Any], Assignment | None]:
    """Rank 0: every rank's share (the staging location and the boxes it writes), or a Failure for all;
    and the plan, which the commit reads the manifest's boxes from."""
    failed = next((s for s in sent if isinstance(s, Failure)), None)
    if failed is None:
        elsewhere = next((r for r, s in enumerate(sent) if s[2] != sent[0][2]), None)
        if elsewhere is not None:  # each rank would believe its own path holds the checkpoint
            failed = Failure(
                elsewhere,
                f"rank {elsewhere} saves to {sent[elsewhere][2]!r:.200}, rank 0 to {sent[0][2]!r:.200}: a collective "
                "save writes one checkpoint, so every rank passes the same path (one every rank sees: a shared "
                "filesystem or an object store), or collective=False to save each rank's own",
            )
    if failed is None:
        other = next((r for r, s in enumerate(sent) if s[3] != sent[0][3]), None)
        if other is not None:  # rank 0 would seal chunks it cannot decrypt, or name plaintext ones
            failed = Failure(other, _keys_differ(other, sent[other][3], sent[0][3]))
    if failed is None:
        differ = per_rank.differing_keys([s[1] for s in sent])
        if differ:
            key, other = differ[0]
            failed = Failure(
                other,
                f"rank {other}'s state differs from rank 0's under {key!r:.80} (outside per-rank values): every "
                "rank must save the same structure and plain values; wrap what differs by rank in "
                "trainstate.PerRank(...). A value meant to be the same on every rank (a ResumableSampler with "
                "global_batch_size, a step count) that differs means the ranks are out of step: one took more "
                "batches than another before this save",
            )
    if failed is None:
        try:
            plan = assign([s[0] for s in sent])
            tmp = storage.begin(root, overwrite=overwrite)
        except Exception as e:  # noqa: BLE001 - sent to every rank, which raises it
            failed = Failure(0, f"{type(e).__name__}: {e}")
    if failed is not None:
        return [failed] * len(sent), None
    return [(tmp, share) for share in plan.shares], plan


def _commit(
    written: list[Any],
    plan: Assignment,
    snapshot: Snapshot | None,
    storage: Storage,
    tmp: str,
    root: str,
    options: SaveOptions,
    start: float,
) -> Any:
    """Rank 0: merge every rank's entries into one manifest and commit; (bytes, seconds...) or a Failure."""
    names = [n for w in written if not isinstance(w, Failure) for n in w[1]]
    failed = next((w for w in written if isinstance(w, Failure)), None)
    if failed is not None:
        storage.abort(tmp, names)
        return failed
    assert snapshot is not None
    try:
        full, files, tensors = merge(written, plan, snapshot)
        nbytes, wrote = commit_manifest(storage, tmp, root, full, files, tensors, names, options, len(written))
    except Exception as e:  # noqa: BLE001 - sent to every rank, which raises it
        storage.abort(tmp, names)
        return Failure(0, f"{type(e).__name__}: {e}")
    end = time.perf_counter()
    nbytes -= sum(f.size for f in files if f.pool and not f.new)  # an incremental run's: written before
    return nbytes, end - start, wrote - start, end - wrote


class Written(NamedTuple):
    """What a rank wrote, as columns (a row per chunk, its boxes' chunks in share order): its data files, and
    where each chunk lies in them — the message a rank sends rank 0 after writing.

    Without chunk transforms each box is one chunk (``counts``, ``offsets``, ``shapes`` are None: the plan
    has the boxes already); compressed, each box is cut into chunks (``chunked.py``) and each row says which
    part of the box it holds."""

    files: tuple[manifest.FileEntry, ...]
    file: np.ndarray  # index into files
    ranges: np.ndarray  # (n, 2) byte ranges
    checksums: np.ndarray  # fixed-width bytes
    pieces: dict[int, manifest.Pieces]  # for the rows of chunks larger than a piece
    transforms: dict[int, tuple[dict[str, Any], ...]] | None = None  # the rows stored transformed
    counts: np.ndarray | None = None  # chunks per box, in share order
    offsets: np.ndarray | None = None  # (n, width) each chunk's offset in its tensor, zero-padded
    shapes: np.ndarray | None = None  # (n, width) each chunk's shape


def _written(
    files: tuple[manifest.FileEntry, ...], tensors: dict[str, manifest.TensorEntry], transformed: bool = False
) -> Written:
    """The columns of what a rank wrote; ``transformed``: its boxes went through chunk transforms, so each
    row says which part of its box it holds."""
    per_box = [t.chunks for t in tensors.values()]  # in share order (write_data keeps it)
    chunks = [c for box in per_box for c in box]
    where = {f.path: i for i, f in enumerate(files)}
    # a row per box says nothing of its chunks: where a box is cut, or a chunk transformed (compressed, or
    # one an incremental run shares from an earlier save), each row says which part of its box it holds
    cut = transformed or any(len(box) != 1 for box in per_box) or any(c.transforms for c in chunks)
    width = max((len(c.offset) for c in chunks), default=0)
    return Written(
        files,
        np.array([where[c.file] for c in chunks], dtype=np.int64),
        np.array([c.byte_range for c in chunks], dtype=np.int64).reshape(len(chunks), 2),
        np.array([c.checksum for c in chunks], dtype="S") if chunks else np.zeros(0, "S1"),
        {i: c.pieces for i, c in enumerate(chunks) if c.pieces is not None},
        {i: c.transforms for i, c in enumerate(chunks) if c.transforms} if cut else None,
        np.array([len(box) for box in per_box], dtype=np.int64) if cut else None,
        _padded([c.offset for c in chunks], width) if cut else None,
        _padded([c.shape for c in chunks], width) if cut else None,
    )


def _padded(rows: list[tuple[int, ...]], width: int) -> np.ndarray:
    out = np.zeros((len(rows), width), dtype=np.int64)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


def merge(
    written: list[Any], plan: Assignment, snapshot: Snapshot
) -> tuple[Snapshot, tuple[manifest.FileEntry, ...], ChunkTable]:
    """Rank 0: the merged tree (every rank's per-rank values), the data files and the tensor table.

    ``written[rank]`` is ``(Written, file names, per-rank values)``. The boxes come from the plan, already in
    manifest order (by tensor, then offset); each rank's columns are put in that order with one permutation.
    Where ranks cut their boxes into chunks (compression), each box's chunks follow one another in the
    order its writer made them (C order within the box), as a single process lists them.
    """
    cols: list[Written] = [w[0] for w in written]
    counts = [c.counts if c.counts is not None else np.ones(len(c.file), np.int64) for c in cols]
    if [len(n) for n in counts] != [len(s) for s in plan.shares] or any(
        int(n.sum()) != len(c.file) for n, c in zip(counts, cols)
    ):
        raise RuntimeError("a rank reported a different number of written boxes than it was assigned")
    rows = plan.written
    by_rank = np.lexsort((rows[:, -1], rows[:, -2]))  # manifest row of each rank's k-th box, rank after rank
    order = np.empty(len(rows), dtype=np.int64)
    order[by_rank] = np.arange(len(rows))  # each manifest row's place in the ranks' columns, end to end
    base = np.cumsum([0] + [len(c.files) for c in cols])[:-1]
    first = np.cumsum([0] + [len(c.file) for c in cols])[:-1]
    file = np.concatenate([c.file + b for c, b in zip(cols, base)]) if cols else np.zeros(0, np.int64)
    files, file = _once(tuple(f for c in cols for f in c.files), file)
    ranges = np.concatenate([c.ranges for c in cols]) if cols else np.zeros((0, 2), np.int64)
    checksums = np.concatenate([c.checksums for c in cols]) if cols else np.zeros(0, "S1")
    width = plan.width
    tensor = rows[:, 0]
    offsets, shapes = rows[:, 1 : 1 + width], rows[:, 1 + width : 1 + 2 * width]
    if all(c.counts is None for c in cols):  # a chunk per box: the plan's rows are the chunks
        chunk = order
        rank_row = by_rank  # each chunk's manifest row, rank after rank
    else:
        count = np.concatenate(counts)  # chunks of each box, rank after rank
        start = np.cumsum(count) - count  # its first chunk in the ranks' columns
        each = count[order]  # chunks of each manifest row
        at = np.cumsum(each) - each  # its first chunk in the manifest
        chunk = np.repeat(start[order] - at, each) + np.arange(int(each.sum()))
        rank_row = np.empty(len(chunk), dtype=np.int64)
        rank_row[chunk] = np.arange(len(chunk))
        tensor = np.repeat(tensor, each)
        boxes = np.cumsum([0] + [len(n) for n in counts])  # each rank's boxes: by_rank[boxes[r]:boxes[r + 1]]
        mine = [by_rank[boxes[r] : boxes[r + 1]] for r in range(len(cols))]
        offsets = np.concatenate([_part(c.offsets, offsets[m], width) for c, m in zip(cols, mine)])[chunk]
        shapes = np.concatenate([_part(c.shapes, shapes[m], width) for c, m in zip(cols, mine)])[chunk]
    pieces = {int(rank_row[f + k]): p for c, f in zip(cols, first.tolist()) for k, p in c.pieces.items()}
    transforms = {
        int(rank_row[f + k]): t for c, f in zip(cols, first.tolist()) for k, t in (c.transforms or {}).items()
    }
    _refuse_repeated_nonces(transforms.values())
    table = ChunkTable(
        [name for name, _ in plan.headers],
        [header for _, header in plan.headers],
        tensor,
        offsets,
        shapes,
        [f.path for f in files],
        file[chunk],
        ranges[chunk],
        checksums[chunk],
        pieces,
        transforms,
    )
    tree = per_rank.merge(snapshot.tree, [w[2] for w in written], table)
    return Snapshot(tree, snapshot.metadata, []), files, table


def _once(files: tuple[manifest.FileEntry, ...], file: np.ndarray) -> tuple[tuple[manifest.FileEntry, ...], np.ndarray]:
    """Each data file listed once, and each chunk's index into that list: ranks of an incremental run may
    refer to the same pool file (a box of it each, after a change of world size)."""
    first: dict[str, int] = {}
    for f in files:
        first.setdefault(f.path, len(first))
    if len(first) == len(files):
        return files, file
    where = np.array([first[f.path] for f in files], dtype=np.int64)
    kept = {first[f.path]: f for f in reversed(files)}
    return tuple(kept[i] for i in range(len(first))), where[file]


def _refuse_repeated_nonces(transforms: Any) -> None:
    """Rank 0: no two chunks of the checkpoint encrypted under the same nonce (each rank draws its own at
    random, 96 bits: a repeat means a broken generator, and GCM under a repeated nonce leaks both chunks)."""
    nonces = [step["nonce"] for steps in transforms for step in steps if step.get("name") == aes_gcm.NAME]
    if len(set(nonces)) != len(nonces):
        raise RuntimeError("two chunks were encrypted under the same nonce: this host's random generator is broken")


def _part(sent: np.ndarray | None, boxes: np.ndarray, width: int) -> np.ndarray:
    """A rank's chunks' offsets (or shapes) at the manifest's width: as it sent them, or its boxes' own
    where it sent none (a chunk per box)."""
    if sent is None:
        return boxes
    out = np.zeros((len(sent), width), dtype=np.int64)
    out[:, : sent.shape[1]] = sent
    return out


def _take_back(storage: Storage, tmp: str, names: list[str], rank: int) -> None:
    """A save that cannot commit: this rank deletes the files it wrote (on an object store the staging
    location is the checkpoint's own prefix, which only its writers can clean), and rank 0 the staging
    location where the backend has one of its own (a fresh directory, the dead rank's part files included)."""
    _remove(storage, tmp, names)
    if rank == 0:
        try:
            storage.abort(tmp, names)
        except Exception:  # noqa: BLE001 - best effort: the sweep removes a staging leftover later
            pass


def _remove(storage: Storage, tmp: str, names: list[str]) -> None:
    for name in names:
        try:
            storage.delete(storage.join(tmp, name))
        except Exception:  # noqa: BLE001 - best effort: rank 0's abort removes the staging location anyway
            pass
