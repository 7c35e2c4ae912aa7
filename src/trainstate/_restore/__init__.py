"""Restore: manifest -> plan -> read -> tree -> live state. ``load`` and ``load_from`` are the way in."""

from __future__ import annotations

from typing import Any

from trainstate import _arguments as arguments
from trainstate import _frameworks as frameworks
from trainstate import _gc, _keys
from trainstate._cores import DEFAULT_THREADS
from trainstate._distributed import Coordinator, coordinator
from trainstate._distributed.group import torch_world
from trainstate._restore.apply import restore
from trainstate._restore.checkpoint import Checkpoint
from trainstate._restore.plan import _ABSENT, ABSENT, Restorer, selector
from trainstate._restore.shared import Share
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
    coord: Coordinator | None = None,
    local_view: tuple[int, int] | None = None,
) -> Any:
    """The one way a checkpoint is loaded: ``trainstate.load`` and ``CheckpointManager`` both come here.

    Opens the checkpoint (manifest validated; authenticated with ``key`` when it is encrypted), checks
    every data-file header when ``verify``, then plans and reads. Any damage surfaces as a CheckpointError
    subclass. With ``coord`` the load is collective: every rank of its group calls this, the parts several
    ranks hold are read once between them (shared.py), and a failure on any rank raises on every rank.
    ``local_view``: (rank, world size) restoring a process's own view, as a local tier saved it (apply.py).
    """
    share = Share(coord) if coord is not None and coord.sends_bytes else None
    try:
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
                share=share,
                local_view=local_view,
            )
    except BaseException as e:
        if share is not None:
            share.abandon(e)  # the other ranks wait for this one's reads: they learn it failed, and raise too
        raise


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
    collective: bool | None = None,
    timeout: float | None = None,
) -> Any:
    """Load a checkpoint: into ``target`` in place, or as a fresh nested structure.

    Under an initialized process group (torch distributed) of several ranks the load is collective by default,
    as ``save`` is: **every rank calls it**, each restoring what it holds, and a tensor that several ranks hold
    (data-parallel replicas, replicated dims of a DTensor) is read from storage by one of them and sent to the
    others over trainstate's coordination (gloo) group, so the job reads each byte once (docs/distributed.md,
    "Restoring: each byte read once"). A failure on any rank (a damaged tensor, a state that does not fit)
    raises on every rank, and no byte is sent then. Tensors in GPU memory are shared too (they cross through
    host buffers in pieces); JAX arrays, non-contiguous tensors and the processes of a ``jax.distributed``
    job are not: each reads its own.

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
        collective: under a process group of several ranks (torch distributed), ``None`` (the default) and
            ``True`` load together with every rank, reading shared tensors once; ``False`` loads this
            process's state alone, reading everything it holds (as outside a process group; for a rank that
            loads while the others do not).
        timeout: seconds a collective load waits for the other ranks before it raises DistributedError
            (default 600, or TRAINSTATE_DIST_TIMEOUT); a rank that never comes is named within at most 60 s.

    Returns:
        The restored target, or the nested state when no target was given.

    Example:
        >>> trainstate.load("ckpt/step_1200", state)              # in place
        >>> tree = trainstate.load("ckpt/step_1200")              # NumPy arrays and plain values
        >>> trainstate.load(packed_bytes, state)                    # from memory (trainstate.pack)
        >>> trainstate.load("ckpt/step_1200", state, collective=False)   # one rank alone, under torchrun
    """
    framework = frameworks.framework(framework)
    threads = arguments.positive_int(threads, "threads")
    resolved = _keys.resolve(key, key_env)
    if collective is not None:
        collective = arguments.flag(collective, "collective")
    group = torch_world() if collective is not False else None
    coord = coordinator(group, timeout, channel="load") if group is not None else None
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
        coord=coord,
    )
