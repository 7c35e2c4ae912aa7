"""save(): one checkpoint of a state, written by this process alone (``trainstate._save``) or, under a process
group, by every rank together (``trainstate._distributed.save``). It sits above both, choosing between them."""

from __future__ import annotations

import os
import time
from typing import Any

from trainstate import _arguments as arguments
from trainstate import _gc, _keys
from trainstate import _transforms as transforms
from trainstate._distributed import coordinator
from trainstate._save import (
    DEFAULT_THREADS,
    SaveResult,
    encode_state,
    write_checkpoint,
)
from trainstate._storage import Storage, resolve
from trainstate.errors import InvalidArgumentError


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
    threads = arguments.positive_int(threads, "threads")
    resolved = _keys.resolve(key, key_env)
    backend, root = resolve(path, storage)
    pipeline = transforms.pipeline(transforms.compression(compression))  # encryption: write_checkpoint adds it
    coord = coordinator(timeout=timeout) if collective is not False else None
    if coord is not None and (pipeline is not None or resolved is not None):
        raise InvalidArgumentError(
            "compression and encryption are not supported in a collective save yet: save without them (or with "
            "collective=False, each rank its own checkpoint)"
        )
    if coord is not None:
        from trainstate._distributed.save import save_collective

        return save_collective(
            coord,
            root,
            state,
            metadata=metadata,
            overwrite=overwrite,
            fsync=fsync,
            threads=threads,
            storage=backend,
            start=start,
            key=resolved,
        )
    with _gc.paused():  # a state of many small tensors would otherwise spend a quarter of the save collecting
        snapshot = encode_state(state, metadata)
        return write_checkpoint(
            root,
            snapshot,
            storage=backend,
            overwrite=overwrite,
            fsync=fsync,
            threads=threads,
            start=start,
            pipeline=pipeline,
            key=resolved,
        )
