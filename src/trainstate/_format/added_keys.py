"""Top-level keys a writer added to the state on its own, declared in the checkpoint (docs/format.md §6a).

A writer may store more than the caller handed it: ``CheckpointManager(capture_rng=True)`` saves the RNG
beside the user's state. The caller's own state lacks such a key, so a strict load into it would call the
key *unexpected*. Instead of every reader knowing each writer's conventions, the checkpoint says which keys
were added: ``metadata["trainstate"]["added_keys"]``. Restore treats a declared key as optional for a target
that lacks it, and restores it like any other key into a target that has it.

The compatibility rule for checkpoints written before the declaration existed lives here, and only here.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from trainstate.errors import CorruptCheckpointError, InvalidArgumentError

FACTS_KEY = "trainstate"  # the metadata key under which trainstate's writers record their facts
ADDED_KEYS = "added_keys"
# a process's own view saved alone (a local tier's checkpoint): its rank, world size and each sharded part's
# place in its whole array ({"rank": r, "world_size": w, "boxes": {name: [offset, whole shape]}})
LOCAL_VIEW = "_trainstate_local_view"

# A CheckpointManager of trainstate 0.1 recorded its facts without ADDED_KEYS and may have added the RNG it
# captured under this key, which readers then skipped by name: its checkpoints declare that key implicitly.
_LEGACY_MANAGER_KEYS = frozenset({"_rng"})


def declaration(keys: Iterable[str]) -> dict[str, list[str]]:
    """The facts entry a writer records for the keys it added (an empty list too: "I added nothing")."""
    return {ADDED_KEYS: sorted(keys)}


def declared_keys(metadata: Any) -> frozenset[str]:
    """The top-level keys a checkpoint's writer declared it added, from the checkpoint's decoded metadata.

    Raises:
        CorruptCheckpointError: the declaration is there but is not a list of key names.
    """
    facts = metadata.get(FACTS_KEY) if isinstance(metadata, dict) else None
    if not isinstance(facts, dict):
        return frozenset()  # not written by a manager, and declaring nothing
    if ADDED_KEYS not in facts:
        return _LEGACY_MANAGER_KEYS
    if not _well_formed(facts[ADDED_KEYS]):
        raise CorruptCheckpointError(
            f"metadata {FACTS_KEY}.{ADDED_KEYS} should be a list of top-level key names, found "
            f"{facts[ADDED_KEYS]!r:.80}; the checkpoint was damaged or written by another tool: restore another one"
        )
    return frozenset(facts[ADDED_KEYS])


def check_declaration(metadata: Any) -> None:
    """Refuse, at save time, metadata whose declaration a reader would refuse (a state that saves must load).

    Raises:
        InvalidArgumentError: ``metadata["trainstate"]["added_keys"]`` is there but not a list of key names.
    """
    facts = metadata.get(FACTS_KEY) if isinstance(metadata, dict) else None
    if isinstance(facts, dict) and ADDED_KEYS in facts and not _well_formed(facts[ADDED_KEYS]):
        raise InvalidArgumentError(
            f"metadata[{FACTS_KEY!r}][{ADDED_KEYS!r}] declares the top-level keys of the state its writer added, "
            f"as a list of key names (docs/format.md §6a); got {facts[ADDED_KEYS]!r:.80}"
        )


def _well_formed(keys: Any) -> bool:
    return isinstance(keys, list) and all(isinstance(k, str) for k in keys)


def saved_step(metadata: Any) -> int:
    """The step a manager recorded among its facts (``metadata["trainstate"]["step"]``), else 0."""
    facts = metadata.get(FACTS_KEY) if isinstance(metadata, dict) else None
    step = facts.get("step") if isinstance(facts, dict) else None
    return step if type(step) is int else 0
