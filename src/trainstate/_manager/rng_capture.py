"""The manager's RNG capture: a resumed run draws the same random numbers without the user asking.

With ``capture_rng=True`` a dict state that holds no :class:`RNGState` is saved with one beside it, under
the key ``"_rng"``, and restored from it. The checkpoint declares that key as one its writer added
(docs/format.md §6a), so ``trainstate.load(path, state)`` into the user's own state, which lacks it, is not
told about an unexpected key: the restore core knows nothing of this convention.
"""

from __future__ import annotations

from typing import Any

from trainstate._rng import RNGState
from trainstate.errors import InvalidArgumentError

RNG_KEY = "_rng"


class RNGCapture:
    """Adds the process's RNG to the states a manager saves and restores, when the state has none."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._rng = RNGState()

    def wrap(self, state: Any) -> tuple[Any, tuple[str, ...]]:
        """The state to save or restore instead of ``state``, and the top-level keys added to it.

        ``state`` itself is returned, with no key added, when capture is off, when it is not a dict, or when
        it already holds an RNGState.

        Raises:
            InvalidArgumentError: the state has a key ``"_rng"`` of its own.
        """
        if not self.enabled or not isinstance(state, dict) or any(isinstance(v, RNGState) for v in state.values()):
            return state, ()
        if RNG_KEY in state:
            raise InvalidArgumentError(
                f"the state has a key {RNG_KEY!r}, where CheckpointManager(capture_rng=True) keeps the RNG it "
                f"captures; rename your key, put a trainstate.RNGState() in the state, or pass capture_rng=False"
            )
        return {**state, RNG_KEY: self._rng}, (RNG_KEY,)

    @staticmethod
    def unwrap(wrapped: Any, state: Any) -> None:
        """After a restore into ``wrapped``: give ``state`` the values restore put into the wrapper (plain
        values are replaced in their container, which was the wrapper)."""
        if wrapped is not state:
            state.update((k, v) for k, v in wrapped.items() if k != RNG_KEY)
