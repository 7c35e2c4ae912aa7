"""A live state as tree nodes: what a save walks into, and which objects a restore hands state to.

:func:`encode` turns a live state (dicts, lists, tuples, tensors of any registered framework, objects with
``state_dict()`` / ``load_state_dict()``, JAX pytrees, :class:`PerRank` values) into the nodes of
:mod:`trainstate._tree`, on its one walker; :func:`stateful_objects` lists the objects a restore loads into.
This is the half of the tree that asks the framework adapters what a value is; the nodes, the JSON grammar
and :func:`trainstate._tree.decode` need no framework and sit below them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, NamedTuple, Protocol, runtime_checkable

from trainstate._frameworks import (
    adapter_for,
    jax_tree,
    pytree,
    rebuilt_from_checkpoint,
    stateful_view,
    type_label,
    unwrapped,
)
from trainstate._tree import (
    MAX_DEPTH,
    PER_RANK_TYPE,
    Branch,
    Node,
    StatefulNode,
    dict_node,
    first,
    join,
    key_text,
    new_stateful,
    new_tensor,
    new_value,
    nothing,
    refuse_crowded,
    seq_node,
    stateful_node,
    tuple_node,
    walk,
)
from trainstate.errors import UnsupportedValueError

# -- live state -> nodes ----------------------------------------------------------------------------


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()`` / ``load_state_dict()``: modules, optimizers, schedulers, loaders.

    Your own class joins the state by having both methods; ``state_dict()`` returns what the state may
    hold (tensors, arrays, plain values, nested containers).

    Example:
        >>> class Counter:
        ...     def __init__(self) -> None:
        ...         self.seen = 0
        ...     def state_dict(self) -> dict:
        ...         return {"seen": self.seen}
        ...     def load_state_dict(self, state: dict) -> None:
        ...         self.seen = state["seen"]
        >>> isinstance(Counter(), trainstate.Stateful)
        True
        >>> trainstate.save("ckpt", {"counter": Counter()})
    """

    def state_dict(self) -> Any:
        """What to save: tensors, arrays, plain values and containers of them.

        Example:
            >>> torch.nn.Linear(2, 1).state_dict().keys()
            odict_keys(['weight', 'bias'])
        """
        ...

    def load_state_dict(self, state_dict: Any, /) -> Any:
        """Take back what :meth:`state_dict` returned (as ``load`` restored it).

        Example:
            >>> model.load_state_dict(other_model.state_dict())
        """
        ...


def is_stateful(value: Any) -> bool:
    if isinstance(value, type):
        return False
    return _has_both_methods(value) or stateful_view(value) is not None


def _has_both_methods(value: Any) -> bool:
    """``isinstance(value, Stateful)`` as ``typing`` decides it (both attributes there, neither None), without
    its per-call cost (a restore asks for every value of the state)."""
    return getattr(value, "state_dict", None) is not None and getattr(value, "load_state_dict", None) is not None


_Live = tuple[Any, tuple[str, ...], bool]  # a live value, its path, and whether it is a dict key
_NOT_PLAIN = object()


class PerRank:
    """Marks a part of the state whose value differs between ranks (a rank's own counters, buffers).

    Under torch.distributed each rank saves its own value and gets its own back at the same world size;
    a different world size is an error for it (docs/distributed.md). ``trainstate.RNGState`` and data
    loaders are per rank without this mark. In a single process it is transparent.

    Attributes:
        value: the marked part of the state (restored in place inside it, as anywhere else).

    Example:
        >>> state = {"model": model, "seen": trainstate.PerRank({"samples": seen})}
        >>> state["seen"].value["samples"]
    """

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"PerRank({self.value!r:.60})"


def is_per_rank(value: Any) -> bool:
    """Whether ``value`` is saved per rank under torch.distributed."""
    return (
        isinstance(value, PerRank)
        or getattr(value, "__trainstate_per_rank__", False) is True  # on the instance: a sampler says per object
        or (is_stateful(value) and rebuilt_from_checkpoint(value))  # a data loader: each rank's own position
    )


class _Own(NamedTuple):
    """A per-rank object's value, encoded as itself under its rank's key (not marked again)."""

    value: Any


def _per_rank_node(results: list[Any]) -> StatefulNode:
    return new_stateful(PER_RANK_TYPE, dict_node(results))


def encode(
    state: Any,
    on_tensor: Callable[[tuple[str, ...], Any], str],
    path: tuple[str, ...] = (),
    rank: int | None = None,
    bound: Mapping[int, Any] | None = None,
) -> Node:
    """The node for ``state``; ``on_tensor(path, array)`` registers an array and returns its table name.

    Objects with ``state_dict()`` are asked for it (in tree order); an object in ``bound`` (by ``id``, from
    :func:`trainstate._frameworks.bind`) is saved as its binding's ``state_dict()`` says instead. With
    ``rank`` (a collective save), each per-rank part (:func:`is_per_rank`) becomes a :data:`PER_RANK_TYPE`
    node holding this rank's value under its rank's key. Raises UnsupportedValueError for a value that
    cannot be stored without pickle, and for a state nested deeper than :data:`MAX_DEPTH`.
    """
    bound = bound or {}

    def visit(item: _Live) -> Any:
        value, at, key = item
        if type(value) is _Own:
            value = value.value
        elif isinstance(value, PerRank) or (rank is not None and not key and is_per_rank(value)):
            inner = value.value if isinstance(value, PerRank) else value
            if rank is None:  # a single process: transparent
                return Branch([(_Own(inner), at, False)], first)
            return Branch([(str(rank), at, True), (_Own(inner), at + (str(rank),), False)], _per_rank_node)
        if value is None or type(value) is bool or type(value) is str:
            return value if key else new_value(value)
        if adapter_for(value) is not None:
            try:
                if key:
                    raise UnsupportedValueError("arrays cannot be dict keys or metadata")
                return new_tensor(on_tensor(at, value))
            except UnsupportedValueError as e:  # the adapter knows what is wrong, only the walk knows where
                raise UnsupportedValueError(f"{join(at) or 'the state'}: {e}") from None
        plain = _plain(value)
        if plain is not _NOT_PLAIN:
            return plain if key else new_value(plain)
        if key:
            if isinstance(value, tuple):
                return Branch([(v, at, True) for v in value], tuple)
            raise UnsupportedValueError(
                f"{join(at) or 'the state'}: dict key {value!r:.40} of type {type(value).__qualname__} cannot be stored"
            )
        if is_stateful(value):
            value = unwrapped(value)
            source = bound.get(id(value), value)
            return Branch([(source.state_dict(), at, False)], partial(stateful_node, type_label(value)))
        if isinstance(value, Mapping):
            refuse_crowded(at, value.keys())
            children: list[_Live] = []
            for k, v in value.items():
                children.append((k, at, True))
                children.append((v, at + (key_text(k),), False))
            return Branch(children, dict_node)
        if isinstance(value, (list, tuple)):
            children = [(v, at + (str(i),), False) for i, v in enumerate(value)]
            return Branch(children, tuple_node if isinstance(value, tuple) else seq_node)
        node = pytree(value)
        if node is not None:  # a JAX pytree node: a dict of its children (_frameworks/jax_tree.py)
            kids, _ = node
            if jax_tree.is_single(value, kids):
                return Branch([(kids[0][1], at, False)], first)
            refuse_crowded(at, (k for k, _ in kids))
            children = []
            for k, v in kids:
                children.append((k, at, True))
                children.append((v, at + (key_text(k),), False))
            return Branch(children, dict_node)
        raise UnsupportedValueError(
            f"{join(at) or 'the state'}: {type(value).__qualname__} cannot be stored without pickle; "
            "give it state_dict() / load_state_dict(), or convert it to arrays and plain values"
        )

    node: Node = walk((state, path, False), visit, _too_deep)
    return node


def _too_deep(item: tuple[Any, tuple[str, ...], Any]) -> Exception:
    return UnsupportedValueError(
        f"{join(item[1][:5]) or 'the state'}...: state nests deeper than {MAX_DEPTH} levels "
        "(lists, tuples, dicts and state_dict() objects count one level each)"
    )


def stateful_objects(state: Any) -> list[tuple[tuple[str, ...], Any]]:
    """Every object with ``state_dict()`` that the user's containers hold, with its path, in tree order.

    The containers are the ones :func:`encode` walks into (dicts, lists, tuples, :class:`PerRank`); what a
    stateful object holds is its own and is not searched. This lets a framework key one object's state
    through others of the same state: a torch optimizer by the names its parameters have in the modules
    that own them (:func:`trainstate._frameworks.bind`).
    """
    found: list[tuple[tuple[str, ...], Any]] = []

    def visit(item: tuple[Any, tuple[str, ...], bool]) -> Branch[tuple[Any, tuple[str, ...], bool], None] | None:
        value, at, _ = item
        if isinstance(value, PerRank):
            return Branch([(value.value, at, False)], nothing)
        if hasattr(type(value), "load_state_dict") and is_stateful(value):  # the type test first: it is cheap
            found.append((at, unwrapped(value)))
            return None
        if isinstance(value, Mapping):
            return Branch([(v, at + (key_text(k),), False) for k, v in value.items()], nothing)
        if isinstance(value, (list, tuple)):
            return Branch([(v, at + (str(i),), False) for i, v in enumerate(value)], nothing)
        return None

    walk((state, (), False), visit, _too_deep)
    return found


def _plain(value: Any) -> Any:
    """``value`` as the exact builtin it stands for (bool, int, float, str, bytes), or _NOT_PLAIN."""
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, str):
        return str(value)
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    return _NOT_PLAIN


def _no_tensor(path: tuple[str, ...], value: Any) -> str:
    raise UnsupportedValueError("arrays cannot be dict keys or metadata")  # encode() adds where


def encode_plain(value: Any) -> Node:
    """Encode metadata: like state, but arrays are refused; a NumPy scalar (``np.float32(0.1)``, where a
    number was meant) is stored as the Python number it stands for."""
    return encode(_numpy_scalars_as_numbers(value), _no_tensor, ("metadata",))


def _numpy_scalars_as_numbers(value: Any, depth: int = 0) -> Any:
    if depth > MAX_DEPTH:
        return value  # encode reports the depth
    kind = type(value)
    if kind.__module__ == "numpy" and kind.__name__ != "ndarray" and getattr(value, "shape", None) == ():
        if getattr(getattr(value, "dtype", None), "kind", "") in ("b", "i", "u", "f"):  # np.float32(0.1), np.int64(3)
            return value.item()
    if isinstance(value, dict):
        return {k: _numpy_scalars_as_numbers(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_numpy_scalars_as_numbers(v, depth + 1) for v in value)
    return value
