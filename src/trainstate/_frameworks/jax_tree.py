"""The containers JAX code keeps its arrays in: registered pytree nodes, and Flax NNX objects.

A pytree node trainstate does not know as a dict, list or tuple (a ``flax.struct`` dataclass such as
``TrainState``, an ``nnx.State``, a ``FrozenDict``, an NNX ``Variable``, any class registered with
``jax.tree_util``) is saved as a dict of its direct children, keyed as JAX keys them (a dict key, an
attribute name, an index). So the checkpoint names a tensor by its path (``params.Dense_0.kernel``) and reads
back without JAX as nested dicts. A node of exactly one child that is not a mapping (an NNX ``Variable``
holding its value) is saved as that child alone: ``lin.kernel``, not ``lin.kernel.value``. Restoring into a
target node rebuilds it from the target's own structure (``tree_unflatten``), so its static parts (a
``TrainState``'s ``apply_fn`` and ``tx``, a ``Variable``'s metadata) are the target's.

A Flax NNX object (``nnx.Module``, ``nnx.Optimizer``, ``nnx.Rngs``: an ``nnx.Pytree``) is a stateful object,
restored in place as a torch module is: saved as ``nnx.state(obj)``, restored with ``nnx.update(obj, state)``,
its own variables the truth for what is missing or unexpected. The user's references to it stay valid.

JAX is imported by whoever asks only once the process has imported it (``_frameworks.pytree``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any

Children = list[tuple[Any, Any]]  # (key, child) in the node's own order


class NnxObject:
    """A Flax NNX object seen through ``state_dict()`` / ``load_state_dict()``."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def state_dict(self) -> Any:
        from flax import nnx

        return nnx.state(self.obj)

    def load_state_dict(self, state: Any, strict: bool = True) -> None:
        from flax import nnx

        nnx.update(self.obj, state)


def nnx_object(obj: Any) -> NnxObject | None:
    """The stateful view of a Flax NNX object, or None for anything else."""
    flax = sys.modules.get("flax.nnx")
    if flax is None:
        return None
    return NnxObject(obj) if isinstance(obj, flax.Pytree) else None


def node(value: Any) -> tuple[Children, Callable[[list[Any]], Any]] | None:
    """A registered pytree node's direct children by key, and how to rebuild it from new children (in the same
    order); None for a leaf, an array, or a value JAX does not know as a node."""
    import jax
    from jax import tree_util

    if isinstance(value, jax.Array) or value is None:
        return None
    flat, treedef = tree_util.tree_flatten_with_path(value, is_leaf=lambda x: x is not value)
    if tree_util.treedef_is_leaf(treedef):
        return None
    children = [(_key(path[0]), child) for path, child in flat]

    def rebuild(values: list[Any]) -> Any:
        return tree_util.tree_unflatten(treedef, values)

    return children, rebuild


def is_single(value: Any, children: Children) -> bool:
    """Whether a node is saved as its one child alone (an NNX ``Variable``): see the module's docstring."""
    return len(children) == 1 and not isinstance(value, Mapping)


def _key(entry: Any) -> Any:
    """A JAX key-path entry as a dict key: the key, attribute name or index it holds."""
    for attribute in ("key", "name", "idx"):  # DictKey / FlattenedIndexKey, GetAttrKey, SequenceKey
        if hasattr(entry, attribute):
            return getattr(entry, attribute)
    return str(entry)
