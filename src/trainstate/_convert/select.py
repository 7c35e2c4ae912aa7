"""Which tensors of a checkpoint are "the model", and under which names: the rule export (and ONNX) share.

A training checkpoint holds the model beside its optimizer, scheduler, RNG and loop counters. An inference
export wants only the model, named as the model's own ``state_dict()`` names it (``0.weight``, not
``model.0.weight``). By default that is the first *module* in the state, in tree order: an object saved
through ``state_dict()`` (a stateful node) whose state is a flat mapping of names to tensors, as a torch
``nn.Module``'s is (a module's ``_extra_state`` values may sit beside them and are left out). An optimizer's
state (``state`` / ``param_groups``), a scheduler's (plain values) and trainstate's own RNG and per-rank
values are not modules. The manifest records an object's class only as a label, never imported, so the rule
looks at the shape of the state, not at the class.

With ``select`` (glob patterns over the dotted keys ``trainstate inspect`` lists, ``"model.*"``) the
tensors whose keys match are taken instead, named by their dotted key; ``strip_prefix`` then removes a
prefix every selected name must start with (``"model."``), so the names are the model's own again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from trainstate import _tree as tree
from trainstate._restore.checkpoint import Checkpoint
from trainstate._restore.plan import selector, unmatched
from trainstate.errors import InvalidArgumentError

EXTRA_STATE = "_extra_state"  # torch's key for a module's get_extra_state(): not a weight


class Weight(NamedTuple):
    """One tensor to export: the name it gets, and its name in the checkpoint's tensor table."""

    name: str
    stored: str


def weights(ck: Checkpoint, select: str | Sequence[str] | None = None, strip_prefix: str | None = None) -> list[Weight]:
    """The tensors an export writes, in tree order; a tensor tied under several names is listed under each.

    Raises:
        InvalidArgumentError: no module found (and no ``select``), a pattern that matches nothing, a selected
            name without ``strip_prefix``, or two tensors that end up with the same name.
    """
    if select is None:
        found = first_module(ck.manifest.tree)
        if found is None:
            top = _first_key_with_tensors(ck.manifest.tree)
            raise InvalidArgumentError(
                f"{ck.path} holds no module (an object saved through state_dict() whose state maps names to "
                f"tensors); its top-level keys are {_top_keys(ck.manifest.tree)}. Pick the weights with "
                f"select='{top}.*' (--select) and strip_prefix='{top}.' (--strip-prefix)"
            )
        path, node = found
        picked = [Weight(str(k), v.name) for k, v in node.items() if isinstance(v, tree.TensorNode)]
        where = tree.join(path) or "the state's root"
    else:
        matches = selector(select if isinstance(select, str) else list(select), None)  # checks the patterns
        patterns = [select] if isinstance(select, str) else list(select)
        keyed = [(tree.join(p), n) for p, n in tree.leaves(ck.manifest.tree)]
        missed = unmatched(patterns, [k for k, _ in keyed])
        if missed or matches is None:
            raise InvalidArgumentError(
                f"select pattern(s) {missed or patterns!r:.80} match no key of {ck.path} (keys look like "
                f"{[k for k, _ in keyed[:3]]}); a pattern takes a whole dotted key and everything under it "
                "('model' or 'model.*': every key under 'model')"
            )
        picked = [Weight(k, n.name) for k, n in keyed if isinstance(n, tree.TensorNode) and matches(k)]
        where = f"the keys matching {patterns}"
        if not picked:
            raise InvalidArgumentError(f"{where} in {ck.path} hold no tensors, only plain values")
    if strip_prefix:
        unprefixed = [w.name for w in picked if not w.name.startswith(strip_prefix)]
        if unprefixed:
            raise InvalidArgumentError(
                f"strip_prefix {strip_prefix!r} does not start every exported name: {unprefixed[:5]} (of "
                f"{where}) do not; select only tensors under that prefix, or change it"
            )
        picked = [Weight(w.name[len(strip_prefix) :], w.stored) for w in picked]
    seen: dict[str, str] = {}
    for w in picked:
        if not w.name or seen.setdefault(w.name, w.stored) != w.stored:
            raise InvalidArgumentError(
                f"two tensors of {where} would both be exported as {w.name!r}: narrow select, or change "
                "strip_prefix so the names stay distinct"
            )
    return list(dict.fromkeys(picked))


def first_module(root: tree.Node) -> tuple[tuple[str, ...], tree.DictNode] | None:
    """The path and state of the first module in tree order (see the module docstring), or None."""
    stack: list[tuple[tree.Node, tuple[str, ...]]] = [(root, ())]
    while stack:  # depth first, in order: children pushed in reverse
        node, at = stack.pop()
        if isinstance(node, tree.StatefulNode):
            if is_module_state(node):
                assert isinstance(node.state, tree.DictNode)
                return at, node.state
            if not node.type.startswith("trainstate."):
                continue  # an optimizer, a scheduler: what it holds is not a model
            children = [(node.state, at)]
        elif isinstance(node, tree.DictNode):
            children = [(v, at + (str(k),)) for k, v in node.items()]
        elif isinstance(node, tree.SeqNode):
            children = [(v, at + (str(i),)) for i, v in enumerate(node.items)]
        else:
            continue
        stack.extend(reversed(children))
    return None


def is_module_state(node: tree.StatefulNode) -> bool:
    """Whether a stateful node looks like a module's: a flat mapping of string names to tensors."""
    state = node.state
    if node.type.startswith("trainstate.") or not isinstance(state, tree.DictNode) or not state.keys:
        return False
    tensors = 0
    for k, v in state.items():
        if not isinstance(k, str):
            return False
        if isinstance(v, tree.TensorNode):
            tensors += 1
        elif not k.endswith(EXTRA_STATE):
            return False
    return tensors > 0


def _top_keys(root: tree.Node) -> list[str]:
    while isinstance(root, tree.StatefulNode):
        root = root.state
    return [str(k) for k in root.keys][:10] if isinstance(root, tree.DictNode) else []


def _first_key_with_tensors(root: tree.Node) -> str:
    """The first top-level key with tensors under it (a Lightning checkpoint's ``state_dict``), for a hint;
    ``model`` where there is none."""
    for path, node in tree.leaves(root):
        if isinstance(node, tree.TensorNode) and path:
            return str(path[0])
    return "model"
