"""Per-rank parts of a state tree: what each rank sends rank 0, and how rank 0 puts the tree together.

Every rank encodes the same structure except inside per-rank nodes (``_tree.PER_RANK_TYPE``), which hold
only that rank's value. A rank sends a digest of its *skeleton* (the tree with per-rank contents left out:
equal on every rank, or the save is refused naming the top-level key that differs) and its per-rank
values, in tree order. Rank 0 fills each per-rank node of its own tree with every rank's value, keyed
``"0"``, ``"1"``, ... in rank order.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from typing import Any

from trainstate import _checksum as checksum
from trainstate import _tree as tree


def _is_per_rank(node: tree.Node) -> bool:
    return isinstance(node, tree.StatefulNode) and node.type == tree.PER_RANK_TYPE


def split(root: tree.Node) -> tuple[dict[str, str], list[str]]:
    """Digests of the skeleton per top-level key, and this rank's per-rank values (JSON text, tree order)."""
    parts: list[str] = []

    def leave_out(node: tree.StatefulNode) -> tree.Node:
        assert isinstance(node.state, tree.DictNode)
        parts.append(tree.to_json(node.state.values[0]))
        return tree.StatefulNode(tree.PER_RANK_TYPE, tree.DictNode((), ()))

    bare = _replace_per_rank(root, leave_out)
    if isinstance(bare, tree.DictNode):
        digests = {str(k): checksum.digest(tree.to_json(v).encode()) for k, v in bare.items()}
    else:
        digests = {"": checksum.digest(tree.to_json(bare).encode())}
    return digests, parts


def differing_keys(digests: list[dict[str, str]]) -> list[tuple[str, int]]:
    """(top-level key, first rank whose skeleton differs from rank 0's there)."""
    out = []
    for key in sorted(set().union(*digests), key=str):
        for rank, d in enumerate(digests):
            if d.get(key) != digests[0].get(key):
                out.append((key, rank))
                break
    return out


def merge(root: tree.Node, parts: list[list[str]], tensors: Collection[str]) -> tree.Node:
    """Rank 0's tree with each per-rank node holding every rank's value (``parts[rank][k]`` for the k-th)."""
    position = iter(range(len(parts[0]) if parts else 0))

    def every_ranks(node: tree.StatefulNode) -> tree.Node:
        k = next(position)
        values = tuple(tree.parse(json.loads(p[k]), tensors, "per-rank value") for p in parts)
        return tree.StatefulNode(tree.PER_RANK_TYPE, tree.DictNode(tuple(str(r) for r in range(len(parts))), values))

    return _replace_per_rank(root, every_ranks)


def _replace_per_rank(node: tree.Node, replace: Callable[[tree.StatefulNode], tree.Node]) -> tree.Node:
    """``node`` rebuilt with each per-rank node, in tree order, replaced by ``replace(it)``."""
    if isinstance(node, tree.StatefulNode) and node.type == tree.PER_RANK_TYPE:
        return replace(node)
    if isinstance(node, tree.DictNode):
        return tree.DictNode(node.keys, tuple(_replace_per_rank(v, replace) for v in node.values))
    if isinstance(node, tree.SeqNode):
        return tree.SeqNode(tuple(_replace_per_rank(v, replace) for v in node.items), node.is_tuple)
    if isinstance(node, tree.StatefulNode):
        return tree.StatefulNode(node.type, _replace_per_rank(node.state, replace))
    return node


def entry(node: tree.StatefulNode, rank: int, world: int) -> tree.Node | None:
    """This rank's value in a per-rank node saved by ``world`` ranks, or None if it was saved by another number."""
    state = node.state
    if not isinstance(state, tree.DictNode) or len(state.keys) != world:
        return None
    for key, value in state.items():
        if key == str(rank):
            return value
    return None


def saved_ranks(node: tree.StatefulNode) -> int:
    return len(node.state.keys) if isinstance(node.state, tree.DictNode) else 0


def is_per_rank_node(node: Any) -> bool:
    return _is_per_rank(node)
