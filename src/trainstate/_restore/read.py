"""manifest -> plan -> **read**: planned tensors' bytes, checked, into the memory they belong in.

The unit of work is a *span*: a run of stored bytes with the checksum that covers it and the memory it
lands in. A chunk with per-piece checksums (format 1.1, every chunk over one piece that trainstate writes)
gives one span per piece; any other chunk (small ones, and every chunk of a 1.0 manifest) is one span.
Each span is hashed and then copied, so **no byte that fails its checksum is ever written**, and a piece
(1 MiB) is copied while it is still in the CPU cache from hashing it: the stored bytes cross the memory
bus once. Spans are grouped into *batches* (one piece, one whole chunk, or a run of small chunks up to
:data:`~trainstate._restore.files.BATCH_BYTES`) and the batches, in file order, are cut into ``threads`` lanes of equal bytes, so one
large tensor is split across lanes too. Each lane reads front to back, so a cold read keeps the kernel's
readahead (lanes that took turns over segments of one file measured 1.5x slower cold). A tensor that the
target ties (one memory named twice in the state, like a language model's input and output embeddings)
is read once.

Accelerator targets go through a ring of reused host buffers, their copies overlapping the next reads
(``ring.py``). Where the storage maps files (local disks), bytes are hashed and copied straight from the page cache
through the map made at open. Each batch first checks the file's current size, so a file truncated
while the checkpoint is open is a CorruptCheckpointError, not a SIGBUS. Elsewhere (object stores) each
batch is one ranged read into a buffer.

What lands when a checksum fails: every lane stops before its next batch. Tensors read before hold the
checkpoint's values, tensors not reached keep their own, and small tensors are all-or-nothing. A tensor
stored in pieces that was being read may hold some of the checkpoint's (verified) pieces and its own
bytes elsewhere; with one thread, exactly the pieces before the damaged one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from trainstate import _checksum as checksum
from trainstate import _gc
from trainstate._cores import DEFAULT_THREADS
from trainstate._format import dtypes, manifest
from trainstate._frameworks import NUMPY, Adapter, adapter_for, adapter_named
from trainstate._restore.files import (
    Batch,
    Box,
    DataFiles,
    Opened,
    Span,
    batch_spans,
    batching,
    check_span,
    chunk_spans,
    meets,
    run_jobs,
    run_lanes,
)
from trainstate._restore.ring import Staged, read_to_device
from trainstate._restore.shared import Read, Share
from trainstate._restore.transformed import batches as transformed_batches
from trainstate._restore.transformed import transformed, verify_chunk
from trainstate.errors import CorruptCheckpointError, UnsupportedValueError


def read_views(ck: Opened, reads: Sequence[tuple[str, memoryview, Box | None]], *, verify: bool, threads: int) -> None:
    """Fill flat byte views from the checkpoint: each the whole tensor (box None) or the box of it given."""
    files = ck.files
    tensors = ck.manifest.tensors
    spans: list[tuple[str, Span]] = []
    boxes: list[Batch] = []
    seen: set[tuple[str, int]] = set()
    for name, dst, box in reads:
        if dst.nbytes:  # a tied tensor met twice in the tree, landing in the same memory, is read once
            key = (name, np.frombuffer(dst, np.uint8).ctypes.data)
            if key in seen:
                continue
            seen.add(key)
        t = tensors[name]
        chunks = t.chunks
        if box is not None and box[1] == t.shape:
            box = None  # a shard that is the whole tensor
        if chunks[0].transforms if len(chunks) == 1 else transformed(t):
            boxes.extend(transformed_batches(ck, name, t, dst, box, verify))  # compressed, encrypted: transformed.py
            continue
        same = (
            [c for c in chunks if c.offset == box[0] and c.shape == box[1]]
            if box is not None
            else [c for c in chunks if c.shape == t.shape][: len(chunks) == 1]
        )
        if same:  # stored as exactly this part: read straight in, split over the lanes
            c = same[0]
            begin, end = c.byte_range  # the tensor's size (the manifest parser checked)
            if dst.nbytes != end - begin:
                raise ValueError(f"{name} needs {end - begin} bytes to read into, got {dst.nbytes}")
            if begin != end:
                what = f"tensor {name} ({c.file})"
                spans.extend((c.file, s) for s in chunk_spans(c, dst, what))
            continue
        region = box or ((0,) * len(t.shape), t.shape)
        itemsize = dtypes.from_code(t.dtype).itemsize
        if dst.nbytes != math.prod(region[1]) * itemsize:
            raise ValueError(f"{name} needs {math.prod(region[1]) * itemsize} bytes to read into, got {dst.nbytes}")
        needed = [c for c in chunks if meets(c, region)]
        if needed:
            first = min(needed, key=lambda c: (c.file, c.byte_range[0]))
            fill = _box_filler(files, name, t, dst, verify, region, needed)
            size = sum(c.byte_range[1] - c.byte_range[0] for c in needed)
            boxes.append(Batch(first.file, first.byte_range[0], first.byte_range[0] + size, [], fill))
    spans.sort(key=lambda fs: (fs[0], fs[1].begin))
    limit, threads = batching(ck.storage, sum(s.end - s.begin for _, s in spans), verify, threads)
    batches = batch_spans(spans, limit)
    if boxes:
        batches = sorted(batches + boxes, key=lambda b: (b.file, b.begin))
    run_lanes(files, batches, verify, threads)


def _box_filler(
    files: DataFiles,
    name: str,
    t: manifest.TensorEntry,
    dst: memoryview,
    verify: bool,
    region: Box,
    chunks: list[manifest.Chunk],
) -> Callable[[], None]:
    """``region`` of a tensor stored as several boxes (written by several ranks), assembled from the
    chunks that meet it; each is checked before any of its bytes reach ``dst``, and only the stored rows
    that meet the region are read (with the pieces that cover them, where the chunk has pieces)."""

    def fill() -> None:
        dtype = dtypes.from_code(t.dtype).numpy
        whole = np.frombuffer(dst, dtype=dtype).reshape(region[1])
        for c in chunks:
            what = f"tensor {name} chunk at {list(c.offset)} ({c.file})"
            lo = [max(co, ro) for co, ro in zip(c.offset, region[0])]
            hi = [min(co + cs, ro + rs) for co, cs, ro, rs in zip(c.offset, c.shape, *region)]
            rows = (lo[0] - c.offset[0], hi[0] - c.offset[0]) if c.shape else (0, 1)
            with files.rows(c, rows, verify, what) as src:
                stored = np.frombuffer(src, dtype=dtype).reshape((rows[1] - rows[0], *c.shape[1:]))
                part = tuple(slice(a - o, b - o) for a, b, o in zip(lo[1:], hi[1:], c.offset[1:]))
                into = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, region[0]))
                whole[into] = stored[(slice(None), *part)]

    return fill


def read_into(ck: Opened, name: str, out: Any, *, verify: bool = True) -> None:
    """Read tensor ``name`` into the contiguous host array ``out`` of the right size."""
    t = ck.manifest.tensors[name]
    view = flat_view(out)
    if view is None or view.nbytes != t.nbytes:
        raise ValueError(f"read_into needs a contiguous host array of {t.nbytes} bytes for {name}")
    read_views(ck, [(name, view, None)], verify=verify, threads=1)


def read_tensor(ck: Opened, name: str, *, framework: str, verify: bool) -> Any:
    """One tensor: a read-only NumPy view of the map (``"numpy"``) or an array of its own."""
    t = ck.manifest.tensors[name]
    c = t.chunks[0] if len(t.chunks) == 1 and t.nbytes and not t.chunks[0].transforms else None
    mm = ck.files.map(c.file) if c is not None else None
    if c is not None and mm is not None:
        view = ck.files.mapped(mm, c.file, *c.byte_range)  # the array keeps it (and the map) alive
        if verify:
            for span in chunk_spans(c, None, f"tensor {name} ({c.file})"):
                check_span(view[span.begin - c.byte_range[0] : span.end - c.byte_range[0]], span)
        array = np.frombuffer(view, dtype=dtypes.from_code(t.dtype).numpy, count=math.prod(t.shape)).reshape(t.shape)
        if framework != "numpy":  # an array of its own: the map closes with the checkpoint
            try:
                return adapter_named(framework).from_numpy(array.copy())
            except UnsupportedValueError as e:
                raise UnsupportedValueError(f"{name}: {e}") from None
        return NUMPY.finish(array, t.kind)
    adapter = adapter_named(framework)
    out = adapter.empty(t.dtype, t.shape)
    read_into(ck, name, out, verify=verify)
    return adapter.finish(out, t.kind)


def verify_all(ck: Opened, threads: int = DEFAULT_THREADS) -> None:
    """Check every tensor against every checksum the manifest has for it: whole chunks and pieces, the
    chunks in file order cut into ``threads`` lanes of equal bytes (hashing releases the GIL)."""
    chunks = sorted(
        ((name, t, c) for name, t in ck.manifest.tensors.items() for c in t.chunks),
        key=lambda x: (x[2].file, x[2].byte_range[0]),
    )

    def check(name: str, t: manifest.TensorEntry, c: manifest.Chunk) -> None:
        if c.transforms:  # checked, then decoded (transformed.py)
            verify_chunk(ck, name, t, c)
            return
        what = f"tensor {name} ({c.file})"
        begin, end = c.byte_range
        if c.pieces is None or begin == end:  # one checksum over the whole chunk
            with ck.files.stored(c, False, what) as view:
                checksum.check(view, c.checksum, what)
            return
        whole = checksum.Hasher()  # the whole chunk's checksum too, as a 1.0 reader checks it: in the same pass,
        with ck.files.stored(c, False, what) as view:  # each piece hashed again while it is in cache
            for span in chunk_spans(c, None, what):
                piece = view[span.begin - begin : span.end - begin]
                whole.update(piece)
                check_span(piece, span)
        found = whole.value()
        if found != checksum.expected_value(c.checksum, what):
            raise checksum.mismatch(what, c.checksum, found)

    sizes = [c.byte_range[1] - c.byte_range[0] for _, _, c in chunks]
    run_jobs([partial(check, *x) for x in chunks], sizes, threads)


def flat_view(out: Any) -> memoryview | None:
    """``out``'s memory as flat bytes, or None unless it is a contiguous, writable host array."""
    adapter = adapter_for(out) or NUMPY
    view = adapter.writable_view(out)
    return None if view is None else view.cast("B") if view.format != "B" else view


# -- filling the planned jobs -----------------------------------------------------------------------


@dataclass(slots=True)
class Job:
    """One planned tensor read: the live array to fill (or the planner's absent marker)."""

    target: Any
    host: Any = None  # a host buffer, when the target cannot be read into directly
    value: Any = None  # the restored value
    local: Any = None  # what the host buffer is copied into: the target, or its local shard
    whole_part: bool = False  # the stored tensor is the target's local part, whole (a local view)


_codes: dict[tuple[type, Any], str] = {}  # (array type, its dtype) -> dtype code: describe() once per kind
_adapters: dict[type, Adapter | None] = {}  # which adapter an array type has (the type decides it)


def _adapter_of(value: Any) -> Adapter | None:
    cls = type(value)
    if cls not in _adapters:
        _adapters[cls] = adapter_for(value)
    return _adapters[cls]


def _code(adapter: Adapter, value: Any) -> str:
    key = (type(value), value.dtype)
    code = _codes.get(key)
    if code is None:
        code = _codes[key] = adapter.describe(value)[0]
    return code


def fill(
    ck: Opened,
    jobs: list[tuple[str, Job]],
    *,
    framework: str | None,
    absent: object,
    verify: bool,
    threads: int,
    share: Share | None = None,
) -> None:
    """Read every planned tensor: straight into the target's memory where its layout allows, else
    through a host buffer (absent targets, accelerator tensors, non-contiguous ones, casts).

    With ``share`` (a collective load) the reads that several ranks hold are read by one of them and sent to
    the others (shared.py); every rank takes part, and any rank's failure raises on all of them.
    """
    tensors = ck.manifest.tensors
    reads: list[Read] = []
    on_device: list[Staged] = []
    with _gc.paused():
        for name, job in jobs:
            entry = tensors[name]
            target = job.target
            live = _adapter_of(target) if target is not absent else None
            part = live.local_part(target) if live is not None else None
            local, box = (target, None) if part is None else (part[0], (part[1], tuple(part[0].shape)))
            if job.whole_part:
                box = None
            view = None
            if live is not None and _code(live, target) == entry.dtype:
                if live.on_accelerator(local):
                    shape = entry.shape if box is None else box[1]  # as stored: a typed key's is its key data's
                    nbytes = math.prod(shape) * dtypes.from_code(entry.dtype).itemsize
                    landed = partial(_landed, job, local)
                    on_device.append(Staged(name, live, local, box, nbytes, live.cuttable(local), landed))
                    job.value = target
                    continue
                view = live.writable_view(local)
            if view is not None:
                job.value = target
            else:
                shape = entry.shape if box is None else box[1]
                job.host = (live or adapter_named(framework or entry.kind)).empty(entry.dtype, shape)
                view = _adapter(job.host).writable_view(job.host)
                assert view is not None
                job.local = local
            reads.append((name, view if view.format == "B" else view.cast("B"), box))

        def read(own: list[Read], own_staged: list[Staged]) -> None:
            read_views(ck, own, verify=verify, threads=threads)
            whole = partial(read_views, ck, verify=verify, threads=threads)
            read_to_device(ck, own_staged, whole, verify=verify, threads=threads)  # ring.py

        try:
            if share is None:
                read(reads, on_device)
            else:
                share.run(tensors, reads, on_device, read, verified=verify)
        except CorruptCheckpointError as e:
            raise type(e)(  # the same kind (a TamperedCheckpointError stays one), with what that left behind
                f"{e}\nThe target is partly restored, and no byte that failed its checksum was written: tensors "
                "read before the damaged one hold the checkpoint's values and the rest keep their own, except that "
                "a tensor stored in pieces that was being read may hold some of the checkpoint's verified pieces. "
                "Load another checkpoint."
            ) from None
        for name, job in jobs:
            if job.host is not None:
                try:
                    _finish(job, tensors[name].kind, framework, absent)
                except UnsupportedValueError as e:  # an array the framework cannot hold (JAX without x64)
                    raise UnsupportedValueError(f"{name}: {e}") from None


def _finish(job: Job, kind: str, framework: str | None, absent: object) -> None:
    """A read job's host array made what the state holds: the reader's framework (else what the saver held)
    without a target, else copied into the target (or its local shard) or made anew from it."""
    if job.target is absent:
        job.value = adapter_named(framework or kind).finish(job.host, kind)
        return
    host = _adapter(job.host).finish(job.host, kind)
    if job.local is not job.target:  # a part: copied into the local shard (the target stays), or an immutable
        placed = _adapter(job.target).assign(job.local, host)  # array's region, made into the new global array
        job.value = job.target if placed is job.local else placed
    else:
        job.value = _adapter(job.target).assign(job.target, host)


def _landed(job: Job, local: Any, now: Any) -> None:
    """What the target is once its copy landed: itself when the bytes went into it (or into its local shard),
    else the new array made from them (JAX: an array, or the global array made from this process's region),
    as :func:`_finish` decides for the host path."""
    if now is not local:
        job.value = now


def _adapter(value: Any) -> Adapter:
    adapter = adapter_for(value)
    assert adapter is not None
    return adapter
