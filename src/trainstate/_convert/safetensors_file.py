"""safetensors files written and read a tensor at a time, without the safetensors package.

The format (https://github.com/huggingface/safetensors, "Format"): an 8-byte little-endian header length
N, N bytes of JSON (each tensor's ``dtype``, ``shape`` and ``data_offsets`` relative to the end of the
header, and an optional ``__metadata__`` of strings), then the tensors' bytes back to back. The header
names every tensor before any byte of them, so a writer that knows dtypes and shapes up front (a manifest
does) can write the header, then each tensor as it is produced, and drop it: memory peaks near one
tensor. ``safetensors.torch.save_file`` needs the whole state in memory first. Reading maps the file, as
``safetensors.safe_open`` does: a tensor's bytes go from the page cache to the writer without a copy. The header is built by the
same code as trainstate's own data files (``_format/datafile.py``), which ``safe_open`` already reads.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import BinaryIO, NamedTuple

import numpy as np

from trainstate._convert.source import SourceTensor
from trainstate._format import datafile, dtypes
from trainstate._storage.local import LocalStorage
from trainstate.errors import CorruptCheckpointError, StorageError, UnsupportedValueError


class Out(NamedTuple):
    """A tensor to write: its name, safetensors dtype code, shape, byte size, and how to make its bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    produce: Callable[[], np.ndarray]


def write(path: Path, tensors: list[Out], metadata: dict[str, str]) -> int:
    """Write a new safetensors file at ``path`` (which must not exist), fsynced; returns its size."""
    header, _ = datafile.build_header(
        [datafile.HeaderEntry(t.name, t.dtype, t.shape, t.nbytes) for t in tensors], metadata
    )

    def views() -> Iterator[memoryview]:
        yield memoryview(header)
        for t in tensors:
            data = flat_bytes(t.produce())
            if data.nbytes != t.nbytes:  # a header that lied about the bytes would be a corrupt file
                raise CorruptCheckpointError(f"{t.name}: produced {data.nbytes} bytes, the header says {t.nbytes}")
            yield data
            del data  # before the next tensor is made: one tensor in memory at a time
            yield memoryview(b"")  # the storage lets go of the last view it was handed

    return LocalStorage().write(str(path), views(), fsync=True)


def flat_bytes(array: np.ndarray) -> memoryview:
    """An array's bytes, C order, as a flat byte view (copies only a non-contiguous array)."""
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8).data


def read(path: Path) -> tuple[dict[str, SourceTensor], dict[str, str]]:
    """A safetensors file's tensors, in file order, each read only when asked; and its ``__metadata__``.

    Raises:
        CorruptCheckpointError: the file is not a well-formed safetensors file.
        UnsupportedValueError: a tensor of a dtype trainstate does not store (FP4, F6, a quantized block type).
    """
    what = f"{path} (a safetensors file)"
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            n = datafile.header_length(prefix) if len(prefix) == 8 else 0
            if not 8 < n <= min(size, datafile.MAX_HEADER + 8):
                raise CorruptCheckpointError(f"{what}: no safetensors header (a header length of {n - 8} bytes)")
            blob = prefix + f.read(n - 8)
        handle = open(path, "rb")  # noqa: SIM115 - kept open by the tensors' readers: the file's inode, not its name
    except OSError as e:
        raise StorageError(e.errno, f"cannot read {path}: {e.strerror}") from e
    header = datafile.parse_header(blob, size, what)
    data_size = size - n
    meta = header.pop(datafile.METADATA_KEY, None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CorruptCheckpointError(f"{what}: __metadata__ is not a mapping of strings")
    found = []
    for name, entry in header.items():
        code, shape, (begin, end) = _entry(entry, name, what)
        nbytes = dtypes.from_code(code).itemsize * math.prod(shape)
        if not 0 <= begin <= end <= data_size or end - begin != nbytes:
            raise CorruptCheckpointError(
                f"{what}: tensor {name!r:.80} ({code}{list(shape)}, {nbytes} bytes) has data_offsets "
                f"[{begin}, {end}] in a data section of {data_size} bytes"
            )
        found.append((begin, name, SourceTensor(code, shape, nbytes, partial(_view, handle, path, n + begin, nbytes))))
    found.sort(key=lambda x: x[0])
    _refuse_overlaps([(begin, t.nbytes, name) for begin, name, t in found], what)
    return {name: t for _, name, t in found}, meta


def _refuse_overlaps(ranges: list[tuple[int, int, str]], what: str) -> None:
    """Refuse two tensors over one byte (``ranges``: begin, size, name; sorted by begin). Each name is imported
    in full, so a header mapping many names onto one range would make a small file a checkpoint many times its
    size; safetensors itself refuses such a file (its tensors' ranges follow one another)."""
    end, last = 0, ""
    for begin, nbytes, name in ranges:
        if nbytes and begin < end:
            raise CorruptCheckpointError(
                f"{what}: the bytes of tensor {name!r:.80} (from {begin}) overlap those of {last!r:.80} (to {end}); "
                "a safetensors file stores each tensor's bytes once"
            )
        if nbytes:
            end, last = begin + nbytes, name


def _entry(entry: object, name: str, what: str) -> tuple[str, tuple[int, ...], tuple[int, int]]:
    if isinstance(entry, dict):
        code, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if isinstance(code, str) and code not in dtypes.BY_CODE:  # a well-formed file of a newer dtype (FP4)
            raise UnsupportedValueError(
                f"{what}: tensor {name!r:.80} has unsupported dtype {code:.40}; trainstate stores "
                f"{', '.join(sorted(dtypes.BY_CODE))}"
            )
        if (
            isinstance(code, str)
            and code in dtypes.BY_CODE
            and isinstance(shape, list)
            and all(type(d) is int and d >= 0 for d in shape)
            and isinstance(offsets, list)
            and len(offsets) == 2
            and all(type(o) is int for o in offsets)
        ):
            return code, tuple(shape), (offsets[0], offsets[1])
    raise CorruptCheckpointError(f"{what}: malformed header entry for {name!r:.80}: {entry!r:.120}")


def _view(handle: BinaryIO, path: Path, offset: int, nbytes: int) -> np.ndarray:
    """A tensor's bytes, read (a copy) from the file opened when its header was read. Not a map: a file
    truncated while it is imported would kill the process (SIGBUS) at a page past its new end, where a read
    comes back short and is an error."""
    return read_range(handle, path, offset, nbytes)


def read_range(handle: BinaryIO, path: Path, offset: int, nbytes: int) -> np.ndarray:
    """``nbytes`` bytes of an open file from ``offset``, as a new array; CorruptCheckpointError if the file
    no longer holds them (truncated while it was read)."""
    out = np.empty(nbytes, np.uint8)
    got = 0
    try:
        while got < nbytes:
            n = os.preadv(handle.fileno(), [out.data[got:]], offset + got)
            if n <= 0:
                break
            got += n
    except OSError as e:
        raise StorageError(e.errno, f"cannot read {path}: {e.strerror}") from e
    if got != nbytes:
        raise CorruptCheckpointError(
            f"{path} was truncated while it was read: it no longer holds byte {offset + nbytes}"
        )
    return out
