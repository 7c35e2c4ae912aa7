"""The one-shot API: load() and open() on top of the reader and the in-place restorer."""

from __future__ import annotations

import os
from typing import Any

from .restore import ABSENT, load_from
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
        include: glob patterns over dotted keys (``"model.*"``) to restore only those (with or without a
            target: without one, only the selected parts come back).
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
    return load_from(
        path,
        ABSENT if target is _NO_TARGET else target,
        storage=storage,
        strict=strict,
        include=include,
        exclude=exclude,
        framework=framework if target is _NO_TARGET else None,
        verify=verify,
        threads=threads,
    )
