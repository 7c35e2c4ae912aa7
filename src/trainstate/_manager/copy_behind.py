"""Copying behind training: a local tier's save copies what the optimizers change only in their step while
training goes on, not before ``save()`` returns.

After ``optimizer.step()`` and ``save()``, the parameters and the optimizer's state do not change until the next
``optimizer.step()``: the forward and backward passes in between read them and write gradients. So the copy of
those arrays into the staging buffer can run beside them, on a background thread, if the next step waits for it:
each optimizer of the state gets a step-pre hook that waits for the copy in flight. ``save()`` then blocks only
for the rest (buffers, generators, plain values). A parameter changed in place meanwhile by anything else bumps
its version counter, and the save is dropped with an error rather than written torn (staging.py). A change the
counter does not see (through ``.data``) is not caught: hence an option, off by default (``LocalTier(
copy_behind=True)``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trainstate import _frameworks as frameworks
from trainstate import _state
from trainstate._manager.async_writer import AsyncWriter


class CopyBehind:
    """A manager's step-pre hooks on the state's optimizers, and the picker of what to copy behind training."""

    def __init__(self, writer: AsyncWriter) -> None:
        self._writer = writer
        self._hooks: dict[int, tuple[Any, Any]] = {}  # id(optimizer) -> (optimizer, hook handle)

    def picker(self, state: Any) -> Callable[[Any], bool] | None:
        """What to copy behind training for a save of ``state`` (its optimizers' parameters and state), with a
        hook on each optimizer that waits for the copy; None when the state has no optimizer."""
        addresses, optimizers = frameworks.step_guarded(_state.stateful_objects(state))
        if not addresses:
            return None
        for optim in optimizers:
            if id(optim) not in self._hooks:
                self._hooks[id(optim)] = (optim, optim.register_step_pre_hook(self._before_step))
        return lambda value: frameworks.storage_address(value) in addresses

    def _before_step(self, *args: Any) -> None:
        self._writer.wait_copy()

    def close(self) -> None:
        """Remove the hooks (the optimizers outlive the manager)."""
        hooks, self._hooks = self._hooks, {}
        for _, handle in hooks.values():
            handle.remove()
