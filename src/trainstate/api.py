"""The one-shot API: load() and open() on top of the reader and the in-place restorer."""

from __future__ import annotations

import os
from typing import Any

from .reader import Checkpoint
from .restore import restore
from .storage import Storage

_NO_TARGET = object()


def load(
    path: str | os.PathLike[str],
    target: Any = _NO_TARGET,
    *,
    strict: bool = True,
    include: str | list[str] | None = None,
    exclude: str | list[str] | None = None,
    framework: str = "numpy",
    verify: bool = True,
    threads: int = 2,
    storage: Storage | None = None,
) -> Any:
    """Load a checkpoint: into ``target`` in place, or as a fresh nested structure.

    Args:
        path: the checkpoint directory.
        target: live state to fill (the same shape of dict you saved). Tensors are overwritten in place
            and keep their device; stateful objects get ``load_state_dict``; plain values are replaced
            in their containers. Omit it to get plain values and arrays back.
        strict: report missing and unexpected keys (always: shape mismatches; with strict: dtype
            mismatches) in one :class:`StateMismatchError` before anything is changed.
        include: glob patterns over dotted keys (``"model.*"``) to restore only those.
        exclude: glob patterns of keys to leave alone.
        framework: with no target, the array type returned: ``"numpy"`` or ``"torch"``.
        verify: check every tensor's checksum.
        threads: reader threads.
        storage: where to read from (default: chosen from ``path``).

    Returns:
        The restored target, or the nested state when no target was given.

    Example:
        >>> trainstate.load("ckpt/step_1200", state)              # in place
        >>> tree = trainstate.load("ckpt/step_1200")              # NumPy arrays and plain values
    """
    with Checkpoint(path, storage) as ck:
        if verify:
            ck.verify_headers()  # so a damaged safetensors header is caught here, not by the next tool
        if target is _NO_TARGET:
            return ck.load(framework=framework, verify=verify, threads=threads)
        return restore(ck, target, strict=strict, include=include, exclude=exclude, verify=verify,
                       threads=threads)
