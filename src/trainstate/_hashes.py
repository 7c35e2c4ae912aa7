"""Dict keys that share one hash value: the check that keeps building a dict from a file linear.

Python's hashes of ints, floats (and so of tuples of them) are not randomized: an int hashes to itself modulo
``2**61 - 1``, so the keys ``k * (2**61 - 1)`` all hash to 0. Every insertion of such a key into a dict
compares it with each earlier one, and a dict of n of them takes n**2 / 2 comparisons: a file of a few MB,
hours. No real state has more than two distinct keys of one hash (-1 and -2 are the one pair of small ints),
so a dict, or a pickle's numbers, with more than :data:`MAX_SHARING` distinct values of one hash is refused
before the dict is built: one pass, a hash and at most :data:`MAX_SHARING` comparisons per value.

Strings and bytes are skipped: their hashes are randomized per process (``PYTHONHASHSEED``), so a file cannot
choose collisions among them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

MAX_SHARING = 8  # distinct values of one hash a dict may hold


class Tally:
    """The distinct values seen so far per hash, for a dict filled a few items at a time (an unpickler's)."""

    __slots__ = ("_seen",)

    def __init__(self) -> None:
        self._seen: dict[int, list[Any]] = {}  # hash -> its distinct values so far (at most MAX_SHARING + 1)

    def crowded(self, values: Iterable[Any]) -> Any | None:
        """The first of ``values`` whose hash more than :data:`MAX_SHARING` distinct values seen share, or None.

        Raises TypeError for an unhashable value (as building the dict would).
        """
        seen = self._seen
        for value in values:
            kind = type(value)
            if kind is str or kind is bytes:
                continue
            same = seen.setdefault(hash(value), [])
            if value not in same:  # equal values (1, 1.0, True) are one key of a dict: counted once
                same.append(value)
                if len(same) > MAX_SHARING:
                    return value
        return None


MAX_KEY_ITEMS = 10_000  # items a tuple key may hold, counted in full (hashing visits each, uncached)
MAX_KEY_DEPTH = 100  # tuples a key may nest (hashing recurses in C, and overflows its stack far deeper)


def costly(value: Any) -> bool:
    """Whether hashing ``value`` would visit more than :data:`MAX_KEY_ITEMS` items or nest deeper than
    :data:`MAX_KEY_DEPTH` (see :func:`cost`)."""
    return cost(value) > MAX_KEY_ITEMS


def cost(value: Any) -> int:
    """The items hashing ``value`` visits, counted in full; past :data:`MAX_KEY_ITEMS`, or nested deeper than
    :data:`MAX_KEY_DEPTH`, ``MAX_KEY_ITEMS + 1``. A tuple shared by reference (``t = (t, t)`` over and over,
    from a pickle's memo) costs 2**depth to hash, one nested a million deep crashes the interpreter, and a
    tuple of many references to one long ``torch.Size`` hashes its items each time. Tuples and their
    subclasses, and frozen dataclasses (which hash the tuple of their fields), are walked; shared references
    are counted each time, and an int counts one item per 64 bits (its hash, never cached, reads every digit).
    Walked without recursion, and stopped as soon as either limit is passed."""
    seen = 0
    todo: list[tuple[Any, int]] = [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if depth > MAX_KEY_DEPTH:
            return MAX_KEY_ITEMS + 1
        if type(item) is int:  # Python does not cache an int's hash: each hash reads all its digits
            seen += item.bit_length() // 64
        for inner in _parts(item):
            seen += 1
            if seen > MAX_KEY_ITEMS:
                return seen
            todo.append((inner, depth + 1))
    return seen if seen <= MAX_KEY_ITEMS else MAX_KEY_ITEMS + 1


def _parts(value: Any) -> tuple[Any, ...]:
    """What hashing ``value`` hashes in turn: a tuple's items, a dataclass's fields; nothing for a leaf."""
    if isinstance(value, tuple):
        return tuple(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return tuple(getattr(value, f.name) for f in dataclasses.fields(value))
    return ()


def crowded(values: Iterable[Any]) -> Any | None:
    """A value whose hash more than :data:`MAX_SHARING` distinct ``values`` share, or None where none does."""
    return Tally().crowded(values)


def describe(value: Any) -> str:
    """The refusal's reason, for a value :func:`crowded` returned."""
    return (
        f"more than {MAX_SHARING} distinct keys share one hash (such as {value!r:.40}); building a dict of "
        "them takes time quadratic in their number, and no real state holds them"
    )
