"""A torch pickle's numbers, tuples and keys, scanned before torch's unpickler builds anything from them.

torch's weights-only unpickler runs no code, but it builds dicts and hashes their keys as it goes, and
Python's hashes of numbers (and of tuples of them) are not randomized: a file can choose keys that all share
one hash (a dict of them builds in quadratic time), or a key whose hash visits far more than the file holds
(a tuple shared by reference level after level) or recurses past the C stack (a million nested tuples). This
module follows a pickle's opcodes with ``pickletools`` -- running nothing -- and refuses such a pickle first:
more than a few distinct key candidates of one hash (:mod:`trainstate._hashes`), tuples or built objects whose
hash would cost more than 8 times the pickle or nest deeper than 100, a dict key that is not a string, a
number or a tuple of them, containers built from lists, ``bytearray(N)``, or a pickle it cannot follow.
"""

from __future__ import annotations

import mmap
import pickletools
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from trainstate import _hashes
from trainstate.errors import CheckpointError, CorruptCheckpointError, UnsupportedValueError

_NUMBERS = frozenset({"INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "FLOAT", "BINFLOAT"})
_STRINGS = frozenset(
    {"STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8"}
)
_CONSTANTS = {"NONE": None, "NEWTRUE": True, "NEWFALSE": False, "EMPTY_TUPLE": ()}
_TUPLES = {"TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3}
_TUPLE_DEPTH = 100  # a tuple's hash and equality recurse into its items (torch's own: a Size, a stride)
_OTHER = object()  # a value the scan does not follow: its hash is randomized, by identity, or it has none
_NUMBER_TYPES = {"complex": complex, "int": int, "float": float}  # builtins whose values hash as numbers do
_BUILTINS = ("builtins", "__builtin__")  # the module as protocols 3+ and 0-2 name it
_FILLED_FROM_ARGS = {  # containers that hash what their arguments hold as they are built
    (module, name)
    for module, name in (("collections", "OrderedDict"), ("collections", "defaultdict"))
    + tuple((b, n) for b in ("builtins", "__builtin__") for n in ("set", "frozenset", "dict"))
}


class _Global(NamedTuple):
    """A class or function the pickle names (GLOBAL, STACK_GLOBAL)."""

    module: str
    name: str


class _Built:
    """A value the scan does not compute (an object REDUCE or NEWOBJ builds, a tuple holding one): its hash
    is not followed, but what hashing it may cost is (its arguments' size and depth, counted as a tuple's)."""

    __slots__ = ()


def _values(pickled: Any, path: Path) -> Iterator[Any]:
    """The numbers a pickle holds and the tuples it builds of them, in order: the values whose hashes a file
    can choose (a tuple's hash comes from its items', so tuples of numbers of distinct hashes can share one;
    ``complex``, ``int`` and ``float`` built by REDUCE are numbers too). Its stack and memo are followed by
    each opcode's stack effect (``pickletools``); anything else is one opaque value.

    Hashing a tuple hashes its items, recursively and without caching: every tuple built, and every object
    built from arguments (a ``torch.Size``), is counted at the size of everything under it, shared references
    counted each time. The whole may cost at most 8 times the pickle's size, and nest at most
    :data:`_TUPLE_DEPTH` deep (deeper, hashing it overflows the C stack); else the pickle is refused."""
    stack: list[Any] = []
    marks: list[int] = []
    memo: dict[Any, Any] = {}
    sizes: dict[int, tuple[int, int]] = {}  # id of a tuple or built value -> its items counted in full, depth
    alive: list[Any] = []  # every value in sizes, kept so that no id is reused while the scan runs
    budget = 8 * (len(pickled) if isinstance(pickled, (bytes, bytearray)) else pickled.size()) + 1_000_000

    def counted(items: tuple[Any, ...], value: Any) -> Any:
        nonlocal budget
        inner = [sizes.get(id(item), (1, 1)) for item in items if type(item) in (tuple, _Built)]
        size = len(items) + sum(n for n, _ in inner)
        depth = 1 + max((d for _, d in inner), default=0)
        budget -= size
        if budget < 0 or depth > _TUPLE_DEPTH:
            raise CorruptCheckpointError(
                f"{path}: its pickle's tuples refer to the same values over and over, or nest deeper than "
                f"{_TUPLE_DEPTH} levels: no torch.save of a state holds them"
            )
        sizes[id(value)] = (size, depth)
        alive.append(value)
        return value

    for op, arg, _ in pickletools.genops(pickled):
        name = op.name
        if name in _NUMBERS or name in _CONSTANTS:
            stack.append(arg if name in _NUMBERS else _CONSTANTS[name])
        elif name in _STRINGS:
            stack.append(arg if isinstance(arg, str) else _OTHER)
        elif name == "MARK":
            marks.append(len(stack))
        elif name in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"):
            memo[len(memo) if name == "MEMOIZE" else arg] = stack[-1]
        elif name in ("GET", "BINGET", "LONG_BINGET", "DUP"):
            stack.append(stack[-1] if name == "DUP" else memo.get(arg, _OTHER))
        elif name == "GLOBAL":
            module, _, attr = str(arg).partition(" ")
            stack.append(_Global(module, attr))
        elif name == "STACK_GLOBAL":
            module, attr = stack[-2], stack[-1]
            del stack[-2:]
            stack.append(_Global(module, attr) if type(module) is str and type(attr) is str else _OTHER)
        elif name in ("REDUCE", "NEWOBJ"):
            made, args = stack[-2], stack[-1]
            del stack[-2:]
            if type(made) is _Global and made.module in _BUILTINS and made.name == "bytearray":
                if type(args) is not tuple or any(type(a) is int for a in args):  # bytearray(N): N zero bytes
                    raise CorruptCheckpointError(
                        f"{path}: its pickle makes a bytearray of a given length (memory out of proportion to "
                        "the file): no torch.save of a state does"
                    )
            if type(made) is _Global and (made.module, made.name) in _FILLED_FROM_ARGS:
                opaque = args is _OTHER or type(args) is _Built  # a tuple holding a list or an object
                if opaque or (type(args) is tuple and any(type(item) is _Global for item in args)):
                    raise UnsupportedValueError(
                        f"{path}: its pickle builds a {made.name} from a list or another object, whose keys the "
                        "import cannot check before they are hashed; torch.save fills dicts item by item"
                    )
            number = _NUMBER_TYPES.get(made.name) if type(made) is _Global and made.module in _BUILTINS else None
            if number is not None and type(args) is tuple and all(type(a) in (int, float, str) for a in args):
                try:
                    stack.append(number(*args))
                except (TypeError, ValueError, OverflowError):
                    stack.append(_OTHER)
                else:
                    yield stack[-1]
                continue
            if type(args) in (tuple, _Built):  # what hashing the object may cost: its arguments'
                stack.append(counted(args if type(args) is tuple else (args,), _Built()))
            else:
                stack.append(_OTHER)
        elif name in ("SETITEM", "SETITEMS"):  # a dict filled: its keys must be what trainstate stores
            at = len(stack) - 2 if name == "SETITEM" else marks.pop()
            keys = stack[at::2]
            del stack[at:]
            for key in keys:
                if not _plain(key):
                    raise UnsupportedValueError(
                        f"{path}: its pickle fills a dict with a key that is not a string, a number or a tuple of "
                        f"them ({type(key).__name__.lstrip('_')}); trainstate stores no such key, and its hash is "
                        "not one the import can bound"
                    )
        elif name == "TUPLE" or name in _TUPLES:
            at = marks.pop() if name == "TUPLE" else len(stack) - _TUPLES[name]
            items = tuple(stack[at:])
            del stack[at:]
            follows = not any(item is _OTHER or type(item) in (_Built, _Global) for item in items)
            stack.append(counted(items, items if follows else _Built()))
            if follows:
                yield items
        else:
            before = op.stack_before
            if pickletools.markobject in before:
                del stack[marks.pop() :]
                count = before.index(pickletools.markobject)
            else:
                count = len(before)
            if count:
                del stack[-count:]
            stack.extend(_OTHER for _ in op.stack_after)
            continue
        if name in _NUMBERS:
            yield stack[-1]


def _plain(key: Any) -> bool:
    """Whether a dict key the scan followed is a string, a number, None or a tuple of them (nested within the
    scan's depth limit): keys whose hash the scan knows. A built object, a global or a value it does not
    follow is not."""
    if type(key) in (str, int, float, bool, complex) or key is None:
        return True
    return type(key) is tuple and all(_plain(item) for item in key)


def refuse_crowded(path: Path, pickled: Any) -> None:
    """Refuse a pickle holding more than a few distinct numbers, or tuples of them, of one hash
    (:mod:`trainstate._hashes`), before torch's unpickler builds a dict of them in time quadratic in their
    number. One pass of ``pickletools`` over the opcodes, running nothing; ``pickled`` is bytes or a mapped
    file, read up to the pickle's STOP. A pickle the scan cannot read is refused too: torch's unpickler must
    never read what the scan did not (a scan that gave up would let any pickle through)."""
    try:
        crowded = _hashes.crowded(_values(pickled, path))
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - pickletools on bytes that are no pickle, or a stack that runs out
        said = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CorruptCheckpointError(
            f"{path} is not a torch.save file (its pickle cannot be read: {said:.120})"
        ) from None
    if crowded is not None:
        raise CorruptCheckpointError(f"{path}: its pickle is refused: {_hashes.describe(crowded)}")


def refuse_crowded_legacy(path: Path) -> None:
    """:func:`refuse_crowded` for a file in torch's legacy format: its five pickles (the magic
    number, the protocol, the system's sizes, the object, its storages' keys). The file is mapped, not read: a length in the
    pickle then never sizes an allocation."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            for _ in range(5):  # the fifth, the list of storages' keys, is unpickled too (by torch, and above)
                refuse_crowded(path, mapped)
    except (OSError, ValueError):  # empty, or not a file mmap can map: torch.load says what it is
        return
