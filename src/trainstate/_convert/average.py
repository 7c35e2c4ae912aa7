"""average(): the mean of several checkpoints, as one checkpoint (weight averaging after the fact).

Averaging the last few checkpoints of a run (stochastic weight averaging after the fact, GoMLX's
``TakeMean``) often beats the last one alone. Every floating-point tensor becomes the mean of its values
in the checkpoints; everything else comes from the *newest* checkpoint: integer and bool tensors (RNG
states, counters), plain values (step, epoch, scheduler state), the metadata, and the floating "counters"
torch keeps as tensors (an optimizer's 0-d ``step``: a mean step count is no step count).

The newest is the one with the highest training step where every checkpoint records one (a
``CheckpointManager`` records it), else the last one given: never a clock (a copied file's time is not
when it was trained). The means are accumulated in float64 for float32 / float64 tensors (so the mean of
equal tensors is exactly that tensor) and in float32 for 16- and 8-bit floats, a block at a time, then
rounded to the stored dtype. The checkpoints must hold the same tensors with the same dtypes and shapes; a mismatch is
an error naming them. One tensor at a time: each is read from every checkpoint in turn into one
accumulator, written, and dropped.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from contextlib import ExitStack
from functools import partial

import numpy as np

from trainstate import _gc, _keys, _state
from trainstate import _tree as tree
from trainstate._convert.consolidate import one_process_tree
from trainstate._format import dtypes
from trainstate._format.added_keys import FACTS_KEY
from trainstate._restore.checkpoint import Checkpoint
from trainstate._restore.lazy import lazy_entry, stored_entry
from trainstate._save.encode import Entry, Snapshot
from trainstate._save.options import save_options
from trainstate._save.write import SaveResult, write_checkpoint
from trainstate._storage import resolve
from trainstate.errors import InvalidArgumentError

COUNTER_KEYS = frozenset({"step"})  # 0-d floating tensors under these keys count, they are not averaged
BLOCK = 1 << 20  # elements averaged at once
_WIDE = {"F32": np.float64, "F64": np.float64, "C64": np.complex128, "C128": np.complex128}


def average(
    ckpts: Sequence[str | os.PathLike[str]],
    out: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    key: _keys.KeyLike | None = None,
    key_env: str | None = None,
) -> SaveResult:
    """Write at ``out`` the mean of the checkpoints ``ckpts`` (see the module docs for what is averaged).

    Args:
        ckpts: two or more checkpoints of the same state (any storage), saved by one process or by many
            ranks (sharded tensors are read whole; the result is written as one process saves, keeping rank
            0's per-rank values, as ``trainstate.consolidate`` does).
        out: the checkpoint to write (a path or URL).
        overwrite: replace a checkpoint at ``out`` (atomically).
        key: the key of encrypted checkpoints (all of them), which also encrypts the result (docs/encryption.md).
        key_env: the name of an environment variable that holds the key, instead of ``key``.

    Raises:
        InvalidArgumentError: fewer than two checkpoints, or checkpoints whose tensors differ (the message
            names them).

    Example:
        >>> trainstate.average(["run/step_00900", "run/step_00950", "run/step_01000"], "run/swa")
    """
    start = time.perf_counter()
    if isinstance(ckpts, (str, os.PathLike)) or len(ckpts) < 2:
        raise InvalidArgumentError(f"average needs two or more checkpoints, got {ckpts!r:.80}")
    options = save_options(overwrite=overwrite, threads=1, workers=1, key=key, key_env=key_env)
    resolved = options.key  # reads the checkpoints too
    backend, root = resolve(out, None)
    with ExitStack() as stack, _gc.paused():
        cks = [stack.enter_context(Checkpoint(p, key=resolved)) for p in ckpts]
        for ck in cks:
            ck.verify_headers()
        newest = cks[newest_index(cks)]
        check_same_tensors(cks)
        keys = {
            n.name: at[-1] if at else ""
            for at, n in tree.leaves(newest.manifest.tree)
            if isinstance(n, tree.TensorNode)
        }
        root_node = newest.manifest.tree
        names = {name: name for name in newest.manifest.tensors}
        if newest.world_size > 1:  # written as one process would save it, keeping rank 0's per-rank values
            root_node, names = one_process_tree(root_node, 0)
        entries: list[Entry] = []
        for name, new in names.items():
            t = newest.manifest.tensors[name]
            if averaged(t.dtype, t.shape, keys.get(name, "")):
                entries.append(lazy_entry(new, partial(mean, cks, name), t.dtype, t.shape, t.kind, t.nbytes))
            else:
                entries.append(stored_entry(newest, new, name))
        snapshot = Snapshot(root_node, _metadata(newest, cks), entries)
        return write_checkpoint(root, snapshot, storage=backend, options=options, start=start)


def newest_index(cks: list[Checkpoint]) -> int:
    """The index of the newest checkpoint: the highest recorded step (the later one on a tie) where every
    checkpoint records one, else the last."""
    steps = []
    for ck in cks:
        meta = tree.decode(ck.manifest.metadata)
        facts = meta.get(FACTS_KEY) if isinstance(meta, dict) else None
        step = facts.get("step") if isinstance(facts, dict) else None
        if type(step) is not int:
            return len(cks) - 1
        steps.append(step)
    return max(range(len(cks)), key=lambda i: (steps[i], i))


def check_same_tensors(cks: list[Checkpoint]) -> None:
    """Raise InvalidArgumentError naming every tensor that is not in all checkpoints with one dtype and shape."""
    first = cks[0]
    problems = []
    for ck in cks[1:]:
        a, b = first.manifest.tensors, ck.manifest.tensors
        only_first, only_other = [n for n in a if n not in b], [n for n in b if n not in a]
        if only_first:
            problems.append(f"{ck.path} lacks {_few(only_first)}")
        if only_other:
            problems.append(f"{ck.path} has {_few(only_other)}, which {first.path} lacks")
        for n in a:
            if n in b and (a[n].dtype, a[n].shape) != (b[n].dtype, b[n].shape):
                problems.append(
                    f"{n} is {a[n].dtype}{list(a[n].shape)} in {first.path}, {b[n].dtype}{list(b[n].shape)} in {ck.path}"
                )
    if problems:
        raise InvalidArgumentError(
            "cannot average checkpoints of different states: "
            + "; ".join(problems[:10])
            + (f"; and {len(problems) - 10} more" if len(problems) > 10 else "")
            + ". Average checkpoints of one run (one model and optimizer)"
        )


def _few(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" (+{len(names) - 5} more)" if len(names) > 5 else "")


def averaged(code: str, shape: tuple[int, ...], key: str) -> bool:
    """Whether a tensor is averaged: floating point, and not a counter (a 0-d ``step``)."""
    kind = dtypes.from_code(code).numpy.kind
    is_float = kind in "fc" or code.startswith(("BF", "F8"))  # ml_dtypes' floats are kind "V"
    return is_float and not (shape == () and key in COUNTER_KEYS)


def mean(cks: list[Checkpoint], name: str) -> np.ndarray:
    """The mean of tensor ``name`` over ``cks``, accumulated wide (module docs), in its stored dtype.

    Computed a block of :data:`BLOCK` elements at a time, so the wide accumulator stays small: memory is
    the result (one tensor) plus a block, whatever the number of checkpoints.
    """
    stored = dtypes.from_code(cks[0].manifest.tensors[name].dtype)
    wide = _WIDE.get(stored.code, np.float32)
    sources = [np.asarray(ck.read(name)).reshape(-1) for ck in cks]  # checked; views of the maps where whole
    out = np.empty(sources[0].shape, dtype=stored.numpy)
    for begin in range(0, out.size, BLOCK):
        block = slice(begin, begin + BLOCK)
        acc: np.ndarray = sources[0][block].astype(wide)
        for x in sources[1:]:
            acc += x[block].astype(wide)
        acc /= len(cks)
        out[block] = acc.astype(stored.numpy)
    return out


def _metadata(newest: Checkpoint, cks: list[Checkpoint]) -> tree.Node:
    """The newest checkpoint's metadata, with where the mean came from (a dict of its own when the newest has
    none; metadata that is not a dict is kept as it is)."""
    meta = tree.decode(newest.manifest.metadata)
    if meta is None:
        meta = {}
    if not isinstance(meta, dict):
        return newest.manifest.metadata
    return _state.encode_plain({**meta, "averaged_from": [str(ck.path) for ck in cks]})
