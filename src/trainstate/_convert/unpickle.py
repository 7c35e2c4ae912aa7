"""A pickle read as the untrusted input a downloaded file is: Python's own unpickler, allowed only what one
format's saves write.

Python's pure-Python unpickler runs one method per opcode, so each opcode that could call, change or build
an arbitrary object is replaced here (a format's subclass says what it allows: :meth:`Restricted.call`,
:meth:`Restricted.build`), and the opcodes no format here writes are refused outright. What remains builds
only plain values and containers, and is bounded by the pickle's size:

- A dict or set is filled key by key, each key checked before it is hashed: no more than a few distinct keys
  of one hash (:mod:`trainstate._hashes`: numbers' hashes are not randomized, and a dict of colliding keys
  builds in quadratic time), and none whose hash visits too many items or nests too deep (a tuple shared by
  reference level after level, or a million nested tuples, which overflow the C stack).
- Tuples nest at most :data:`MAX_DEPTH` deep (whatever walks them later recurses).
- Work out of proportion to the opcodes (copying a long string or tuple a memo reference names, hashing a
  long key) is charged to a budget of 8 times the pickle's size: a small file cannot make a large object.
"""

from __future__ import annotations

import pickle
from typing import Any

from trainstate import _hashes

MAX_DEPTH = _hashes.MAX_KEY_DEPTH  # tuples a pickle may nest (a Size in a tuple in a dict is three)
SLACK = 1 << 20  # work a pickle may cost beyond 8 times its size


class Refused(pickle.UnpicklingError):
    """What the unpickler refuses to do (a message without the file's name: the caller adds it)."""


_PythonUnpickler: Any = pickle._Unpickler  # the pure-Python unpickler: its opcodes are methods


class Restricted(_PythonUnpickler):  # type: ignore[misc]
    """Python's unpickler, allowed only plain values and containers plus what a subclass allows."""

    dispatch: dict[int, Any] = dict(_PythonUnpickler.dispatch)
    dicts: tuple[type, ...] = (dict,)  # the types SETITEM fills (exactly these: a subclass may run code)
    repeated_keys = "allowed"  # or "refused": a dict key given twice is then an error, not a replacement

    def __init__(self, file: Any, size: int) -> None:
        super().__init__(file, encoding="utf-8")
        self.budget = 8 * size + SLACK
        self._tallies: dict[int, tuple[Any, _hashes.Tally]] = {}  # each filled dict or set's keys per hash
        self._depths: dict[int, tuple[tuple[Any, ...], int]] = {}  # id of a tuple built -> it, its depth

    # -- what a subclass allows -----------------------------------------------------------------------------

    def find_class(self, module: str, name: str) -> Any:
        raise Refused(f"it asks for {module}.{name}")

    def call(self, func: Any, args: tuple[Any, ...]) -> Any:
        """What REDUCE builds of ``func(*args)``; nothing by default."""
        raise Refused(f"it calls {type_name(func)}")

    def build(self, inst: Any, state: Any) -> None:
        """What BUILD does to ``inst`` given ``state``; nothing by default."""
        raise Refused(f"it sets attributes of {type_name(inst)}")

    def check_key(self, key: Any) -> None:
        """Refuse a dict or set key the format never holds (before it is hashed); any by default."""

    # -- bounds ---------------------------------------------------------------------------------------------

    def charge(self, work: int) -> None:
        """Count work an opcode does beyond its own bytes; refuse the pickle once it is past the budget."""
        self.budget -= work
        if self.budget < 0:
            raise Refused(
                "it refers to the same values over and over: building it would take far more work or memory than "
                "its size"
            )

    def keys(self, target: Any, keys: list[Any]) -> None:
        """Check ``keys`` before they go into ``target`` (a dict or a set): a key's hash must be cheap, and
        few distinct keys may share one hash."""
        held = self._tallies.get(id(target))
        if held is None:  # held with its tally: its id names no other container while unpickling
            held = self._tallies[id(target)] = (target, _hashes.Tally())
        for key in keys:
            visited = _hashes.cost(key)  # first: checking the key walks it too
            if visited > _hashes.MAX_KEY_ITEMS:
                raise Refused(
                    f"a key nests tuples deeper than {_hashes.MAX_KEY_DEPTH} levels or holds more than "
                    f"{_hashes.MAX_KEY_ITEMS} items counted in full (an int: 64 bits an item): no save holds such a key"
                )
            self.charge(visited * (_hashes.MAX_SHARING + 1))  # its hash, and its comparisons with its peers
            self.check_key(key)
        crowded = held[1].crowded(keys)
        if crowded is not None:
            raise Refused(_hashes.describe(crowded))

    # -- the opcodes replaced -------------------------------------------------------------------------------

    def load_reduce(self) -> None:
        args = self.stack.pop()
        if type(args) is not tuple:
            raise Refused(f"it calls {type_name(self.stack[-1])} with a {type_name(args)} for its arguments")
        self.stack[-1] = self.call(self.stack[-1], args)

    def load_build(self) -> None:
        state = self.stack.pop()
        self.build(self.stack[-1], state)

    def load_setitem(self) -> None:
        value = self.stack.pop()
        key = self.stack.pop()
        self._set(self.stack[-1], [(key, value)])

    def load_setitems(self) -> None:
        items = self.pop_mark()
        self._set(self.stack[-1], list(zip(items[::2], items[1::2])))

    def _set(self, target: Any, items: list[tuple[Any, Any]]) -> None:
        if type(target) not in self.dicts:
            raise Refused(f"it sets items of {type_name(target)}, which is not a dict")
        self.keys(target, [key for key, _ in items])
        for key, value in items:
            if self.repeated_keys == "refused" and key in target:
                raise Refused(f"{described(key)} is given twice")
            target[key] = value

    def load_append(self) -> None:
        value = self.stack.pop()
        self._extend(self.stack[-1], [value])

    def load_appends(self) -> None:
        items = self.pop_mark()
        self._extend(self.stack[-1], items)

    def _extend(self, target: Any, items: list[Any]) -> None:
        if type(target) is not list:
            raise Refused(f"it appends to {type_name(target)}, which is not a list")
        target.extend(items)

    def load_tuple(self) -> None:
        items = self.pop_mark()  # first: it rebinds self.append to the stack below the mark
        self.append(self.tuple_of(items))

    def load_tuple1(self) -> None:
        self.stack[-1] = self.tuple_of([self.stack[-1]])

    def load_tuple2(self) -> None:
        self.stack[-2:] = [self.tuple_of(self.stack[-2:])]

    def load_tuple3(self) -> None:
        self.stack[-3:] = [self.tuple_of(self.stack[-3:])]

    def tuple_of(self, items: list[Any], kind: type = tuple) -> Any:
        """``kind(items)`` (a tuple, or a subclass such as ``torch.Size``), refused nested past
        :data:`MAX_DEPTH`."""
        depth = 1 + max((self._depths[id(i)][1] for i in items if id(i) in self._depths), default=0)
        if depth > MAX_DEPTH:
            raise Refused(f"a value nests tuples deeper than {MAX_DEPTH} levels: no save holds them")
        made = kind(items)
        self._depths[id(made)] = (made, depth)
        return made

    def _never(self) -> None:
        raise Refused("it holds a set, an object built by NEWOBJ, INST or OBJ, or an extension code: no save does")


for _op, _load in (
    (pickle.REDUCE, Restricted.load_reduce),
    (pickle.BUILD, Restricted.load_build),
    (pickle.SETITEM, Restricted.load_setitem),
    (pickle.SETITEMS, Restricted.load_setitems),
    (pickle.APPEND, Restricted.load_append),
    (pickle.APPENDS, Restricted.load_appends),
    (pickle.TUPLE, Restricted.load_tuple),
    (pickle.TUPLE1, Restricted.load_tuple1),
    (pickle.TUPLE2, Restricted.load_tuple2),
    (pickle.TUPLE3, Restricted.load_tuple3),
    *((op, Restricted._never) for op in (pickle.NEWOBJ, pickle.NEWOBJ_EX, pickle.INST, pickle.OBJ)),
    *((op, Restricted._never) for op in (pickle.EXT1, pickle.EXT2, pickle.EXT4, pickle.PERSID)),
    *((op, Restricted._never) for op in (pickle.EMPTY_SET, pickle.ADDITEMS, pickle.FROZENSET)),
):
    Restricted.dispatch[_op[0]] = _load


def type_name(obj: Any) -> str:
    """``module.Class`` of an object (or of a class), for messages."""
    kind = obj if isinstance(obj, type) else type(obj)
    return f"{kind.__module__}.{kind.__qualname__}"


def described(key: Any) -> str:
    """A dict key, for messages: a DCP storage index by its tensor and offset."""
    fqn, offset = getattr(key, "fqn", None), getattr(key, "offset", None)
    if isinstance(fqn, str):
        return f"the storage of {fqn!r:.80} at offset {list(offset) if offset is not None else None}"
    return f"the key {key!r:.80}" if isinstance(key, (str, int)) else f"a {type_name(key)} key"
