"""Restore: manifest -> plan -> read -> tree -> live state. ``load`` and ``load_from`` are the way in."""

from __future__ import annotations

from typing import Any

from trainstate import _arguments as arguments
from trainstate import _frameworks as frameworks
from trainstate import _gc, _keys
from trainstate._cores import DEFAULT_THREADS
from trainstate._restore.apply import restore
from trainstate._restore.checkpoint import Checkpoint
from trainstate._restore.plan import _ABSENT, ABSENT, Restorer, selector
from trainstate._storage import Source, Storage

__all__ = ["ABSENT", "Restorer", "load", "load_from", "restore", "selector"]


def load_from(
    path: Source,
    target: Any = _ABSENT,
    *,
    storage: Storage | None = None,
    strict: bool = True,
    include: str | list[str] | None = None,
    exclude: str | list[str] | None = None,
    framework: str | None = None,
    verify: bool = True,
    threads: int = DEFAULT_THREADS,
    optional: tuple[str, ...] = (),
    key: _keys.Key | None = None,
) -> Any:
    """The one way a checkpoint is loaded: ``trainstate.load`` and ``CheckpointManager`` both come here.

    Opens the checkpoint (manifest validated; authenticated with ``key`` when it is encrypted), checks
    every data-file header when ``verify``, then plans and reads. Any damage surfaces as a CheckpointError
    subclass.
    """
    with Checkpoint(path, storage, key=key) as ck, _gc.paused():  # many small tensors: no collections meanwhile
        return restore(
            ck,
            target,
            strict=strict,
            include=include,
            exclude=exclude,
            verify=verify,
            threads=threads,
            framework=framework,
            optional=optional,
        )


_NO_TARGET = object()


def load(
    path: Source,
    target: Any = _NO_TARGET,
    *,
    strict: bool = True,
    include: str | list[str] | None = None,
    exclude: str | list[str] | None = None,
    framework: str = "numpy",
    verify: bool = True,
    threads: int = DEFAULT_THREADS,
    storage: Storage | None = None,
    key: _keys.KeyLike | None = None,
    key_env: str | None = None,
) -> Any:
    """Load a checkpoint: into ``target`` in place, or as a fresh nested structure.

    Args:
        path: the checkpoint directory, or a packed checkpoint (``trainstate.pack``): bytes, a buffer, a
            binary file open for reading, or a packed file's path.
        target: live state to fill (the same shape of dict you saved). Tensors are overwritten in place
            and keep their device; stateful objects get ``load_state_dict``; plain values are replaced
            in their containers. Omit it to get plain values and arrays back.
        strict: report missing and unexpected keys (always: shape mismatches; with strict: dtype
            mismatches) in one :class:`StateMismatchError` before anything is changed.
        include: glob patterns over dotted keys (``"model.*"``) to restore only those (with or without a
            target: without one, only the selected parts come back).
        exclude: glob patterns of keys to leave alone.
        framework: with no target, the array type returned: ``"numpy"``, ``"torch"`` or ``"jax"``.
        verify: check every tensor's checksum.
        threads: reader threads.
            Default: this process's share of its cores (``TRAINSTATE_THREADS`` sets it; README, "Threads").
        storage: where to read from (default: chosen from ``path``).
        key: the key of an encrypted checkpoint (32 bytes, 64 hex digits or base64; docs/encryption.md).
        key_env: the name of an environment variable that holds the key, instead of ``key``.

    Returns:
        The restored target, or the nested state when no target was given.

    Example:
        >>> trainstate.load("ckpt/step_1200", state)              # in place
        >>> tree = trainstate.load("ckpt/step_1200")              # NumPy arrays and plain values
        >>> trainstate.load(packed_bytes, state)                    # from memory (trainstate.pack)
    """
    framework = frameworks.framework(framework)
    threads = arguments.positive_int(threads, "threads")
    resolved = _keys.resolve(key, key_env)
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
        key=resolved,
    )
