"""Another tool's weights as a trainstate state: the tree, and entries that read each tensor when written.

Every importer (safetensors file, Hugging Face folder, torch.save file, torch.distributed.checkpoint
directory) describes its source as nested dicts / lists / plain values whose tensors are
:class:`SourceTensor` s: dtype, shape, and a function that reads the bytes. :func:`build` turns that into
the tree and lazy entries of a :class:`Snapshot`, so the save pipeline writes it a tensor at a time.

A mapping of names to tensors alone, at the top of the source or one level down (``{"model": {...}}``,
as a training script's torch.save or a DCP checkpoint nests it), is a model's ``state_dict()``: it is
recorded as a module's state (a stateful node), so ``trainstate.load(ckpt, {"model": model})`` loads it
into the module and ``trainstate.export`` finds it. Deeper mappings (an optimizer's per-parameter state)
stay plain dicts.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, NamedTuple

import numpy as np

from trainstate import _state
from trainstate import _tree as tree
from trainstate._restore.lazy import lazy_entry
from trainstate._save.encode import Entry, Snapshot, tensor_name
from trainstate.errors import UnsupportedValueError

MODULE_TYPE = "torch.nn.Module"  # the label of an imported state_dict (a label only: nothing is imported)
KIND = "torch"  # imported tensors load back as torch tensors


class SourceTensor(NamedTuple):
    """A tensor of a source: trainstate dtype code, shape, byte size, a function returning its bytes (any
    array holding them in C order), and a key equal for two names of one tensor (tied: stored once)."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    read: Callable[[], np.ndarray]
    identity: object = None


_Item = tuple[Any, tuple[str, ...]]

REPEAT_COST = 64  # bytes a repeated container is counted per item: about what a tree node of it takes


def build(
    source: Any,
    prefix: str | None,
    metadata: Any = None,
    tensor_of: Callable[[Any, str], SourceTensor | None] | None = None,
    *,
    budget: int | None = None,
) -> Snapshot:
    """The snapshot of ``source`` placed under ``prefix`` (dotted: ``"a.b"`` nests twice; None: the root).

    ``tensor_of`` turns a source's own tensor type (a torch tensor) into a :class:`SourceTensor`; it is given
    the tensor's dotted name in the source, for its errors.

    ``budget`` bounds what the source's repeated references cost (see :data:`REPEAT_COST`): a pickle refers
    to an object it already holds in two bytes, and every reference is imported as a value of its own.

    Raises:
        UnsupportedValueError: a value trainstate cannot store (named by its path), or a dict key that is
            not a plain value.
    """
    at = tuple(prefix.split(".")) if prefix else ()
    entries: list[Entry] = []
    names: dict[object, str] = {}  # identity -> table name
    taken: set[str] = set()
    seen: set[int] = set()  # ids of the containers, strings and bytes visited (all alive in ``source``)
    repeated = 0  # what the references to them after the first have cost

    def visit(item: _Item) -> Any:
        nonlocal repeated
        value, path = item
        counted = isinstance(value, (str, bytes, Mapping, list, tuple)) and not isinstance(value, SourceTensor)
        if budget is not None and counted and len(value):  # an empty one costs nothing (and may be a singleton)
            if id(value) not in seen:
                seen.add(id(value))
            else:
                repeated += len(value) * (1 if isinstance(value, (str, bytes)) else REPEAT_COST)
                if repeated > budget:
                    raise UnsupportedValueError(
                        f"{tree.join(path) or 'the source'}: the source refers to the same values over and over: "
                        f"imported, its repeated references would take more than {budget} bytes beside what the "
                        "source itself holds (each reference is imported as a value of its own)"
                    )
        if tensor_of is not None and not isinstance(value, (SourceTensor, Mapping, list, tuple)):
            value = tensor_of(value, tree.join(path[len(at) :])) or value
        if isinstance(value, SourceTensor):
            name = names.get(value.identity) if value.identity is not None else None
            if name is None:
                name = tensor_name(path, taken)
                entries.append(lazy_entry(name, value.read, value.dtype, value.shape, KIND, value.nbytes))
                if value.identity is not None:
                    names[value.identity] = name
            return tree.TensorNode(name)
        if value is None or isinstance(value, (bool, int, float, str, bytes)):
            return tree.ValueNode(_plain(value))
        if isinstance(value, Mapping):
            keys = [_key(k, path) for k in value]
            children = [(v, path + (tree.key_text(k),)) for k, v in zip(keys, value.values())]
            return tree.Branch(children, partial(_dict, tuple(keys), len(path) - len(at)))
        if isinstance(value, (list, tuple)):
            return tree.Branch(
                [(v, path + (str(i),)) for i, v in enumerate(value)], partial(_seq, isinstance(value, tuple))
            )
        raise UnsupportedValueError(
            f"{tree.join(path) or 'the source'}: a {type(value).__module__}.{type(value).__qualname__} cannot be "
            "stored (tensors, dicts, lists and plain values can)"
        )

    def too_deep(item: _Item) -> Exception:
        return UnsupportedValueError(f"{tree.join(item[1][:5])}...: nests deeper than {tree.MAX_DEPTH} levels")

    node: tree.Node = tree.walk((source, at), visit, too_deep)
    for key in reversed(at):
        node = tree.DictNode((key,), (node,))
    return Snapshot(node, _state.encode_plain(metadata), entries)


def _plain(value: Any) -> tree.Scalar:
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):  # subclasses (an IntEnum, np.float64) as the plain value they are
        return int(value)
    if isinstance(value, float):
        return float(value)
    return str(value) if isinstance(value, str) else bytes(value)


def _key(key: Any, path: tuple[str, ...]) -> tree.Key:
    if key is None or isinstance(key, (bool, int, float, str, bytes)):
        return _plain(key)
    raise UnsupportedValueError(
        f"{tree.join(path) or 'the source'}: dict key {key!r:.40} of type {type(key).__qualname__} cannot be stored"
    )


def _dict(keys: tuple[tree.Key, ...], depth: int, values: list[tree.Node]) -> tree.Node:
    node = tree.DictNode(keys, tuple(values))
    if depth <= 1 and keys and all(isinstance(k, str) for k in keys):
        if all(isinstance(v, tree.TensorNode) for v in values):
            return tree.StatefulNode(MODULE_TYPE, node)  # a state_dict: see the module docstring
    return node


def _seq(is_tuple: bool, items: list[tree.Node]) -> tree.Node:
    return tree.SeqNode(tuple(items), is_tuple)


def real_size(st: os.stat_result) -> int:
    """A file's bytes that are really there: a sparse file's holes (a terabyte of them costs nothing to ship
    in a sparse tar) would otherwise size the budgets that keep an import in proportion to its source."""
    blocks = getattr(st, "st_blocks", None)
    return st.st_size if blocks is None else min(st.st_size, blocks * 512)
