"""Framework adapters: all that the save and restore core (``_state``, ``_save``, ``_restore``, ``_manager``)
knows of torch and JAX, found through one table (:data:`FRAMEWORKS`). Other modules import torch for torch's
own concerns only: its file formats (``_convert``: torch.save, DCP, ONNX), its process groups
(``_distributed``), its data loaders (``_data``, ``_replay``, ``_seeding``) and the integrations.

An adapter knows, for its array type, how to describe a value (dtype code, shape), expose its bytes for
writing, make an empty array to read into, and expose a live array's memory for in-place reads. It also
answers the few questions restore asks about a framework's stateful objects (does ``load_state_dict`` take
``strict=``; is an object's state rebuilt from the checkpoint alone), so the restore core names no
framework class. Each adapter is a module that implements :class:`Adapter`; mypy checks that where the
modules are handed out below.

Dispatch looks at ``sys.modules`` first, so a framework that was never imported is never imported here: a
value or object of a framework the process has not imported cannot exist.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from trainstate._frameworks import jax_tree
from trainstate._frameworks import numpy as numpy_adapter
from trainstate._frameworks.protocol import Adapter as Adapter  # re-exported: the protocol is the package's
from trainstate._frameworks.protocol import Bound as Bound
from trainstate._frameworks.protocol import RefusedPair as RefusedPair
from trainstate.errors import InvalidArgumentError

NUMPY: Adapter = numpy_adapter

if TYPE_CHECKING:  # mypy checks every adapter module against the protocol
    from trainstate._frameworks import jax as _jax_adapter
    from trainstate._frameworks import torch as _torch_adapter

    _CHECKED: tuple[Adapter, ...] = (numpy_adapter, _torch_adapter, _jax_adapter)


class Framework(NamedTuple):
    """One row of :data:`FRAMEWORKS`: a framework trainstate stores arrays of."""

    name: str  # what ``framework=`` and a manifest's tensor ``kind`` call it
    module: str  # its import name: the adapter is consulted only once ``sys.modules`` holds it
    types: tuple[str, ...]  # the modules its array types are defined in (``type(value).__module__``)
    adapter: str  # trainstate's module implementing :class:`Adapter` for it


# The one table of frameworks: adapter lookup, the names ``framework=`` accepts, and every question the
# save, the restore and the async staging copy ask of an array go through it. A new framework is one
# adapter module and one row here.
FRAMEWORKS: tuple[Framework, ...] = (
    Framework("numpy", "numpy", ("numpy",), "trainstate._frameworks.numpy"),
    Framework("torch", "torch", ("torch",), "trainstate._frameworks.torch"),
    Framework("jax", "jax", ("jax", "jaxlib"), "trainstate._frameworks.jax"),
)
NAMES = tuple(f.name for f in FRAMEWORKS)


_imported: dict[str, Adapter] = {}


def _adapter(row: Framework) -> Adapter:
    module = _imported.get(row.adapter)
    if module is None:  # imported once: the restore asks for every array
        module = _imported[row.adapter] = importlib.import_module(row.adapter)
    return module


def _torch() -> Adapter:
    return _adapter(FRAMEWORKS[1])


def _jax() -> Adapter:
    return _adapter(FRAMEWORKS[2])


def _loaded() -> list[Adapter]:
    """The adapters of the frameworks this process has imported."""
    return [_adapter(row) for row in FRAMEWORKS if row.module in sys.modules]


def adapter_for(value: Any) -> Adapter | None:
    """The adapter for an array value, or None if ``value`` is not an array we store."""
    if NUMPY.is_array(value):
        return NUMPY
    home = type(value).__module__
    for row in FRAMEWORKS[1:]:
        if row.module in sys.modules and home.startswith(row.types):
            adapter = _adapter(row)
            if adapter.is_array(value):
                return adapter
    return None


def adapter_named(kind: str) -> Adapter:
    """The adapter for a manifest ``kind`` or a ``framework=`` argument (NumPy for any other name)."""
    row = next((f for f in FRAMEWORKS if f.name == kind), FRAMEWORKS[0])
    return _adapter(row)


def framework(value: Any) -> str:
    """The array type a reader returns (``framework=``): the name of a row of :data:`FRAMEWORKS`."""
    if value not in NAMES:
        names = ", ".join(repr(n) for n in NAMES)
        raise InvalidArgumentError(f"framework must be one of {names}, got {value!r:.40}")
    return str(value)


def pytree(value: Any) -> tuple[jax_tree.Children, Callable[[list[Any]], Any]] | None:
    """A JAX pytree node's children by key and how to rebuild it (``jax_tree.node``); None for anything else,
    and always where the process has not imported JAX."""
    return jax_tree.node(value) if "jax" in sys.modules else None


def replaced_on_restore(value: Any) -> bool:
    """Whether restoring into ``value`` makes a new value instead of filling it: a JAX array or a JAX pytree
    node (a TrainState, a FrozenDict) is immutable. A caller that cannot hand the new value back refuses it."""
    if "jax" not in sys.modules or isinstance(value, (dict, list, tuple)) or stateful_view(value) is not None:
        return False
    return _jax().is_array(value) or jax_tree.node(value) is not None


WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # what DDP / DataParallel and torch.compile add to a model's names


def stateful_view(obj: Any) -> Any | None:
    """An object with ``state_dict()`` / ``load_state_dict()`` standing for a framework object that has none
    (a Flax NNX module or optimizer: ``jax_tree.NnxObject``), or None."""
    return jax_tree.nnx_object(obj) if "jax" in sys.modules else None


def type_label(obj: Any) -> str:
    """The class a stateful object is recorded as (never imported): the framework object's, not its view's."""
    cls = type(obj.obj if isinstance(obj, jax_tree.NnxObject) else obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def unwrapped(obj: Any) -> Any:
    """The module a wrapper holds (DDP's and DataParallel's ``.module``, ``torch.compile``'s
    ``._orig_mod``), else ``obj``: a wrapped model is saved and restored as the model itself, so its names
    carry no ``module.`` prefix -- as the optimizer's names, from torch's own helpers, never do -- and a
    checkpoint of a DDP run loads into the bare model. A Flax NNX object comes back as its
    :func:`stateful_view`."""
    if "torch" not in sys.modules or not type(obj).__module__.startswith("torch"):
        return stateful_view(obj) or obj
    from trainstate._frameworks import torch as torch_adapter

    return torch_adapter.unwrap(obj)


def load_takes_strict(obj: Any) -> bool:
    """See :meth:`Adapter.load_takes_strict`; False for objects of no framework."""
    return any(a.load_takes_strict(obj) for a in _loaded())


def ignored_on_load(obj: Any) -> tuple[list[str], list[str]]:
    """The name patterns (regexes) a strict load into ``obj`` lets the checkpoint lack and hold beyond the
    object's own: what ``from_pretrained`` ignores for a transformers model (``torch.ignored_on_load``)."""
    if "torch" not in sys.modules or not load_takes_strict(obj):
        return [], []
    from trainstate._frameworks import torch as torch_adapter

    return torch_adapter.ignored_on_load(obj)


def rebuilt_from_checkpoint(obj: Any) -> bool:
    """See :meth:`Adapter.rebuilt_from_checkpoint`; False for objects of no framework."""
    return any(a.rebuilt_from_checkpoint(obj) for a in _loaded())


def bind(objects: Sequence[tuple[tuple[str, ...], Any]]) -> dict[int, Bound]:
    """The objects among ``objects`` (stateful objects of one state, with their paths) whose state is keyed
    through others of them, by ``id``: a torch optimizer whose parameters all belong to modules in the state."""
    if "torch" not in sys.modules:
        return {}
    from trainstate._frameworks import torch_optim

    return torch_optim.bind(objects)


def after_restore(restored: Any) -> None:
    """Let every imported framework finish a restore (torch: arm the exact-resume hook of data loaders)."""
    for a in _loaded():
        a.after_restore(restored)


def step_guarded(objects: Sequence[tuple[tuple[str, ...], Any]]) -> tuple[set[int], list[Any]]:
    """The storage addresses of the arrays that optimizers among ``objects`` change only in their step, and
    those optimizers (each with ``register_step_pre_hook``); nothing for a framework not imported."""
    if "torch" not in sys.modules:
        return set(), []
    from trainstate._frameworks import torch_optim

    addresses, optimizers = torch_optim.step_guarded(objects)
    return addresses, list(optimizers)


def storage_address(value: Any) -> int | None:
    """An array's storage address where :func:`step_guarded` can list it, else None."""
    if "torch" not in sys.modules:
        return None
    from trainstate._frameworks import torch_optim

    return torch_optim.storage_address(value)
