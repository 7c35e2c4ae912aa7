"""restore(): a checkpoint's state applied to a target in place (or, with ``ABSENT``, returned as the
checkpoint's own structure): plan every part, check, then read. ``load``, ``Checkpoint.load`` and the manager
all restore through it."""

from __future__ import annotations

from typing import Any

from trainstate import _state
from trainstate._cores import DEFAULT_THREADS
from trainstate._distributed import rank_and_world
from trainstate._format.added_keys import LOCAL_VIEW
from trainstate._frameworks import after_restore, bind
from trainstate._restore.files import Opened
from trainstate._restore.plan import _ABSENT, ABSENT, Restorer, selector, unmatched
from trainstate._restore.shared import Share
from trainstate.errors import InvalidArgumentError, StateMismatchError

__all__ = ["ABSENT", "restore"]


def restore(
    ck: Opened,
    target: Any,
    *,
    strict: bool = True,
    include: str | list[str] | None = None,
    exclude: str | list[str] | None = None,
    verify: bool = True,
    threads: int = DEFAULT_THREADS,
    framework: str | None = None,
    optional: tuple[str, ...] = (),
    share: Share | None = None,
    local_view: tuple[int, int] | None = None,
) -> Any:
    """Restore ``ck`` into ``target`` in place; returns the restored target.

    ``local_view``: (rank, world size) of a process restoring its own view, saved alone by the same rank at
    the same world size (``encode_state(local_view=...)``, a local tier's checkpoint): a sharded target's part
    is read whole from its own tensor, and per-rank values restore as in one process.

    With ``target=ABSENT`` it returns the checkpoint's own structure (arrays of ``framework``), honouring
    ``include`` / ``exclude`` the same way. With ``share`` (a collective load, every rank restoring) the parts
    several ranks hold are read by one of them (shared.py); a failure before the reads is the caller's to
    report to the other ranks (:meth:`Share.abandon`).
    """
    if local_view is None:
        _whole_state(ck)
    if verify:
        ck.verify_headers()  # a damaged safetensors header is caught here, not by the next tool
    r = Restorer(
        ck,
        strict=strict,
        selected=selector(include, exclude),
        framework=framework,
        optional=optional,
        rank=rank_and_world() if local_view is None else (0, 1),
        bound=bind(_state.stateful_objects(target)) if target is not _ABSENT else None,
        local_view=None if local_view is None else saved_view(ck, local_view),
    )
    if include is not None or exclude is not None:
        keys = r._leaves(ck.manifest.tree, ())
        for what, given in (("include", include), ("exclude", exclude)):
            patterns = [] if given is None else [given] if isinstance(given, str) else list(given)
            missed = unmatched(patterns, keys)
            if missed or (given is not None and not patterns):
                raise InvalidArgumentError(
                    f"{what} pattern(s) {missed or patterns!r:.80}: matches no key of the checkpoint (keys look like "
                    f"{keys[:3]}); a pattern takes a whole dotted key and everything under it ('model' or "
                    "'model.*': every key under 'model')"
                )
    try:
        finish = r.plan(target, ck.manifest.tree, (), free=False)
        r.check()
    except BaseException:
        r.undo()  # nothing was read: leave the target as it was
        raise
    try:
        r.read(verify=verify, threads=threads, share=share)
    except BaseException:
        if share is not None and not share.reading:
            r.undo()  # another rank failed before this one read a byte: leave the target as it was
        raise
    result = finish()
    if result is _ABSENT:  # every key excluded
        return {}
    if target is not _ABSENT:
        after_restore(result)
    return result


def saved_view(ck: Opened, expected: tuple[int, int]) -> dict[str, Any]:
    """The boxes a local view's parts hold (name -> [offset, whole shape]), once its rank and world size are
    the ones restoring it; a StateMismatchError otherwise (another rank's view, another world size)."""
    view = ck.metadata.get(LOCAL_VIEW) if isinstance(ck.metadata, dict) else None
    if not isinstance(view, dict) or not isinstance(view.get("boxes"), dict):
        raise StateMismatchError(
            [], [], [("checkpoint", "a process's own view (a local tier's checkpoint)", "a checkpoint of its own")]
        )
    saved = (view.get("rank"), view.get("world_size"))
    if saved != expected:
        raise StateMismatchError(
            [],
            [],
            [("local view", f"rank {expected[0]} of {expected[1]}", f"rank {saved[0]} of {saved[1]}")],
            hint="a local checkpoint restores only the rank that wrote it, at the same number of ranks",
        )
    boxes: dict[str, Any] = view["boxes"]
    return boxes


def _whole_state(ck: Opened) -> None:
    """Refuse one rank's own view of a sharded state (a local tier's checkpoint under a process group) where the
    whole state is asked for: its shards would pass for whole tensors."""
    view = ck.metadata.get(LOCAL_VIEW) if isinstance(ck.metadata, dict) else None
    if isinstance(view, dict) and view.get("boxes"):
        raise StateMismatchError(
            [],
            [],
            [("checkpoint", "the whole state", f"rank {view.get('rank')} of {view.get('world_size')}'s own view")],
            hint="this is a local tier's checkpoint of one rank: it holds that rank's shards as they are on it, and "
            "restores only that rank, through CheckpointManager(..., local=...).restore_latest on as many ranks; "
            "the durable tier's checkpoints hold the whole state",
        )
