"""Plain values of a checkpoint's state (everything but tensors), listed and compared.

Both come from the tree's own walker (:mod:`trainstate._tree`): tensors stand in as :class:`TensorRef`, so
no tensor byte is read. Paths are dotted like tensor names (``optim.param_groups.0.lr``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from trainstate import _tree as tree
from trainstate._cli._output import TensorRef
from trainstate._restore.checkpoint import Checkpoint

ROOT = "(root)"


def state_values(ck: Checkpoint) -> Any:
    """The saved state with every tensor replaced by a :class:`TensorRef`."""
    return tree.decode(ck.manifest.tree, TensorRef)


def dotted(path: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in path) if path else ROOT


def leaves(node: tree.Node) -> list[tuple[str, Any]]:
    """``(path, value)`` for every plain leaf of a tree (or metadata): the tree's leaves but its tensors."""
    return [(dotted(p), tree.decode(n)) for p, n in tree.leaves(node) if not isinstance(n, tree.TensorNode)]


def same(a: Any, b: Any) -> bool:
    """Equal values of the same type (1, 1.0 and True differ; NaN equals NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return bool(a == b)


@dataclass
class Changes:
    added: list[tuple[str, Any]]
    removed: list[tuple[str, Any]]
    changed: list[tuple[str, Any, Any]]

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.changed)

    def as_json(self) -> dict[str, Any]:
        return {
            "added": [{"path": p, "value": v} for p, v in self.added],
            "removed": [{"path": p, "value": v} for p, v in self.removed],
            "changed": [{"path": p, "a": a, "b": b} for p, a, b in self.changed],
        }


def compare(a: Any, b: Any) -> Changes:
    """What changed from ``a`` to ``b``, containers walked, tensors (TensorRef) compared elsewhere."""
    out = Changes([], [], [])
    _walk(a, b, (), out)
    # A tensor added or removed on its own is reported with the tensors, not again here.
    out.added = [(p, v) for p, v in out.added if not isinstance(v, TensorRef)]
    out.removed = [(p, v) for p, v in out.removed if not isinstance(v, TensorRef)]
    return out


def _walk(a: Any, b: Any, path: tuple[Any, ...], out: Changes) -> None:
    if isinstance(a, TensorRef) and isinstance(b, TensorRef):
        return  # tensors are compared by name, with their values
    if isinstance(a, dict) and isinstance(b, dict):
        for k, v in a.items():
            if k in b:
                _walk(v, b[k], path + (k,), out)
            else:
                out.removed.append((dotted(path + (k,)), v))
        out.added.extend((dotted(path + (k,)), v) for k, v in b.items() if k not in a)
    elif isinstance(a, (list, tuple)) and type(a) is type(b):
        for i, (x, y) in enumerate(zip(a, b)):
            _walk(x, y, path + (i,), out)
        out.removed.extend((dotted(path + (i,)), a[i]) for i in range(len(b), len(a)))
        out.added.extend((dotted(path + (i,)), b[i]) for i in range(len(a), len(b)))
    elif not same(a, b):
        out.changed.append((dotted(path), a, b))
