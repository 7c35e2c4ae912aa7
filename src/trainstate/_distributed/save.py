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
from typing import Any

from trainstate import _gc
from trainstate._distributed import per_rank
from trainstate._distributed.group import Coordinator, Failure
from trainstate._distributed.plan import RankPlan, assign, rank_plan
from trainstate._format import manifest
from trainstate._save.encode import Snapshot, encode_state
from trainstate._save.write import SaveResult, commit_manifest, plan_data, write_data
from trainstate._storage import Storage
from trainstate.errors import DistributedError


def save_collective(
    coord: Coordinator,
    root: str,
    state: Any,
    *,
    metadata: Any,
    overwrite: bool,
    fsync: bool,
    threads: int,
    storage: Storage,
    start: float,
) -> SaveResult:
    """Encode this rank's ``state`` and write it with the other ranks' (:func:`write_collective`)."""
    snapshot: Snapshot | None = None
    error: Exception | None = None
    try:
        with _gc.paused():
            snapshot = encode_state(state, metadata, rank=coord.rank)
    except Exception as e:  # noqa: BLE001 - every rank still takes part, so the others hear why
        error = e
    return write_collective(
        coord, root, snapshot, error, overwrite=overwrite, fsync=fsync, threads=threads, storage=storage, start=start
    )


def write_collective(
    coord: Coordinator,
    root: str,
    snapshot: Snapshot | None,
    error: Exception | None,
    *,
    overwrite: bool,
    fsync: bool,
    threads: int,
    storage: Storage,
    start: float,
) -> SaveResult:
    """Write this rank's encoded ``snapshot`` (or report ``error``, its encoding's failure) with the other
    ranks' as one checkpoint at ``root``; every rank returns the same result or raises."""
    rank = coord.rank
    mine: Any
    if error is None:
        assert snapshot is not None
        try:
            with _gc.paused():
                digests, parts = per_rank.split(snapshot.tree)
            mine = (_plan_of(snapshot), digests)
        except Exception as e:  # noqa: BLE001 - every rank still takes part, so the others hear why
            error = e
    if error is not None:
        mine = Failure(rank, f"{type(error).__name__}: {error}")
    sent = coord.gather(mine, "checkpoint save (planning)")
    reply: list[Any] | None = None
    if rank == 0:
        assert sent is not None
        reply = _decide(sent, storage, root, overwrite)
    share = coord.scatter(reply, "checkpoint save (planning)")
    if isinstance(share, Failure):
        if error is not None:
            raise error
        raise DistributedError(f"checkpoint save of {root} failed on rank {share.rank}: {share.message}")
    tmp, indices = share
    assert snapshot is not None
    entries = [snapshot.entries[i] for i in indices]
    groups, names = plan_data(storage, entries, threads, prefix=f"data-r{rank:05d}")
    try:
        files, tensors = write_data(storage, tmp, entries, groups, names, fsync=fsync, threads=threads)
        result: Any = (files, tensors, names, parts)
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
        outcome = _commit(written, snapshot, storage, tmp, root, overwrite=overwrite, fsync=fsync, start=start)
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


def _decide(sent: list[Any], storage: Storage, root: str, overwrite: bool) -> list[Any]:
    """Rank 0: every rank's share (the staging location and the boxes it writes), or a Failure for all."""
    failed = next((s for s in sent if isinstance(s, Failure)), None)
    if failed is None:
        differ = per_rank.differing_keys([s[1] for s in sent])
        if differ:
            key, other = differ[0]
            failed = Failure(
                other,
                f"rank {other}'s state differs from rank 0's under {key!r:.80} (outside per-rank values): every "
                "rank must save the same structure and plain values; wrap what differs by rank in "
                "trainstate.PerRank(...)",
            )
    if failed is None:
        try:
            shares = assign([s[0] for s in sent])
            tmp = storage.begin(root, overwrite=overwrite)
        except Exception as e:  # noqa: BLE001 - sent to every rank, which raises it
            failed = Failure(0, f"{type(e).__name__}: {e}")
    if failed is not None:
        return [failed] * len(sent)
    return [(tmp, share) for share in shares]


def _commit(
    written: list[Any],
    snapshot: Snapshot | None,
    storage: Storage,
    tmp: str,
    root: str,
    *,
    overwrite: bool,
    fsync: bool,
    start: float,
) -> Any:
    """Rank 0: merge every rank's entries into one manifest and commit; (bytes, seconds...) or a Failure."""
    names = [n for w in written if not isinstance(w, Failure) for n in w[2]]
    failed = next((w for w in written if isinstance(w, Failure)), None)
    if failed is not None:
        storage.abort(tmp, names)
        return failed
    assert snapshot is not None
    try:
        files = tuple(f for w in written for f in w[0])
        tensors = _merge_tensors([w[1] for w in written])
        full = Snapshot(per_rank.merge(snapshot.tree, [w[3] for w in written], tensors), snapshot.metadata, [])
        ordered = {e.name: tensors[e.name] for e in snapshot.entries if e.name in tensors}
        ordered.update(tensors)  # other ranks' own tensors (per-rank values) after rank 0's, in rank order
        nbytes, wrote = commit_manifest(
            storage, tmp, root, full, files, ordered, names, overwrite=overwrite, fsync=fsync, world_size=len(written)
        )
    except Exception as e:  # noqa: BLE001 - sent to every rank, which raises it
        storage.abort(tmp, names)
        return Failure(0, f"{type(e).__name__}: {e}")
    end = time.perf_counter()
    return nbytes, end - start, wrote - start, end - wrote


def _merge_tensors(per_rank_tensors: list[dict[str, manifest.TensorEntry]]) -> dict[str, manifest.TensorEntry]:
    """One entry per tensor, its chunks from every rank that wrote a part of it (ordered by offset)."""
    first: dict[str, manifest.TensorEntry] = {}
    chunks: dict[str, list[manifest.Chunk]] = {}
    for tensors in per_rank_tensors:
        for name, t in tensors.items():
            if name not in first:
                first[name] = t
                chunks[name] = list(t.chunks)
            else:
                chunks[name].extend(t.chunks)
    return {
        name: t if len(chunks[name]) == 1 else t._replace_chunks(tuple(sorted(chunks[name], key=lambda c: c.offset)))
        for name, t in first.items()
    }


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
