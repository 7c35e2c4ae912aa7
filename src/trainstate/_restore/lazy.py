"""Entries whose bytes are made when the writer reaches them: the save pipeline, a tensor at a time.

A save normally hands the writer live arrays. A writer that rewrites or converts a checkpoint
(``consolidate``, ``import_checkpoint``, ``average``) has no live arrays: each tensor must be read,
converted or computed first, and holding them all would cost the whole state in memory. A :class:`Lazy`
value stands in for the array: the NumPy adapter turns a value into bytes with ``np.asarray``, which
calls ``__array__``, so the tensor is produced exactly when its bytes are written and dropped once they
are (``write.py`` lets go of each large tensor before the next one's bytes are made). Memory then peaks
near the largest tensor, not the state. A storage that retries an upload iterates the bytes again, which
produces the tensor again.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from trainstate._frameworks import NUMPY
from trainstate._restore.checkpoint import Checkpoint
from trainstate._restore.read import read_views
from trainstate._save.encode import Entry


class Lazy:
    """A tensor's bytes, made by ``produce()`` when the writer asks for them (see the module docstring)."""

    __slots__ = ("produce",)

    def __init__(self, produce: Callable[[], np.ndarray]) -> None:
        self.produce = produce

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return self.produce()


def lazy_entry(
    name: str, produce: Callable[[], np.ndarray], dtype: str, shape: tuple[int, ...], kind: str, nbytes: int
) -> Entry:
    """An entry stored as ``name`` whose bytes ``produce()`` returns (an array holding exactly ``nbytes``
    bytes of dtype ``dtype`` in C order; any NumPy dtype, the bytes are what counts)."""
    return Entry(name, Lazy(produce), NUMPY, dtype, tuple(shape), kind, nbytes)


def stored_bytes(ck: Checkpoint, name: str) -> np.ndarray:
    """Tensor ``name`` of ``ck`` as flat bytes: each chunk checked against its checksum, then assembled."""
    out = np.empty(ck.manifest.tensors[name].nbytes, dtype=np.uint8)
    read_views(ck, [(name, out.data, None)], verify=True, threads=1)
    return out


def stored_entry(ck: Checkpoint, new: str, old: str) -> Entry:
    """Tensor ``old`` of ``ck``, stored as ``new`` with the same dtype, shape and kind; read when written."""
    t = ck.manifest.tensors[old]
    return lazy_entry(new, partial(stored_bytes, ck, old), t.dtype, t.shape, t.kind, t.nbytes)
