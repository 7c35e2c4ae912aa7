"""Reading chunks with transforms (compressed, encrypted): stored bytes -> checked -> decoded -> copied.

``read.py`` hands a tensor here when any of its chunks has transforms; plain tensors never come here, so
their read path is unchanged. Each chunk that meets the region asked for becomes one batch of its own, so
the lanes decode the chunks of one large tensor in parallel (zstandard releases the GIL). A batch reads the
chunk's stored bytes and checks them against its checksum (piece by piece where it has pieces, as every
chunk: :meth:`DataFiles.stored`), undoes its transforms into a buffer of the box's raw size (checking the raw
checksum the manifest records, if any), and only then copies the box into the destination. No byte that
failed a check lands; a tensor being read when a check fails may hold the chunks that passed before it,
as a plain tensor may hold the pieces that did.
"""

from __future__ import annotations

import math
from functools import partial

import numpy as np

from trainstate import _checksum as checksum
from trainstate._format import dtypes, manifest, manifest_mac
from trainstate._restore.files import Batch, Box, Opened, meets
from trainstate._transforms import Place
from trainstate.errors import CorruptCheckpointError


def transformed(t: manifest.TensorEntry) -> bool:
    """Whether reading this tensor goes through here."""
    return any(c.transforms for c in t.chunks)


def batches(
    ck: Opened, name: str, t: manifest.TensorEntry, dst: memoryview, box: Box | None, verify: bool
) -> list[Batch]:
    """One batch per chunk of ``name`` meeting ``box`` (None: the whole tensor), each filling its part of
    ``dst`` (the flat bytes of the box); ``verify``: check the chunks' checksums."""
    region = box or ((0,) * len(t.shape), t.shape)
    itemsize = dtypes.from_code(t.dtype).itemsize
    if dst.nbytes != math.prod(region[1]) * itemsize:
        raise ValueError(f"{name} needs {math.prod(region[1]) * itemsize} bytes to read into, got {dst.nbytes}")
    out = []
    for c in t.chunks:
        if meets(c, region):
            begin = c.byte_range[0]
            raw = math.prod(c.shape) * itemsize  # the work is decoding: lanes are balanced by raw bytes
            out.append(Batch(c.file, begin, begin + raw, [], partial(_fill, ck, name, t, c, dst, region, verify)))
    return out


def _decoded(
    ck: Opened, name: str, t: manifest.TensorEntry, c: manifest.Chunk, stored: memoryview, verify: bool, what: str
) -> bytes | bytearray | memoryview:
    """A chunk's raw bytes from its stored bytes (checked already): its transforms undone."""
    if not c.transforms:
        return stored
    if not ck.manifest.encrypted and any(p.get("name") == manifest_mac.ALGORITHM for p in c.transforms):
        # Only an authenticated manifest can say a chunk is encrypted: asking for a key here would make a
        # forged plain manifest stop a manager as a user error instead of being skipped as damage.
        raise CorruptCheckpointError(
            f"{what} is said to be encrypted ({manifest_mac.ALGORITHM}), but the checkpoint is not encrypted (its "
            "manifest has no 'encryption' object and no MAC): the manifest was altered or damaged. Restore "
            "another checkpoint"
        )
    raw_nbytes = math.prod(c.shape) * dtypes.from_code(t.dtype).itemsize
    return ck.decoders.decode(
        c.transforms, stored, Place(name, t.dtype, c.offset, c.shape), raw_nbytes, verify=verify, what=what
    )


def _fill(
    ck: Opened,
    name: str,
    t: manifest.TensorEntry,
    c: manifest.Chunk,
    dst: memoryview,
    region: Box,
    verify: bool,
) -> None:
    what = f"tensor {name} chunk at {list(c.offset)} ({c.file})"
    dtype = dtypes.from_code(t.dtype).numpy
    whole = np.frombuffer(dst, dtype=dtype).reshape(region[1])
    lo = [max(co, ro) for co, ro in zip(c.offset, region[0])]
    hi = [min(co + cs, ro + rs) for co, cs, ro, rs in zip(c.offset, c.shape, *region)]
    with ck.files.stored(c, verify, what) as stored:  # checked, piece by piece where it has pieces
        src = np.frombuffer(_decoded(ck, name, t, c, stored, verify, what), dtype=dtype).reshape(c.shape)
        whole[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, region[0]))] = src[
            tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, c.offset))
        ]
        del src  # a view of the stored bytes where the chunk was not transformed: released with them


def verify_chunk(ck: Opened, name: str, t: manifest.TensorEntry, c: manifest.Chunk) -> None:
    """``verify``: a transformed chunk's stored checksums (whole and pieces), then that it decodes (and to
    the raw checksum recorded, if any)."""
    what = f"tensor {name} ({c.file})"
    with ck.files.stored(c, True, what) as view:  # pieces, where it has them
        if c.pieces is not None:
            checksum.check(view, c.checksum, what)  # the whole chunk, as a reader without pieces checks it
        _decoded(ck, name, t, c, view, True, what)
