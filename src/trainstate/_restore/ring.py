"""Restore onto accelerators: reads and checksums on CPU threads into a small ring of reused host buffers,
host-to-device copies queued behind them, overlapping the next reads; one wait at the end.

The ring is :data:`SLOTS` buffers of :func:`slot_bytes` each, page-locked where the framework can make them
(torch on CUDA: a copy from pinned memory ran 7x faster than from ordinary memory, bench/bench_gpu.py). A
round fills one slot (reads split over ``threads`` lanes, every span checked before it is copied in), then
queues that slot's copies to the device (torch: on a CUDA stream of the restore's own, after the work
already queued on the current stream) and moves on to the next slot; a slot is refilled only once its
copies have landed. So the host reads round *n + 1* while the device receives round *n*, and **host memory
stays at SLOTS x slot_bytes**, whatever the state's size: a tensor larger than a slot is cut at its piece
boundaries (every chunk trainstate writes over one piece has per-piece checksums) and crosses in several
rounds. A part that cannot be cut -- a chunk without pieces larger than a slot (format 1.0, imports), a
compressed or encrypted tensor, a part assembled from several ranks' boxes, a non-contiguous target -- goes
through a buffer of its own size, allocated for it and dropped after its copy.

A byte that fails its checksum never reaches the device: a round's copies are queued only after every
span of the round passed, and on a failure the copies already queued are waited for before the error is
raised, so what is left is rounds restored whole and targets not reached keeping their own values.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from trainstate._cores import DEFAULT_THREADS
from trainstate._format import manifest
from trainstate._frameworks import Adapter, RefusedPair
from trainstate._restore.files import Box, Opened, Span, batch_spans, batching, chunk_spans, run_lanes
from trainstate.errors import UnsupportedValueError

SLOTS = 3  # one being read, one being copied, one spare so a slow copy does not stall the reads at once
MIN_SLOT_BYTES = 32 << 20
LANE_BYTES = 4 << 20  # each reader lane's share of a round, at least


def slot_bytes(threads: int) -> int:
    """Bytes per slot: enough that each of ``threads`` lanes gets a few MiB per round."""
    return max(MIN_SLOT_BYTES, threads * LANE_BYTES)


class Staged(NamedTuple):
    """A read into a live accelerator array (or its local shard), which goes through host staging."""

    name: str
    adapter: Adapter
    local: Any  # the accelerator array the bytes land in
    box: Box | None
    nbytes: int
    cuttable: bool  # its bytes may land in byte ranges (contiguous): it can cross in several rounds
    landed: Callable[[Any], None] | None = None  # told what the target now is, once its copy landed (JAX: new)


class _Part(NamedTuple):
    """Bytes ``[lo, hi)`` of a staged target's flat bytes, with the spans that cover them (None: read whole)."""

    staged: Staged
    lo: int
    hi: int
    spans: list[Span] | None
    file: str = ""  # the data file the spans are in


ReadWhole = Callable[[list[tuple[str, memoryview, Box | None]]], None]


def read_to_device(
    ck: Opened,
    staged: Sequence[Staged],
    read_whole: ReadWhole,
    *,
    verify: bool,
    threads: int = DEFAULT_THREADS,
    slots: int = SLOTS,
    size: int | None = None,
) -> int:
    """Read every staged target through the ring (``read_whole`` reads parts that are not cut into spans);
    returns the host bytes the ring allocated, for the tests and benchmarks that bound it."""
    if not staged:
        return 0
    size = size or slot_bytes(threads)
    parts = [p for s in staged for p in _parts(ck, s, size)]
    rounds = _rounds(parts, size)
    buffers: list[np.ndarray | None] = [None] * slots
    waits: list[Callable[[], None] | None] = [None] * slots
    allocated = 0
    try:
        for i, parts_of_round in enumerate(rounds):
            k = i % slots
            wait = waits[k]
            if wait is not None:
                wait()  # this slot's last copies have landed: it may be written again
                waits[k] = None
            need = sum(_aligned(p.hi - p.lo) for p in parts_of_round)
            if need > size:  # one part that cannot be cut: a buffer of its own, dropped after its copy
                buffer = parts_of_round[0].staged.adapter.staging(need, like=parts_of_round[0].staged.local)
                allocated += need
            else:
                reused = buffers[k]
                if reused is None:
                    reused = buffers[k] = staged[0].adapter.staging(size, like=staged[0].local)
                    allocated += size
                buffer = reused
            views = _place(parts_of_round, buffer)
            _read_round(ck, parts_of_round, views, read_whole, verify=verify, threads=threads)
            waits[k] = _copy(parts_of_round, views, buffer)
    finally:
        for wait in waits:  # on an error too: no copy may still read a buffer once this returns
            if wait is not None:
                wait()
    return allocated


def _aligned(n: int) -> int:
    return -(-n // 64) * 64  # each part starts on a cache line


def _parts(ck: Opened, s: Staged, size: int) -> list[_Part]:
    """A staged target as parts of at most ``size`` bytes, cut between its spans where it can be."""
    t = ck.manifest.tensors[s.name]
    box = None if s.box is not None and s.box[1] == t.shape else s.box
    chunk = _straight(t, box)
    if chunk is None:
        return [_Part(s, 0, s.nbytes, None)]
    spans = chunk_spans(chunk, None, f"tensor {s.name} ({chunk.file})")
    if not spans:  # an empty chunk listed with per-piece checksums (none): read as the host path reads it
        return [_Part(s, 0, s.nbytes, None)]
    if not s.cuttable or s.nbytes <= size:
        return [_Part(s, 0, s.nbytes, spans, chunk.file)]
    begin = chunk.byte_range[0]
    out: list[_Part] = []
    run: list[Span] = []
    for span in spans:
        if run and span.end - run[0].begin > size:
            out.append(_Part(s, run[0].begin - begin, run[-1].end - begin, run, chunk.file))
            run = []
        run.append(span)
    out.append(_Part(s, run[0].begin - begin, run[-1].end - begin, run, chunk.file))
    return out


def _straight(t: manifest.TensorEntry, box: Box | None) -> manifest.Chunk | None:
    """The one stored chunk that is exactly the bytes to read, untransformed; None if the read assembles or
    decodes (then it goes through ``read_whole``)."""
    for c in t.chunks:
        if c.transforms:
            return None
        if (box is None and len(t.chunks) == 1 and c.shape == t.shape) or (
            box is not None and c.offset == box[0] and c.shape == box[1]
        ):
            return c
    return None


def _rounds(parts: list[_Part], size: int) -> list[list[_Part]]:
    """Parts packed in order into rounds of at most ``size`` bytes (a larger part alone in its round)."""
    out: list[list[_Part]] = []
    used = size
    for p in parts:
        n = _aligned(p.hi - p.lo)
        if used + n > size or not out:
            out.append([])
            used = 0
        out[-1].append(p)
        used += n
    return out


def _place(parts: list[_Part], buffer: np.ndarray) -> list[np.ndarray]:
    views, offset = [], 0
    for p in parts:
        views.append(buffer[offset : offset + p.hi - p.lo])
        offset += _aligned(p.hi - p.lo)
    return views


def _read_round(
    ck: Opened, parts: list[_Part], views: list[np.ndarray], read_whole: ReadWhole, *, verify: bool, threads: int
) -> None:
    """Fill the round's views from the checkpoint, every span checked before its bytes are copied in."""
    spans: list[tuple[str, Span]] = []
    whole: list[tuple[str, memoryview, Box | None]] = []
    for p, view in zip(parts, views):
        if p.spans is None:
            whole.append((p.staged.name, view.data, p.staged.box))
            continue
        flat = view.data
        first = p.spans[0].begin
        for span in p.spans:
            dst = flat[span.begin - first : span.end - first]
            spans.append((p.file, span._replace(dst=dst)))
    if spans:
        spans.sort(key=lambda fs: (fs[0], fs[1].begin))
        limit, lanes = batching(ck.storage, sum(s.end - s.begin for _, s in spans), verify, threads)
        run_lanes(ck.files, batch_spans(spans, limit), verify, lanes)
    if whole:
        read_whole(whole)


def _copy(parts: list[_Part], views: list[np.ndarray], buffer: np.ndarray) -> Callable[[], None]:
    """Queue the round's host-to-device copies; returns the wait for them (which keeps ``buffer`` alive)."""
    waits = []
    by_adapter: dict[int, list[tuple[_Part, np.ndarray]]] = {}  # by identity: parts hold arrays, whose == is
    for p, v in zip(parts, views):  # elementwise (two targets of one tied tensor made `p in mine` raise)
        by_adapter.setdefault(id(p.staged.adapter), []).append((p, v))
    for pairs_of in by_adapter.values():
        mine = [p for p, _ in pairs_of]
        pairs = [(p.staged.local, p.lo if p.staged.cuttable else None, v) for p, v in pairs_of]
        try:
            waits.append((mine, mine[0].staged.adapter.copy_in_async(pairs)))
        except RefusedPair as e:  # named as the host path names it (read.fill); the queued copies are waited for
            _wait_all(waits)
            raise UnsupportedValueError(f"{mine[e.index].staged.name}: {e}") from None

    def wait() -> None:
        _wait_all(waits)
        held.clear()  # the copies are done with the buffer

    held = [buffer]  # a buffer of its own (a part that could not be cut) lives until its copies have landed
    return wait


def _wait_all(waits: list[tuple[list[_Part], Callable[[], list[Any]]]]) -> None:
    """Wait for each adapter's queued copies, telling each staged target what it now is."""
    for mine, w in waits:
        for p, now in zip(mine, w()):
            if p.staged.landed is not None:
                p.staged.landed(now)
