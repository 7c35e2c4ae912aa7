"""Names map by path: a saved dict keyed as the target's is, where the two nest the same names differently.

A tensor's name is its dotted path (``model.0.weight``), whichever framework wrote it. But frameworks nest
the same path differently: a torch ``state_dict`` is flat with dotted keys (``{"0.weight": w}``), a JAX pytree
is nested dicts (``{"0": {"weight": w}}``). So that a checkpoint written by one restores into a target built
by the other, the planner (plan.py) re-keys each saved dict the way the target's is, by path, before matching:

* the target nests what was saved dotted: the saved ``"0.weight"`` and ``"0.bias"`` become a dict under
  ``"0"`` (the next level is re-keyed again, so ``"model.0.weight"`` can become three levels);
* the target has dotted what was saved nested: the saved dict under ``"0"`` is flattened into ``"0.weight"``...

Keys the target has as they were saved are left alone, so a state that matches is never re-keyed, and
what is left over on either side is reported as missing or unexpected under its path, as before.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from trainstate import _tree as tree


def keyed_like(node: tree.DictNode, target: Mapping[Any, Any]) -> tree.DictNode:
    """``node`` re-keyed, by path, the way ``target`` is (see the module's docstring). Linear in the keys."""
    saved = set(node.keys)
    lacking = {k for k in target if isinstance(k, str) and k not in saved}
    if not lacking:
        return node
    # saved nested, dotted in the target: flatten the saved dicts that a lacking target key reaches into
    reached = {t[:i] for t in lacking for i, c in enumerate(t) if c == "."}
    items: list[tuple[Any, tree.Node]] = []
    for k, child in node.items():
        if isinstance(k, str) and k in reached and _named(child):
            items.extend(_flattened(k, child))
        else:
            items.append((k, child))
    # saved dotted, nested in the target: gather the saved keys under the lacking target key they start with
    lacking.difference_update(k for k, _ in items)
    groups: dict[str, list[tuple[str, tree.Node]]] = {}  # by target key, in the place of its first member
    keys: list[Any] = []
    values: list[tree.Node | list[tuple[str, tree.Node]]] = []
    for k, child in items:
        owner = _owner(k, lacking) if isinstance(k, str) and k not in target else None
        if owner is None:
            keys.append(k)
            values.append(child)
            continue
        if owner not in groups:
            groups[owner] = []
            keys.append(owner)
            values.append(groups[owner])
        groups[owner].append((k[len(owner) + 1 :], child))
    nodes = [
        tree.DictNode(tuple(g for g, _ in v), tuple(c for _, c in v)) if isinstance(v, list) else v for v in values
    ]
    return tree.DictNode(tuple(keys), tuple(nodes))


def _owner(key: str, lacking: set[str]) -> str | None:
    """The shortest dotted prefix of ``key`` among ``lacking``: the target key that nests it."""
    for i, c in enumerate(key):
        if c == "." and key[:i] in lacking:
            return key[:i]
    return None


def _named(node: tree.Node) -> bool:
    """Whether ``node`` is a dict that names its children by path: not empty, string keys only."""
    return isinstance(node, tree.DictNode) and bool(node.keys) and all(isinstance(k, str) for k in node.keys)


def _flattened(prefix: str, node: tree.Node) -> Iterator[tuple[str, tree.Node]]:
    """A nested dict's entries under dotted keys (``prefix.a.b``), down through dicts that :func:`_named`."""
    if not isinstance(node, tree.DictNode) or not _named(node):
        yield prefix, node
        return
    for k, child in node.items():
        yield from _flattened(f"{prefix}.{k!s}", child)
