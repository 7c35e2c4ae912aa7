"""Which tensors of a training checkpoint are the model's, and under which names the model knows them.

A training state holds a model, an optimizer, RNG and loop counters; an inference model wants only the
model's weights, named as its own ``state_dict()`` names them (``encoder.layer.0...``, not
``model.encoder.layer.0...``). The rule lives here, once, for every converter:

* by default, the first module in the saved state: the first stateful object (depth first, in saved
  order) whose state is a flat mapping of names to tensors, i.e. a ``torch.nn.Module``'s
  ``state_dict()``; an optimizer's nested ``state`` / ``param_groups`` never matches. Its prefix
  (``model.``) is stripped;
* ``select``: glob patterns over the checkpoint's dotted keys (``"model.*"``, the same patterns as
  ``load(include=...)``), with ``strip_prefix`` removed from every selected key.
"""

from __future__ import annotations

from trainstate import _tree as tree
from trainstate._restore.checkpoint import Checkpoint
from trainstate._restore.plan import selector
from trainstate.errors import InvalidArgumentError


def first_module(root: tree.Node) -> tuple[str, ...] | None:
    """The path of the first stateful node whose state is a non-empty flat mapping of tensors."""
    stack: list[tuple[tree.Node, tuple[str, ...]]] = [(root, ())]
    while stack:  # depth first, in saved order (children pushed in reverse)
        node, path = stack.pop()
        if isinstance(node, tree.StatefulNode):
            state = node.state
            if isinstance(state, tree.DictNode) and state.values:
                if all(isinstance(v, tree.TensorNode) for v in state.values):
                    return path
            stack.append((state, path))
        elif isinstance(node, tree.DictNode):
            stack.extend(reversed([(v, path + (str(k),)) for k, v in node.items()]))
        elif isinstance(node, tree.SeqNode):
            stack.extend(reversed([(v, path + (str(i),)) for i, v in enumerate(node.items)]))
    return None


def model_weights(
    ck: Checkpoint, *, select: str | list[str] | None = None, strip_prefix: str | None = None
) -> dict[str, str]:
    """Map each model-side name to the checkpoint tensor that holds it, in saved order.

    Raises:
        InvalidArgumentError: no module found (and no ``select``), ``select`` matches no tensor, or a
            selected key does not start with ``strip_prefix``.
    """
    if select is None:
        path = first_module(ck.manifest.tree)
        if path is None:
            raise InvalidArgumentError(
                f"{ck.path} holds no module (a stateful object whose state is a flat mapping of tensors, like a "
                "torch.nn.Module's state_dict): pass select= (e.g. select='model.*', strip_prefix='model.') to "
                "name the tensors to use"
            )
        prefix = tree.join(path) + "." if path else ""
        patterns: str | list[str] = prefix + "*"
        strip = prefix if strip_prefix is None else strip_prefix
    else:
        patterns, strip = select, strip_prefix or ""
    chosen = selector(patterns, None)
    found = [
        (tree.join(p), n.name)
        for p, n in tree.leaves(ck.manifest.tree)
        if isinstance(n, tree.TensorNode) and (chosen is None or chosen(tree.join(p)))
    ]
    if not found:
        raise InvalidArgumentError(
            f"select={patterns!r:.80} matches no tensor of {ck.path} (keys look like {ck.keys()[:3]}); "
            "patterns match whole dotted keys: 'model.*' selects everything under 'model'"
        )
    outside = [key for key, _ in found if not key.startswith(strip)]
    if outside:
        raise InvalidArgumentError(
            f"strip_prefix={strip!r:.60} is not a prefix of every selected key, e.g. {outside[0]!r:.80}: "
            "select only keys under that prefix, or pass the prefix they share"
        )
    return {key[len(strip) :]: name for key, name in found}
