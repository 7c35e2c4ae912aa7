"""save(): one checkpoint of a state, written by this process alone (``trainstate._save``) or, under a process
group, by every rank together (``trainstate._distributed.save``). It sits above both, choosing between them."""

from __future__ import annotations

import os
import time
from typing import Any

from trainstate import _gc, _keys
from trainstate._distributed import coordinator, rank_and_world
from trainstate._save import (
    DEFAULT_THREADS,
    SaveOptions,
    SaveResult,
    encode_state,
    save_options,
    write_checkpoint,
)
from trainstate._storage import Storage, resolve


def save(
    path: str | os.PathLike[str],
    state: Any,
    *,
    metadata: Any = None,
    overwrite: bool = False,
    fsync: bool = True,
    threads: int = DEFAULT_THREADS,
    storage: Storage | None = None,
    collective: bool | None = None,
    timeout: float | None = None,
    compression: str | None = None,
    key: _keys.KeyLike | None = None,
    key_env: str | None = None,
) -> SaveResult:
    """Save ``state`` as a checkpoint directory at ``path``, atomically.

    Args:
        path: the checkpoint directory to create.
        state: nested dicts / lists / tuples of tensors, arrays, plain values and objects with
            ``state_dict()`` / ``load_state_dict()``.
        metadata: plain values (no arrays) stored in the manifest, readable without touching tensors.
        overwrite: replace an existing checkpoint at ``path`` (atomically).
        fsync: flush files and directories to stable storage before the commit.
        threads: writer threads; tensors are spread over this many data files.
            Default: this process's share of its cores (``TRAINSTATE_THREADS`` sets it; README, "Threads").
        storage: where to write (default: chosen from ``path``; the local filesystem for plain paths).
        collective: inside an initialized process group of several ranks (torch distributed), every rank
            calls ``save`` with its own state and the ranks write one checkpoint together
            (docs/distributed.md). That is the default there; ``collective=False`` saves this process's
            state alone, as outside a process group.
        timeout: seconds a collective save waits for the other ranks before it raises DistributedError
            (default 600, or the TRAINSTATE_DIST_TIMEOUT environment variable); a rank that died is named
            sooner: at most 60 s (TRAINSTATE_DIST_ARRIVAL_TIMEOUT) when it never came to the coordination.
        compression: ``"zstd"`` or ``"zstd:LEVEL"`` (LEVEL -7 to 22, default 3) compresses each tensor in
            chunks of 4 MiB, each stored raw where compressing it does not pay (needs
            ``pip install "trainstate[zstd]"``; docs/format.md §5b). Loading needs no argument.
        key: encrypt the checkpoint with this key (AES-256-GCM; 32 bytes, 64 hex digits or base64; make one
            with ``trainstate.generate_key()``). Tensor bytes are encrypted; names, shapes and plain values
            stay readable in the manifest, which is authenticated (docs/encryption.md). The key is never stored.
        key_env: the name of an environment variable that holds the key, instead of ``key``.

    Returns:
        A :class:`SaveResult` with the path, bytes written and seconds taken.

    Example:
        >>> trainstate.save("ckpt/step_1200", {"model": model, "step": 1200}, metadata={"run": "exp1"})
        >>> trainstate.save("secret/step_1200", state, key_env="TRAINSTATE_KEY")  # encrypted
    """
    start = time.perf_counter()
    options = save_options(
        overwrite=overwrite,
        fsync=fsync,
        threads=threads,
        compression=compression,
        key=key,
        key_env=key_env,
        collective=collective,
        group_size=rank_and_world()[1],
    )
    backend, root = resolve(path, storage)
    if options.collective:
        from trainstate._distributed.save import save_collective

        coord = coordinator(timeout=timeout)
        assert coord is not None  # a group of several ranks (group_size) has one
        return save_collective(coord, root, state, metadata=metadata, storage=backend, options=options, start=start)
    return save_alone(root, state, metadata=metadata, storage=backend, options=options, start=start)


def save_alone(
    path: str | os.PathLike[str],
    state: Any,
    *,
    metadata: Any,
    options: SaveOptions,
    storage: Storage | None = None,
    start: float | None = None,
) -> SaveResult:
    """:func:`save` by this process alone, with its write options already resolved (``save_options``)."""
    start = time.perf_counter() if start is None else start
    backend, root = resolve(path, storage)
    with _gc.paused():  # a state of many small tensors would otherwise spend a quarter of the save collecting
        snapshot = encode_state(state, metadata)
        return write_checkpoint(root, snapshot, storage=backend, options=options, start=start)
