"""The state tree: one typed representation of a nested state, and the one walker every reader of it uses.

A state is saved as a tree of small frozen nodes: a plain value (:class:`ValueNode`), a reference into the
tensor table (:class:`TensorNode`), a list or tuple (:class:`SeqNode`), a dict whose keys are already
decoded (:class:`DictNode`; optimizer state uses int keys, so key types are kept exactly), and an object
with ``state_dict()`` / ``load_state_dict()`` (:class:`StatefulNode`, so a restore knows to call
``load_state_dict``). Nodes are built in exactly two ways, :func:`trainstate._state.encode` from live state
(the half of the tree that asks the framework adapters what a value is; nothing here imports a framework)
and :func:`parse` from a manifest's JSON, and read back by :func:`decode`, :func:`to_json`, :func:`leaves`,
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
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, fields
from functools import partial
from typing import Any, Generic, NamedTuple, TypeAlias, TypeVar

from trainstate import _hashes
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
PER_RANK_TYPE = "trainstate.PerRank"  # a stateful node whose state maps each rank ("0", "1", ...) to its value


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


new_value = _constructor(ValueNode)
new_tensor = _constructor(TensorNode)
_new_seq = _constructor(SeqNode)
_new_dict = _constructor(DictNode)
new_stateful = _constructor(StatefulNode)


def seq_node(items: list[Any]) -> SeqNode:
    return _new_seq(tuple(items), False)


def tuple_node(items: list[Any]) -> SeqNode:
    return _new_seq(tuple(items), True)


def dict_node(pairs: list[Any]) -> DictNode:
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


def refuse_crowded(at: tuple[str, ...], keys: Iterable[Any]) -> None:
    """The save side of :func:`_parsed_dict`'s rule: a state is never saved that its load would refuse."""
    try:
        crowded = _hashes.crowded(keys)
    except TypeError:  # an unhashable key: the walk refuses it, naming it
        return
    if crowded is not None:
        raise UnsupportedValueError(f"{join(at) or 'the state'}: {_hashes.describe(crowded)}")


def stateful_node(type_name: str, state: list[Any]) -> StatefulNode:
    return new_stateful(type_name, state[0])


def first(results: list[Any]) -> Any:
    return results[0]


def nothing(results: list[Any]) -> None:
    return None


def key_text(key: Any) -> str:
    """A dict key as one part of a dotted path; an int of more digits than Python converts, and a string that
    is not Unicode (a lone surrogate, which no safetensors header or JSON reader takes back), are refused."""
    if isinstance(key, str):
        try:
            key.encode()
        except UnicodeEncodeError:
            raise UnsupportedValueError(
                f"a dict key that is not valid Unicode ({key!r:.60}: a lone surrogate) cannot be stored"
            ) from None
    try:
        return str(key)
    except ValueError:  # sys.get_int_max_str_digits(): no reader could parse the manifest either
        raise UnsupportedValueError(
            f"a dict key, an int of {key.bit_length()} bits, cannot be stored: Python reads no more than "
            f"{sys.get_int_max_str_digits()} digits of JSON"
        ) from None


def join(path: tuple[str, ...]) -> str:
    """A dotted path for messages and tensor names."""
    return ".".join(path)


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
                    return new_tensor(name)
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
                return Branch(v, seq_node if tag == "list" else tuple_node)
            if tag == "stateful" and type(item.get("type")) is str and "v" in item:
                return Branch((v,), partial(stateful_node, item["type"]))
            return new_value(tagged(item))
        if kind is str or kind is int or item is None or kind is bool:
            return new_value(item)
        if kind is float:
            return new_value(_finite(item))
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
        return Branch((n.state,), first)

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
            return Branch([(c, at + (str(k),)) for k, c in n.items()], nothing)
        if isinstance(n, SeqNode) and n.items:
            return Branch([(c, at + (str(i),)) for i, c in enumerate(n.items)], nothing)
        if isinstance(n, StatefulNode):
            return Branch(((n.state, at),), nothing)
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
            return Branch(n.items, nothing)
        elif isinstance(n, DictNode):
            return Branch(n.values, nothing)
        elif isinstance(n, StatefulNode):
            return Branch((n.state,), nothing)
        return None

    walk(node, visit, _corrupt_depth)
    return names
