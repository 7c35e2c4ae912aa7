"""The state tree: one typed representation of a nested state, and the one walker every reader of it uses.

A state is saved as a tree of small frozen nodes: a plain value (:class:`ValueNode`), a reference into the
tensor table (:class:`TensorNode`), a list or tuple (:class:`SeqNode`), a dict whose keys are already
decoded (:class:`DictNode`; optimizer state uses int keys, so key types are kept exactly), and an object
with ``state_dict()`` / ``load_state_dict()`` (:class:`StatefulNode`, so a restore knows to call
``load_state_dict``). Nodes are built in exactly two ways, :func:`encode` from live state and
:func:`parse` from a manifest's JSON, and read back by :func:`decode`, :func:`to_json`, :func:`leaves`,
:func:`tensor_names` and the restore planner.

All of them run on :func:`walk`, so the depth rule lives in one place: each list, tuple, dict and stateful
node is one level, and a node more than :data:`MAX_DEPTH` levels down is refused. Whatever :func:`encode`
accepts, :func:`parse` accepts back. The walk is iterative, so a hostile manifest cannot exhaust the stack,
and parsing is the validation: a node exists only if it passed the grammar.

JSON grammar (docs/format.md, "Tree nodes", is the normative version)::

    node := null | true | false | int | float | string
          | {"t": "float", "v": "nan" | "inf" | "-inf"}
          | {"t": "bytes", "v": base64}
          | {"t": "list" | "tuple", "v": [node, ...]}
          | {"t": "dict", "v": [[key, node], ...]}
          | {"t": "tensor", "name": string}
          | {"t": "stateful", "type": string, "v": node}
    key  := a node without lists, dicts, tensors or statefuls
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import sys
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from functools import partial
from typing import Any, Generic, NamedTuple, Protocol, TypeAlias, TypeVar, runtime_checkable

from trainstate import _hashes
from trainstate._frameworks import (
    adapter_for,
    jax_tree,
    pytree,
    rebuilt_from_checkpoint,
    stateful_view,
    type_label,
    unwrapped,
)
from trainstate.errors import CorruptCheckpointError, UnsupportedValueError

MAX_DEPTH = 200

Scalar: TypeAlias = "None | bool | int | float | str | bytes"
Key: TypeAlias = "Scalar | tuple[Key, ...]"  # a decoded dict key: hashable by construction
_BARE = frozenset({str, int, bool, type(None)})  # the types JSON holds as they are (a float may be non-finite)


@dataclass(frozen=True, slots=True)
class ValueNode:
    """A plain value: None, bool, int, float (non-finite ones too), str or bytes."""

    value: Scalar


@dataclass(frozen=True, slots=True)
class TensorNode:
    """A tensor, by its name in the manifest's tensor table."""

    name: str


@dataclass(frozen=True, slots=True)
class SeqNode:
    """A list, or a tuple when ``is_tuple``."""

    items: tuple[Node, ...]
    is_tuple: bool = False

    @property
    def tag(self) -> str:
        return "tuple" if self.is_tuple else "list"


@dataclass(frozen=True, slots=True)
class DictNode:
    """A mapping in insertion order; ``keys[i]`` (decoded) maps to ``values[i]``."""

    keys: tuple[Key, ...]
    values: tuple[Node, ...]

    def items(self) -> Iterator[tuple[Key, Node]]:
        return zip(self.keys, self.values)


@dataclass(frozen=True, slots=True)
class StatefulNode:
    """The ``state_dict()`` of an object of class ``type`` (a label, never imported)."""

    type: str
    state: Node


Node: TypeAlias = "ValueNode | TensorNode | SeqNode | DictNode | StatefulNode"
NONE = ValueNode(None)


# -- the walker -------------------------------------------------------------------------------------

T = TypeVar("T")  # what a walk visits: a live value, a JSON value, or a node, each with its context
R = TypeVar("R")  # what a visit yields for it


class Branch(NamedTuple, Generic[T, R]):
    """A visit's answer for a container: its children, one level deeper, and how to combine their results."""

    children: Sequence[T]
    combine: Callable[[list[R]], R]


def walk(root: T, visit: Callable[[T], R | Branch[T, R]], too_deep: Callable[[T], Exception]) -> R:
    """The one walker: visit ``root`` and, depth first in order, every child a visit returns in a Branch.

    A visit is called on a node before its children (so side effects happen in tree order); a Branch's
    ``combine`` once all its children are done. The depth rule: the root is at depth 0, a Branch's children
    one level deeper than it, and a child deeper than :data:`MAX_DEPTH` is handed to ``too_deep`` (whose
    exception is raised) instead of being visited. Iterative: the Python stack stays flat at any depth.
    """
    first = visit(root)
    if not isinstance(first, Branch):
        return first
    branch: Branch[T, R] = first
    pending: Iterator[T] = iter(branch.children)
    done: list[R] = []
    above: list[tuple[Branch[T, R], Iterator[T], list[R]]] = []  # the open branches above ``branch``
    while True:
        deep = len(above) >= MAX_DEPTH  # ``branch`` is at depth len(above): are its children too deep?
        for child in pending:
            if deep:
                raise too_deep(child)
            result = visit(child)
            if isinstance(result, Branch):
                above.append((branch, pending, done))
                branch, pending, done = result, iter(result.children), []
                break
            done.append(result)
        else:
            value = branch.combine(done)
            if not above:
                return value
            branch, pending, done = above.pop()
            done.append(value)


def _constructor(cls: type[T]) -> Callable[..., T]:
    """A quicker ``cls(*fields)`` for a frozen node: a frozen dataclass's own ``__init__`` sets each field
    through ``object.__setattr__``, and parsing a manifest (on open()'s path) makes one node per value."""
    new = object.__new__
    puts = [getattr(cls, f.name).__set__ for f in fields(cls)]  # type: ignore[arg-type]
    if len(puts) == 1:
        (put,) = puts

        def make1(a: Any) -> T:
            node = new(cls)
            put(node, a)
            return node

        return make1
    put_a, put_b = puts

    def make2(a: Any, b: Any) -> T:
        node = new(cls)
        put_a(node, a)
        put_b(node, b)
        return node

    return make2


_new_value = _constructor(ValueNode)
_new_tensor = _constructor(TensorNode)
_new_seq = _constructor(SeqNode)
_new_dict = _constructor(DictNode)
_new_stateful = _constructor(StatefulNode)


def _seq_node(items: list[Any]) -> SeqNode:
    return _new_seq(tuple(items), False)


def _tuple_node(items: list[Any]) -> SeqNode:
    return _new_seq(tuple(items), True)


def _dict_node(pairs: list[Any]) -> DictNode:
    return _new_dict(tuple(pairs[::2]), tuple(pairs[1::2]))  # the children alternate: key, value, key, ...


def _parsed_dict(keys: list[Any], tagged: list[int], what: str | None, results: list[Any]) -> DictNode:
    """The dict node from a parse: ``results`` holds the values, then the walked keys at ``tagged``. With
    ``what`` (some key is not a string), keys that share one hash are refused (:mod:`trainstate._hashes`)."""
    if tagged:
        n = len(keys)
        for i, key in zip(tagged, results[n:]):
            keys[i] = key
        del results[n:]
    if what is not None:
        crowded = _hashes.crowded(keys)
        if crowded is not None:
            raise CorruptCheckpointError(f"{what}: a dict in which {_hashes.describe(crowded)}")
    return _new_dict(tuple(keys), tuple(results))


def _refuse_crowded(at: tuple[str, ...], keys: Iterable[Any]) -> None:
    """The save side of :func:`_parsed_dict`'s rule: a state is never saved that its load would refuse."""
    try:
        crowded = _hashes.crowded(keys)
    except TypeError:  # an unhashable key: the walk refuses it, naming it
        return
    if crowded is not None:
        raise UnsupportedValueError(f"{join(at) or 'the state'}: {_hashes.describe(crowded)}")


def _stateful_node(type_name: str, state: list[Any]) -> StatefulNode:
    return _new_stateful(type_name, state[0])


def _first(results: list[Any]) -> Any:
    return results[0]


def _nothing(results: list[Any]) -> None:
    return None


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
    return isinstance(value, Stateful) or stateful_view(value) is not None


def join(path: tuple[str, ...]) -> str:
    return ".".join(path)


_Live = tuple[Any, tuple[str, ...], bool]  # a live value, its path, and whether it is a dict key
_NOT_PLAIN = object()

PER_RANK_TYPE = "trainstate.PerRank"  # a stateful node whose state maps each rank ("0", "1", ...) to its value


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
        or bool(getattr(type(value), "__trainstate_per_rank__", False))
        or (is_stateful(value) and rebuilt_from_checkpoint(value))  # a data loader: each rank's own position
    )


class _Own(NamedTuple):
    """A per-rank object's value, encoded as itself under its rank's key (not marked again)."""

    value: Any


def _per_rank_node(results: list[Any]) -> StatefulNode:
    return _new_stateful(PER_RANK_TYPE, _dict_node(results))


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
                return Branch([(_Own(inner), at, False)], _first)
            return Branch([(str(rank), at, True), (_Own(inner), at + (str(rank),), False)], _per_rank_node)
        if value is None or type(value) is bool or type(value) is str:
            return value if key else _new_value(value)
        if adapter_for(value) is not None:
            try:
                if key:
                    raise UnsupportedValueError("arrays cannot be dict keys or metadata")
                return _new_tensor(on_tensor(at, value))
            except UnsupportedValueError as e:  # the adapter knows what is wrong, only the walk knows where
                raise UnsupportedValueError(f"{join(at) or 'the state'}: {e}") from None
        plain = _plain(value)
        if plain is not _NOT_PLAIN:
            return plain if key else _new_value(plain)
        if key:
            if isinstance(value, tuple):
                return Branch([(v, at, True) for v in value], tuple)
            raise UnsupportedValueError(
                f"{join(at) or 'the state'}: dict key {value!r:.40} of type {type(value).__qualname__} cannot be stored"
            )
        if is_stateful(value):
            value = unwrapped(value)
            source = bound.get(id(value), value)
            return Branch([(source.state_dict(), at, False)], partial(_stateful_node, type_label(value)))
        if isinstance(value, Mapping):
            _refuse_crowded(at, value.keys())
            children: list[_Live] = []
            for k, v in value.items():
                children.append((k, at, True))
                children.append((v, at + (str(k),), False))
            return Branch(children, _dict_node)
        if isinstance(value, (list, tuple)):
            children = [(v, at + (str(i),), False) for i, v in enumerate(value)]
            return Branch(children, _tuple_node if isinstance(value, tuple) else _seq_node)
        node = pytree(value)
        if node is not None:  # a JAX pytree node: a dict of its children (_frameworks/jax_tree.py)
            kids, _ = node
            if jax_tree.is_single(value, kids):
                return Branch([(kids[0][1], at, False)], _first)
            _refuse_crowded(at, (k for k, _ in kids))
            children = []
            for k, v in kids:
                children.append((k, at, True))
                children.append((v, at + (str(k),), False))
            return Branch(children, _dict_node)
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
            return Branch([(value.value, at, False)], _nothing)
        if hasattr(type(value), "load_state_dict") and is_stateful(value):  # the type test first: it is cheap
            found.append((at, unwrapped(value)))
            return None
        if isinstance(value, Mapping):
            return Branch([(v, at + (str(k),), False) for k, v in value.items()], _nothing)
        if isinstance(value, (list, tuple)):
            return Branch([(v, at + (str(i),), False) for i, v in enumerate(value)], _nothing)
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


# -- JSON -> nodes ----------------------------------------------------------------------------------

_NON_FINITE = ("nan", "inf", "-inf")


def parse(raw: Any, tensors: Collection[str] | None, what: str = "tree") -> Node:
    """The nodes for a parsed manifest's JSON ``raw``; checks the grammar and the depth rule on the way.

    ``tensors`` holds the names a tensor node may refer to (the manifest's table), or is None where no
    tensor may be (metadata). One pass, no copies: JSON lists become the nodes' tuples directly.

    Raises:
        CorruptCheckpointError: anything in ``raw`` outside the grammar, or nested deeper than MAX_DEPTH.
    """

    names = tensors if tensors is not None else ()

    def visit(item: Any) -> Any:  # a JSON value; a dict key comes wrapped in a 1-tuple (JSON has no tuples)
        kind = type(item)
        if kind is dict:
            tag, v = item.get("t"), item.get("v")
            if tag == "tensor":
                name = item.get("name")
                if type(name) is str and name in names:
                    return _new_tensor(name)
                if tensors is None:
                    raise CorruptCheckpointError(f"{what}: tensor {name!r:.40} where none may be")
                if type(name) is not str:
                    raise CorruptCheckpointError(f"{what}: tensor node without a name")
                raise CorruptCheckpointError(f"{what} refers to tensor {name!r:.80}, which the manifest does not list")
            if tag == "dict" and type(v) is list:
                keys: list[Any] = []
                children: list[Any] = []
                walked: list[int] = []
                odd = False  # a key that is not a string, whose hash the file can choose
                for pair in v:
                    if type(pair) is not list or len(pair) != 2:
                        raise CorruptCheckpointError(f"{what}: malformed dict item")
                    k = pair[0]
                    if type(k) is not str:
                        odd = True
                        if type(k) not in _BARE:  # a bare key is final, and no deeper than its value
                            walked.append(len(keys))
                    keys.append(k)
                    children.append(pair[1])
                if walked:
                    children.extend((keys[i],) for i in walked)  # walked after the values
                return Branch(children, partial(_parsed_dict, keys, walked, what if odd else None))
            if (tag == "list" or tag == "tuple") and type(v) is list:
                return Branch(v, _seq_node if tag == "list" else _tuple_node)
            if tag == "stateful" and type(item.get("type")) is str and "v" in item:
                return Branch((v,), partial(_stateful_node, item["type"]))
            return _new_value(tagged(item))
        if kind is str or kind is int or item is None or kind is bool:
            return _new_value(item)
        if kind is float:
            return _new_value(_finite(item))
        if kind is tuple:
            return key(item[0])
        raise CorruptCheckpointError(f"{what}: malformed node {item!r:.80}")

    def key(item: Any) -> Any:  # a dict key, and the elements of a tuple key
        kind = type(item)
        if item is None or kind is str or kind is int or kind is bool:
            return item
        if kind is float:
            return _finite(item)
        if kind is dict and item.get("t") == "tuple":
            if type(item.get("v")) is not list:
                raise CorruptCheckpointError(f"{what}: malformed tuple node")
            return Branch([(x,) for x in item["v"]], tuple)
        if kind is dict and item.get("t") in ("list", "dict", "tensor", "stateful"):
            raise CorruptCheckpointError(f"{what}: a {item['t']} node as a dict key (keys are plain values or tuples)")
        return tagged(item)

    def tagged(item: Any) -> float | bytes:  # the plain values JSON cannot hold bare; the rest is malformed
        if type(item) is not dict:
            raise CorruptCheckpointError(f"{what}: malformed node {item!r:.80}")
        tag, v = item.get("t"), item.get("v")
        if tag == "float" and v in _NON_FINITE:
            return float(v)  # a new object each time: two NaN keys of one dict stay two keys
        if tag == "bytes" and type(v) is str:
            try:
                return base64.b64decode(v, validate=True)
            except (binascii.Error, ValueError):
                raise CorruptCheckpointError(f"{what}: malformed bytes node") from None
        if tag in ("float", "bytes", "list", "tuple", "dict", "stateful"):
            raise CorruptCheckpointError(f"{what}: malformed {tag} node {v!r:.40}")
        raise CorruptCheckpointError(f"{what}: unknown tree node {item!r:.80}; written by a newer trainstate?")

    def _finite(number: float) -> float:
        if not math.isfinite(number):
            raise CorruptCheckpointError(f"{what}: a bare non-finite number (the grammar tags them)")
        return number

    def too_deep(item: Any) -> Exception:
        return CorruptCheckpointError(f"{what} nests deeper than {MAX_DEPTH} levels")

    node: Node = walk(raw, visit, too_deep)
    return node


# -- nodes -> JSON, values, keys ----------------------------------------------------------------------


def _corrupt_depth(item: Any) -> Exception:  # nodes were built by encode or parse, under the same rule
    return CorruptCheckpointError(f"tree nests deeper than {MAX_DEPTH} levels")


def to_json(node: Node) -> str:
    """The canonical JSON text for ``node``, as the manifest stores it (:func:`parse` reads it back).

    Exactly what ``json.dumps(..., sort_keys=True, separators=(",", ":"), ensure_ascii=True)`` writes for
    the tagged-dict form, built as text by the walker: no intermediate dicts, and no recursion in the
    JSON encoder however deep the tree.
    """
    text: str = walk(node, _text_visit, _corrupt_depth)
    return text


_quote = json.encoder.encode_basestring_ascii  # json.dumps's own string escaping (ensure_ascii)
_float_text = float.__repr__  # json.dumps's own float formatting
_int_text = int.__repr__


def _text_visit(item: Any) -> Any:  # a node, or a dict key that is not bare (a tagged value or a tuple)
    kind = type(item)
    if kind is TensorNode:
        return '{"name":' + _quote(item.name) + ',"t":"tensor"}'
    if kind is ValueNode:
        return _text_plain(item.value)
    if kind is DictNode:
        keys = [_text_plain(k) if type(k) in _BARE else k for k in item.keys]
        walked = [i for i, k in enumerate(item.keys) if type(k) not in _BARE]
        children = list(item.values)
        if walked:
            children.extend(keys[i] for i in walked)
        return Branch(children, partial(_text_dict, keys, walked))
    if kind is SeqNode:
        return Branch(item.items, _text_tuple if item.is_tuple else _text_list)
    if kind is StatefulNode:
        return Branch((item.state,), partial(_text_stateful, _quote(item.type)))
    if kind is tuple:
        return Branch(item, _text_tuple)
    return _text_plain(item)


def _text_plain(value: Scalar) -> str:
    if isinstance(value, str):
        return _quote(value)
    if value is None or value is True or value is False:
        return "null" if value is None else "true" if value else "false"
    if isinstance(value, int):
        try:
            return _int_text(value)
        except ValueError:  # more digits than Python converts (sys.get_int_max_str_digits): no reader parses it
            raise UnsupportedValueError(
                f"an int of {value.bit_length()} bits cannot be stored: Python reads no more than "
                f"{sys.get_int_max_str_digits()} digits of JSON (store it as bytes, or as a string)"
            ) from None
    if isinstance(value, float):
        return _float_text(value) if math.isfinite(value) else '{"t":"float","v":"' + str(value) + '"}'
    return '{"t":"bytes","v":"' + base64.b64encode(value).decode() + '"}'


def _text_list(items: list[str]) -> str:
    return '{"t":"list","v":[' + ",".join(items) + "]}"


def _text_tuple(items: list[str]) -> str:
    return '{"t":"tuple","v":[' + ",".join(items) + "]}"


def _text_dict(keys: list[Any], walked: list[int], results: list[str]) -> str:
    if walked:  # ``results`` holds the values, then the keys at ``walked``
        n = len(keys)
        for i, key in zip(walked, results[n:]):
            keys[i] = key
    return '{"t":"dict","v":[' + ",".join(["[" + k + "," + v + "]" for k, v in zip(keys, results)]) + "]}"


def _text_stateful(type_text: str, state: list[str]) -> str:
    return '{"t":"stateful","type":' + type_text + ',"v":' + state[0] + "}"


def _tensor_refused(name: str) -> Any:
    raise CorruptCheckpointError(f"unexpected tensor reference {name!r:.80}")


def decode(node: Node, on_tensor: Callable[[str], Any] = _tensor_refused) -> Any:
    """The plain value for ``node``; ``on_tensor(name)`` supplies arrays. Stateful nodes decode to their state."""

    def visit(n: Node) -> Any:
        if isinstance(n, ValueNode):
            return n.value
        if isinstance(n, TensorNode):
            return on_tensor(n.name)
        if isinstance(n, SeqNode):
            return Branch(n.items, tuple if n.is_tuple else _fresh)
        if isinstance(n, DictNode):
            return Branch(n.values, partial(_decoded_dict, n.keys))
        return Branch((n.state,), _first)

    return walk(node, visit, _corrupt_depth)


def _fresh(items: list[Any]) -> list[Any]:
    return items


def _decoded_dict(keys: tuple[Key, ...], values: list[Any]) -> dict[Key, Any]:
    return dict(zip(keys, values))


def leaves(node: Node, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Node]]:
    """Every leaf under ``node`` with its path of keys, in tree order; joined, the dotted keys that
    ``include`` / ``exclude`` patterns match and the CLI lists.

    A leaf is a value, a tensor or an empty container; a stateful node is its state (it adds no key).
    """
    found: list[tuple[tuple[str, ...], Node]] = []

    def visit(item: tuple[Node, tuple[str, ...]]) -> Branch[tuple[Node, tuple[str, ...]], None] | None:
        n, at = item
        if isinstance(n, DictNode) and n.keys:
            return Branch([(c, at + (str(k),)) for k, c in n.items()], _nothing)
        if isinstance(n, SeqNode) and n.items:
            return Branch([(c, at + (str(i),)) for i, c in enumerate(n.items)], _nothing)
        if isinstance(n, StatefulNode):
            return Branch(((n.state, at),), _nothing)
        found.append((at, n))
        return None

    walk((node, path), visit, _corrupt_depth)
    return found


def tensor_names(node: Node) -> list[str]:
    """Every tensor name referenced under ``node``, in tree order (a tied tensor once per reference)."""
    names: list[str] = []

    def visit(n: Node) -> Branch[Node, None] | None:
        if isinstance(n, TensorNode):
            names.append(n.name)
        elif isinstance(n, SeqNode):
            return Branch(n.items, _nothing)
        elif isinstance(n, DictNode):
            return Branch(n.values, _nothing)
        elif isinstance(n, StatefulNode):
            return Branch((n.state,), _nothing)
        return None

    walk(node, visit, _corrupt_depth)
    return names
