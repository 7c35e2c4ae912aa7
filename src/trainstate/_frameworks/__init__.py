"""Framework adapters: the only modules that import torch or jax, and all that trainstate knows of them.

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

import sys
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from trainstate._frameworks import jax_tree
from trainstate._frameworks import numpy as numpy_adapter


class Adapter(Protocol):
    """What trainstate asks of one array framework. ``numpy.py`` and ``torch.py`` implement it as modules."""

    def is_array(self, value: Any) -> bool:
        """Whether ``value`` is an array (or array scalar) of this framework."""

    def has_values(self, value: Any) -> bool:
        """False for a value that stands for an array without holding one (``jax.ShapeDtypeStruct``): a
        restore target, never saved."""

    def describe(self, value: Any) -> tuple[str, tuple[int, ...], str]:
        """(dtype code, shape, kind) of an array; raises UnsupportedValueError for one that cannot be stored."""

    def identity(self, value: Any) -> tuple[object, ...] | None:
        """A key equal for two arrays that are the same view of the same memory (tied weights), or None."""

    def local_part(self, value: Any) -> tuple[Any, tuple[int, ...]] | None:
        """For an array sharded over ranks (a DTensor): this rank's part (a plain array) and its offset in
        the whole; None for an array this process holds whole."""

    def byte_view(self, value: Any) -> memoryview:
        """The array's bytes, C order, little-endian; copies only when the layout requires it."""

    def empty(self, code: str, shape: tuple[int, ...]) -> Any:
        """A new host array to read into."""

    def writable_view(self, target: Any) -> memoryview | None:
        """The memory of a live array to read straight into, or None when its layout does not allow it."""

    def on_accelerator(self, value: Any) -> bool:
        """Whether ``value`` lives in accelerator memory: reads reach it through host staging."""

    def staging(self, nbytes: int, like: Any) -> np.ndarray:
        """``nbytes`` of host memory (uint8) to stage reads for accelerator arrays like ``like``: page-locked
        where the framework can make it, since copies from it run several times faster."""

    def copy_in(self, pairs: list[tuple[Any, np.ndarray]]) -> None:
        """Copy each flat host byte array into its live accelerator array; returns once all have landed."""

    def finish(self, array: Any, kind: str) -> Any:
        """A freshly read host array turned into what the saver held (``kind`` from the manifest)."""

    def assign(self, target: Any, source: Any) -> Any:
        """Copy a host array into a live array (keeping its device); returns what the state now holds."""

    def from_numpy(self, array: np.ndarray) -> Any:
        """An array of this framework holding ``array``'s values (sharing its memory where it can)."""

    def load_takes_strict(self, obj: Any) -> bool:
        """Whether ``obj.load_state_dict`` takes ``strict=`` and its own state_dict's keys are the truth
        (torch's ``nn.Module``), rather than the checkpoint's (an optimizer growing its moments)."""

    def rebuilt_from_checkpoint(self, obj: Any) -> bool:
        """Whether ``obj``'s state must come from the checkpoint alone: calling its ``state_dict()`` has
        side effects (a DataLoader starts an iterator: worker processes, a draw from the global RNG)."""

    def after_restore(self, restored: Any) -> None:
        """Called with the whole restored state, once everything is in place."""


class Bound(Protocol):
    """A stateful object whose state is keyed through other objects of the same state: a torch optimizer,
    keyed by the names its parameters have in the modules that own them (``torch_optim.py``).

    Saving asks it for :meth:`state_dict` instead of the object. Restoring asks :meth:`restore_target` for
    the live state to plan against, then calls :meth:`load_state_dict` with the restored one, or
    :meth:`undo` when the restore stops before reading (so a failed restore changes nothing).
    """

    def state_dict(self) -> Any:
        """The state to save."""

    def restore_target(self, saved: Any, skip: object) -> tuple[Any, list[str], list[str]]:
        """The live state to restore the saved state (a tree node) into, and the names the object has that
        the checkpoint lacks (missing) and the checkpoint has that the object lacks (unexpected). Saved parts
        the object has no place for are given ``skip`` in the returned state: the restore leaves them unread."""

    def load_state_dict(self, state: Any, strict: bool) -> None:
        """Set the restored state."""

    def undo(self) -> None:
        """Take back what :meth:`restore_target` changed in the object."""


NUMPY: Adapter = numpy_adapter


def _torch() -> Adapter:
    from trainstate._frameworks import torch as torch_adapter

    return torch_adapter


def _jax() -> Adapter:
    from trainstate._frameworks import jax as jax_adapter

    return jax_adapter


def _loaded() -> list[Adapter]:
    """The adapters of the frameworks this process has imported."""
    loaded = [NUMPY]
    if "torch" in sys.modules:
        loaded.append(_torch())
    if "jax" in sys.modules:
        loaded.append(_jax())
    return loaded


def adapter_for(value: Any) -> Adapter | None:
    """The adapter for an array value, or None if ``value`` is not an array we store."""
    if NUMPY.is_array(value):
        return NUMPY
    if "torch" in sys.modules and type(value).__module__.startswith("torch"):
        torch_adapter = _torch()
        if torch_adapter.is_array(value):
            return torch_adapter
    if "jax" in sys.modules and type(value).__module__.startswith(("jax", "jaxlib")):
        jax_adapter = _jax()
        if jax_adapter.is_array(value):
            return jax_adapter
    return None


def adapter_named(kind: str) -> Adapter:
    """The adapter for a manifest ``kind`` or a ``framework=`` argument (``"torch"``, ``"jax"``, else NumPy)."""
    if kind == "torch":
        return _torch()
    return _jax() if kind == "jax" else NUMPY


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
