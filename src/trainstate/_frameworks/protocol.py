"""What trainstate asks of an array framework (:class:`Adapter`, one module per framework) and of a stateful
object keyed through others (:class:`Bound`: a torch optimizer). The table of frameworks is in
``_frameworks/__init__.py``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from trainstate.errors import UnsupportedValueError


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

    def cuttable(self, value: Any) -> bool:
        """Whether host bytes may be copied into a byte range of accelerator array ``value`` (it is
        contiguous), so that a large one can be filled in parts through small host buffers."""

    def copy_in_async(self, pairs: list[tuple[Any, int | None, np.ndarray]]) -> Callable[[], list[Any]]:
        """Queue copies of flat host byte arrays into live accelerator arrays: each ``(target, offset, host)``
        fills the target's bytes from ``offset`` (a :meth:`cuttable` target), or the whole target (``offset``
        None). Returns a function that waits until all have landed (until then ``host`` must not change) and
        returns what each target now is: itself, filled in place, or a new array where arrays are immutable
        (JAX). A target that cannot hold its bytes is refused with :class:`RefusedPair`, so the caller can
        name it."""

    def copy_out(self, pairs: list[tuple[Any, np.ndarray]]) -> None:
        """Copy each array's bytes (C order) into its flat host byte array (of :meth:`staging` memory for
        accelerator arrays, so the copies overlap); returns once all have landed."""

    def copy_range_out(self, value: Any, offset: int, host: np.ndarray) -> None:
        """Copy bytes ``[offset, offset + host.nbytes)`` of a :meth:`cuttable` array (C order) into the flat
        host byte array ``host``; returns once they have landed."""

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


class RefusedPair(UnsupportedValueError):
    """:meth:`Adapter.copy_in_async` refusing its pair number ``index`` (JAX without 64-bit mode, values that do
    not fit 32 bits): the adapter does not know the tensor's name, its caller does and adds it."""

    def __init__(self, message: str, index: int) -> None:
        super().__init__(message)
        self.index = index
