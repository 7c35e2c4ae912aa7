"""Flatten nested training state into JSON nodes plus a table of tensors, and back.

Types survive exactly: JSON already tells str, bool, null, int and float apart (a float is written with a
'.' or an exponent); lists, tuples and dicts become tagged nodes, dict keys keep their types (optimizer
state uses int keys), non-finite floats and bytes get tagged nodes. Arrays are replaced by references
into the tensor table; objects with ``state_dict()`` / ``load_state_dict()`` are stored as their state dict
and marked, so a restore knows to call ``load_state_dict``.

Node grammar (docs/format.md has the normative version)::

    node := null | true | false | int | float | string
          | {"t": "float", "v": "nan" | "inf" | "-inf"}
          | {"t": "bytes", "v": base64}
          | {"t": "list" | "tuple", "v": [node, ...]}
          | {"t": "dict", "v": [[key-node, node], ...]}
          | {"t": "tensor", "name": string}
          | {"t": "stateful", "type": string, "v": node}
"""

from __future__ import annotations

import base64
import math
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

from trainstate._frameworks import adapter_for
from trainstate.errors import CorruptCheckpointError, UnsupportedValueError

MAX_DEPTH = 200


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()`` / ``load_state_dict()``: modules, optimizers, schedulers, loaders."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any, /) -> Any: ...


def is_stateful(value: Any) -> bool:
    return not isinstance(value, type) and isinstance(value, Stateful)


def join(path: tuple[str, ...]) -> str:
    return ".".join(path)


def encode(
    value: Any, on_tensor: Callable[[tuple[str, ...], Any], str], path: tuple[str, ...] = (), depth: int = 0
) -> Any:
    """The node for ``value``; ``on_tensor(path, array)`` registers an array and returns its table name.

    ``depth`` counts the container and stateful nodes above this one, by the same rule as :func:`validate`,
    so whatever saves also opens.
    """
    if depth > MAX_DEPTH:
        raise UnsupportedValueError(
            f"{join(path[:5]) or 'the state'}...: state nests deeper than {MAX_DEPTH} levels "
            "(lists, tuples, dicts and state_dict() objects count one level each)"
        )
    if value is None or isinstance(value, (bool, str)) and type(value) in (bool, str):
        return value
    if adapter_for(value) is not None:
        try:
            return {"t": "tensor", "name": on_tensor(path, value)}
        except UnsupportedValueError as e:  # the adapter knows what is wrong, only the walk knows where
            raise UnsupportedValueError(f"{join(path) or 'the state'}: {e}") from None
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        value = float(value)
        return value if math.isfinite(value) else {"t": "float", "v": str(value)}
    if isinstance(value, str):
        return str(value)
    if isinstance(value, (bytes, bytearray)):
        return {"t": "bytes", "v": base64.b64encode(bytes(value)).decode()}
    if is_stateful(value):
        cls = type(value)
        return {
            "t": "stateful",
            "type": f"{cls.__module__}.{cls.__qualname__}",
            "v": encode(value.state_dict(), on_tensor, path, depth + 1),
        }
    if isinstance(value, Mapping):
        items = []
        for k, v in value.items():
            key = encode_key(k, path, depth + 1)
            items.append([key, encode(v, on_tensor, path + (str(k),), depth + 1)])
        return {"t": "dict", "v": items}
    if isinstance(value, (list, tuple)):
        tag = "tuple" if isinstance(value, tuple) else "list"
        return {"t": tag, "v": [encode(v, on_tensor, path + (str(i),), depth + 1) for i, v in enumerate(value)]}
    raise UnsupportedValueError(
        f"{join(path) or 'the state'}: {type(value).__qualname__} cannot be stored without pickle; "
        "give it state_dict() / load_state_dict(), or convert it to arrays and plain values"
    )


def encode_key(key: Any, path: tuple[str, ...], depth: int = 0) -> Any:
    if key is None or isinstance(key, (str, int, float, bool)) or isinstance(key, tuple):
        return encode(key, _no_tensor, path, depth)
    raise UnsupportedValueError(
        f"{join(path) or 'the state'}: dict key {key!r:.40} of type {type(key).__qualname__} cannot be stored"
    )


def _no_tensor(path: tuple[str, ...], value: Any) -> str:
    raise UnsupportedValueError("arrays cannot be dict keys or metadata")  # encode() adds where


def encode_plain(value: Any) -> Any:
    """Encode metadata: like state, but arrays are refused."""
    return encode(value, _no_tensor, ("metadata",))


def decode(node: Any, on_tensor: Callable[[str], Any], depth: int = 0) -> Any:
    """The value for ``node``; ``on_tensor(name)`` supplies arrays. Stateful nodes decode to their state.

    ``node`` comes from a parsed manifest, which :func:`validate` already checked (grammar and depth).
    """
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if not isinstance(node, dict):
        raise CorruptCheckpointError(f"malformed tree node {node!r:.80}")
    tag = node.get("t")
    if tag == "tensor" and isinstance(node.get("name"), str):
        return on_tensor(node["name"])
    if tag == "float" and node.get("v") in ("nan", "inf", "-inf"):
        return float(node["v"])
    if tag == "bytes" and isinstance(node.get("v"), str):
        try:
            return base64.b64decode(node["v"], validate=True)
        except ValueError:
            raise CorruptCheckpointError("malformed bytes node") from None
    if tag == "stateful" and isinstance(node.get("type"), str):
        return decode(node.get("v"), on_tensor, depth + 1)
    items = node.get("v")
    if tag in ("list", "tuple") and isinstance(items, list):
        out = [decode(v, on_tensor, depth + 1) for v in items]
        return tuple(out) if tag == "tuple" else out
    if tag == "dict" and isinstance(items, list):
        result: dict[Any, Any] = {}
        for pair in items:
            if not (isinstance(pair, list) and len(pair) == 2):
                raise CorruptCheckpointError("malformed dict item in tree")
            key = decode(pair[0], _no_tensor_keys, depth + 1)
            try:
                result[key] = decode(pair[1], on_tensor, depth + 1)
            except TypeError:
                raise CorruptCheckpointError(f"unhashable dict key {key!r:.40} in tree") from None
        return result
    raise CorruptCheckpointError(f"unknown tree node {node!r:.80}; written by a newer trainstate?")


def _no_tensor_keys(name: str) -> Any:
    raise CorruptCheckpointError(f"tensor {name!r:.40} used as a dict key")


def dict_items(node: Any) -> list[tuple[Any, Any]]:
    """Decoded keys with their child nodes, for a dict node (validated)."""
    result = []
    for pair in node["v"]:
        if not (isinstance(pair, list) and len(pair) == 2):
            raise CorruptCheckpointError("malformed dict item in tree")
        result.append((decode(pair[0], _no_tensor_keys), pair[1]))
    return result


def tensor_names(node: Any) -> list[str]:
    """Every tensor name referenced under a validated ``node``, in tree order."""
    out: list[str] = []

    def walk(n: Any) -> None:
        if isinstance(n, dict):
            tag = n.get("t")
            if tag == "tensor":
                out.append(n["name"])
            elif tag == "dict":
                for _, child in n["v"]:
                    walk(child)
            elif tag in ("list", "tuple"):
                for child in n["v"]:
                    walk(child)
            elif tag == "stateful":
                walk(n["v"])

    walk(node)
    return out


_SCALARS = (str, int, float, bool)


def validate(node: Any, *, tensors: bool = True, what: str = "tree") -> None:
    """Check a parsed node against the grammar above, so no later walker meets a malformed node.

    The one depth rule: each list, tuple, dict and stateful node is one level, and a node more than
    :data:`MAX_DEPTH` levels down is refused (:func:`encode` refuses to write one by the same count).
    Iterative, so a hostile manifest cannot exhaust the stack. Raises CorruptCheckpointError.
    """
    stack: list[tuple[Any, int, bool, bool]] = [(node, 0, tensors, False)]
    while stack:
        n, depth, allow_tensors, is_key = stack.pop()
        if depth > MAX_DEPTH:
            raise CorruptCheckpointError(f"{what} nests deeper than {MAX_DEPTH} levels")
        if n is None or isinstance(n, _SCALARS):
            if isinstance(n, float) and not math.isfinite(n):
                raise CorruptCheckpointError(f"{what}: a bare non-finite number (the grammar tags them)")
            continue
        if not isinstance(n, dict):
            raise CorruptCheckpointError(f"{what}: malformed node {n!r:.80}")
        tag, v = n.get("t"), n.get("v")
        if tag == "tensor":
            if not allow_tensors:
                raise CorruptCheckpointError(f"{what}: tensor {n.get('name')!r:.40} where none may be")
            if not isinstance(n.get("name"), str):
                raise CorruptCheckpointError(f"{what}: tensor node without a name")
        elif tag == "float":
            if v not in ("nan", "inf", "-inf"):
                raise CorruptCheckpointError(f"{what}: malformed float node {v!r:.40}")
        elif tag == "bytes":
            if not isinstance(v, str):
                raise CorruptCheckpointError(f"{what}: malformed bytes node")
        elif tag in ("list", "tuple"):
            if not isinstance(v, list) or (is_key and tag == "list"):
                raise CorruptCheckpointError(f"{what}: malformed {tag} node")
            stack.extend((child, depth + 1, allow_tensors, is_key) for child in v)
        elif tag == "dict" and not is_key:
            if not isinstance(v, list):
                raise CorruptCheckpointError(f"{what}: malformed dict node")
            for pair in v:
                if not (isinstance(pair, list) and len(pair) == 2):
                    raise CorruptCheckpointError(f"{what}: malformed dict item")
                stack.append((pair[0], depth + 1, False, True))
                stack.append((pair[1], depth + 1, allow_tensors, False))
        elif tag == "stateful" and not is_key:
            if not isinstance(n.get("type"), str) or "v" not in n:
                raise CorruptCheckpointError(f"{what}: malformed stateful node")
            stack.append((v, depth + 1, allow_tensors, False))
        else:
            raise CorruptCheckpointError(f"{what}: unknown tree node {n!r:.80}")
