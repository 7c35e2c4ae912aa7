"""consolidate(): a checkpoint saved by many ranks rewritten as one a single process saved.

A collective save leaves a sharded tensor as one chunk per box, in the files of the ranks that wrote
them, and per-rank values (RNG states, data loader positions, ``trainstate.PerRank``) once per rank.
Consolidating reads each tensor whole (every chunk checked against its checksum, assembled in memory)
and writes it as one chunk through the save pipeline (``write_checkpoint``: fresh checksums, the same
atomic commit as every save), a tensor at a time: each tensor is read only when the writer reaches it
and dropped once its bytes are written, so memory peaks near the largest tensor, not the checkpoint.

Per-rank values keep one rank's (``rank``, rank 0 by default), stored as a single process stores
them: a one-process resume continues as that rank did. The other ranks' values and the tensors only
they use are left out. Tensors are renamed as a one-process save names them (``rng.torch`` rather
than rank 0's ``rng.0.torch``), so the result is what ``trainstate.save`` would have written in one
process holding the whole state.
"""

from __future__ import annotations

import os
import time
from functools import partial
from typing import Any

from trainstate import _arguments as arguments
from trainstate import _gc, _keys
from trainstate import _tree as tree
from trainstate._cores import threads_within
from trainstate._distributed import per_rank
from trainstate._restore.checkpoint import Checkpoint
from trainstate._restore.lazy import stored_entry
from trainstate._save.encode import Snapshot, tensor_name
from trainstate._save.options import save_options
from trainstate._save.write import SaveResult, write_checkpoint
from trainstate._storage import Storage, resolve
from trainstate.errors import CorruptCheckpointError, InvalidArgumentError


def consolidate(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    rank: int = 0,
    overwrite: bool = False,
    fsync: bool = True,
    threads: int | None = None,
    storage: Storage | None = None,
    dst_storage: Storage | None = None,
    compression: str | None = None,
    key: _keys.KeyLike | None = None,
    key_env: str | None = None,
    new_key: _keys.KeyLike | None = None,
    new_key_env: str | None = None,
) -> SaveResult:
    """Rewrite the checkpoint ``src`` (saved by many ranks) at ``dst`` as one process would have saved it.

    Every tensor becomes one whole chunk; per-rank values keep rank ``rank``'s (a one-process resume
    continues as that rank did; the other ranks' values are left out). Each tensor is checked against its
    checksums as it is read and gets fresh ones as it is written; ``dst`` is committed atomically, like a
    save. Memory peaks near ``threads`` times the largest tensor: tensors are read a tensor at a time as the
    writer reaches them, so the default thread count is lowered where that would take more than a quarter of
    the memory available. No process group is needed; ``src`` and ``dst`` may be on different storages.

    Args:
        src: the checkpoint to read (any checkpoint: one that is whole already is copied).
        dst: where to write the result (a new checkpoint directory or URL).
        rank: whose per-rank values to keep (RNG states, data loader positions, ``trainstate.PerRank``).
        overwrite: replace a checkpoint at ``dst`` (atomically).
        fsync: flush to stable storage before the commit.
        threads: data files written at once, each holding one tensor in memory at a time.
            Default: this process's share of its cores (README, "Threads"), fewer where ``threads`` times the
            largest tensor would exceed a quarter of the memory available.
        storage: where ``src`` is (default: chosen from its path).
        dst_storage: where ``dst`` goes (default: chosen from its path).
        compression: ``"zstd"`` or ``"zstd:LEVEL"`` to compress ``dst`` (each tensor then in chunks, as
            ``trainstate.save`` compresses); by default ``dst`` is written uncompressed, whatever ``src`` is.
        key: the key of an encrypted source checkpoint, which also encrypts the result (docs/encryption.md).
        key_env: the name of an environment variable that holds the key, instead of ``key``.
        new_key: encrypt the result with this key instead (key rotation: ``src`` read with ``key``, ``dst``
            written with ``new_key``; tree, metadata and values unchanged).
        new_key_env: the name of an environment variable that holds ``new_key``, instead of ``new_key``.

    Returns:
        A :class:`SaveResult` for ``dst``.

    Raises:
        InvalidArgumentError: ``rank`` is not one of the ranks that saved ``src``, or ``threads`` < 1.
        CorruptCheckpointError: a chunk of ``src`` fails its checksum (nothing is committed at ``dst``).

    Example:
        >>> trainstate.consolidate("ckpt/step_1200", "ckpt/step_1200-single")
        >>> trainstate.load("ckpt/step_1200-single", plain_state)    # one process, no process group
    """
    start = time.perf_counter()
    if threads is not None:  # checked before the source is opened, as every front door checks its arguments
        threads = arguments.positive_int(threads, "threads")
    resolved = _keys.resolve(key, key_env)
    rotating = new_key is not None or new_key_env is not None
    backend, root = resolve(dst, dst_storage)
    with Checkpoint(src, storage, key=resolved) as ck, _gc.paused():
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < ck.world_size:
            saved_by = (
                f"{ck.world_size} ranks: pick one of 0 to {ck.world_size - 1}"
                if ck.world_size > 1
                else "one process: its values are rank 0's"
            )
            raise InvalidArgumentError(
                f"cannot keep the per-rank values of rank {rank!r:.40}: {ck.path} was saved by {saved_by}"
            )
        if threads is None:  # each file in flight holds one whole tensor
            threads = threads_within(max((t.nbytes for t in ck.manifest.tensors.values()), default=0))
        options = save_options(
            overwrite=overwrite,
            fsync=fsync,
            threads=threads,
            workers=threads,  # each file in flight holds one tensor, read as the writer reaches it
            compression=compression,
            key=new_key if rotating else resolved,
            key_env=new_key_env if rotating else None,
        )
        ck.verify_headers()
        root_node, names = one_process_tree(ck.manifest.tree, rank)
        entries = [stored_entry(ck, new, old) for old, new in names.items()]
        snapshot = Snapshot(root_node, ck.manifest.metadata, entries)
        return write_checkpoint(root, snapshot, storage=backend, options=options, start=start)


def one_process_tree(root: tree.Node, rank: int) -> tuple[tree.Node, dict[str, str]]:
    """``root`` with each per-rank node replaced by ``rank``'s value, and its tensors renamed as a
    one-process save names them: the new tree, and ``{old name: new name}`` in tree order (the tensors
    the new tree uses, each once).

    Raises:
        InvalidArgumentError: a per-rank node holds no value for ``rank``.
    """
    renamed: dict[str, str] = {}
    taken: set[str] = set()

    def visit(item: tuple[tree.Node, tuple[str, ...]]) -> Any:
        node, at = item
        if isinstance(node, tree.TensorNode):
            new = renamed.get(node.name)
            if new is None:  # a tied tensor keeps the name of its first place, as a save names it
                new = renamed[node.name] = tensor_name(at, taken)
            return tree.TensorNode(new)
        if isinstance(node, tree.StatefulNode) and per_rank.is_per_rank_node(node):
            return tree.Branch([(_value_of(node, rank, at), at)], _only)
        if isinstance(node, tree.DictNode):
            return tree.Branch([(v, at + (str(k),)) for k, v in node.items()], partial(_dict, node.keys))
        if isinstance(node, tree.SeqNode):
            return tree.Branch([(v, at + (str(i),)) for i, v in enumerate(node.items)], partial(_seq, node.is_tuple))
        if isinstance(node, tree.StatefulNode):
            return tree.Branch([(node.state, at)], partial(_stateful, node.type))
        return node

    new_root: tree.Node = tree.walk((root, ()), visit, _too_deep)
    return new_root, renamed


def _value_of(node: tree.StatefulNode, rank: int, at: tuple[str, ...]) -> tree.Node:
    state = node.state
    if isinstance(state, tree.DictNode):
        for key, value in state.items():
            if key == str(rank):
                return value
    saved = per_rank.saved_ranks(node)
    raise InvalidArgumentError(
        f"{tree.join(at) or 'the state'} holds per-rank values of {saved} rank(s), none for rank {rank}: pick a "
        "rank that saved it"
    )


def _only(results: list[tree.Node]) -> tree.Node:
    return results[0]


def _dict(keys: tuple[tree.Key, ...], values: list[tree.Node]) -> tree.Node:
    return tree.DictNode(keys, tuple(values))


def _seq(is_tuple: bool, items: list[tree.Node]) -> tree.Node:
    return tree.SeqNode(tuple(items), is_tuple)


def _stateful(kind: str, state: list[tree.Node]) -> tree.Node:
    return tree.StatefulNode(kind, state[0])


def _too_deep(item: Any) -> Exception:  # cannot happen: the source passed the same rule, and this tree is no deeper
    return CorruptCheckpointError(f"tree nests deeper than {tree.MAX_DEPTH} levels")
