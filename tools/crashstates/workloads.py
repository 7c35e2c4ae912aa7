"""The recorded paths: each a small piece of trainstate work on a directory, with the oracle that judges every
crash state of it.

Each workload runs under a :class:`~.record.Recorder` and marks what a caller has been told: ``saving N`` before
the save of step N starts, ``committed N`` once it is known committed (a synchronous save returned; an async
one was waited for), ``pinned N`` once ``pin`` returned and ``unpinning N`` before ``unpin`` starts. Its oracle gets a directory
in one of the crash states, with the marks made before the crash, and raises AssertionError (or any error) when
trainstate misbehaves there:

* ``restore_latest`` returns a checkpoint that was saved, no older than the newest one committed before the
  crash, and restores exactly what that save held (into a target holding other values);
* the manager's start deleted neither that checkpoint nor one whose pin returned;
* a new manager then saves, and afterwards every checkpoint its retention keeps is still there (the newest
  ``keep_last - 1`` of those listed before, or all of them without ``keep_last``, and every pinned one, still
  pinned), and every checkpoint it lists verifies (``Checkpoint.verify``: every byte against its checksum);
* its history reads.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import trainstate
from trainstate._format.manifest import MANIFEST_NAME

from ..reliability.common import check_numpy_state, numpy_state

SIZE = 1 << 10  # a small state: the paths, not the bytes, make the crash states
KEY = "5a" * 32


class Marks(Protocol):
    """What a workload tells the recorder (a local :class:`~.record.Recorder`, or an object store's log)."""

    def mark(self, label: str) -> None: ...


@dataclass(frozen=True)
class Place:
    """Where a workload works: a local directory, or (``storage``) an object store's bucket."""

    root: Path
    storage: Any = None  # a trainstate.FsspecStorage over a recorded object store; None: local files

    def at(self, name: str) -> Any:
        return self.root / name if self.storage is None else f"bucket/{name}"


@dataclass(frozen=True)
class Workload:
    name: str
    run: Callable[[Place, Marks, Workload], None]
    settings: dict[str, Any]  # the manager's keywords, for the work and for the oracle
    frozen: bool = False  # the state has a frozen tensor (an incremental run shares it)
    local: bool = False  # a local tier under ROOT/local
    local_fsync: bool = False  # ... flushing its checkpoints: they count as committed against a machine's crash
    judge: str = "manager"  # which oracle: "manager" (a run directory), or "overwrite" (one path saved over)
    objects: bool = False  # on an object store (tools/crashstates/objects.py) instead of a local disk
    ranks: int = 1  # run by that many ranks together (tools/crashstates/collective.py)


def _state(step: int, w: Workload) -> dict[str, Any]:
    return numpy_state(step, size=SIZE, frozen=w.frozen)


def _target(w: Workload) -> dict[str, Any]:
    """What a restore goes into: values no save held (a restore that writes nothing cannot pass as one)."""
    state = _state(-5, w)
    if w.frozen:
        state["base"] = state["base"] * 0
    return state


def _steps(seen: list[str], kind: str) -> list[int]:
    return [int(label.split()[1]) for label in seen if label.split()[0] == kind]


def _pinned(seen: list[str]) -> set[int]:
    """The steps whose pin returned, and no unpin of which started since."""
    last: dict[int, str] = {}
    for label in seen:
        kind, step = label.split()[:2]
        if kind in ("pinned", "unpinning"):
            last[int(step)] = kind
    return {step for step, kind in last.items() if kind == "pinned"}


def _rank() -> int:
    dist = sys.modules.get("torch.distributed")
    return int(dist.get_rank()) if dist is not None and dist.is_initialized() else 0


def _manager(place: Place, w: Workload) -> trainstate.CheckpointManager:
    tier = None
    if w.local and w.ranks == 1:
        tier = trainstate.LocalTier(place.root / "local", every_steps=1, fsync=w.local_fsync)
    elif w.local:  # each rank a node of its own (tools/crashstates/collective.py), its copies on the other
        tier = trainstate.LocalTier(place.root / f"node{_rank()}", every_steps=1, replicas=1, fsync=w.local_fsync)
    return trainstate.CheckpointManager(place.at("run"), storage=place.storage, local=tier, **w.settings)


def saves(steps: list[int], wait_every: int = 1, force: bool = True) -> Callable[[Place, Marks, Workload], None]:
    """Save each of ``steps`` (``force``: whatever the policy says), waiting for the saves in flight and marking
    them committed every ``wait_every`` saves."""

    def run(place: Place, recorder: Marks, w: Workload) -> None:
        with _manager(place, w) as mgr:
            durable = w.settings.get("every_steps", 1)
            for n, step in enumerate(steps, 1):
                recorder.mark(f"saving {step}")
                mgr.save(step, _state(step, w), force=force)
                if n % wait_every == 0:
                    mgr.wait()
                    # a local checkpoint not flushed survives the process, not the machine: the model's crash
                    if force or step % durable == 0 or w.local_fsync:
                        recorder.mark(f"committed {step}")
                    else:
                        recorder.mark(f"saved {step}")

    return run


def _pins(place: Place, recorder: Marks, w: Workload) -> None:
    with _manager(place, w) as mgr:
        for step in range(4):
            recorder.mark(f"saving {step}")
            mgr.save(step, _state(step, w), force=True)
            recorder.mark(f"committed {step}")
            if step == 1:
                mgr.pin(1, "kept")
                recorder.mark("pinned 1")
            if step == 2:
                recorder.mark("unpinning 1")  # from here the pin may be gone
                mgr.unpin(1)


def _overwrites(place: Place, recorder: Marks, w: Workload) -> None:
    """``trainstate.save(path, overwrite=True)`` three times over one path (the old one replaced atomically)."""
    for step in range(3):
        recorder.mark(f"saving {step}")
        trainstate.save(place.at("latest"), _state(step, w), overwrite=True, storage=place.storage)
        recorder.mark(f"committed {step}")


def _judge_overwrite(place: Place, w: Workload, committed: list[int], saved: set[int]) -> None:
    """The path holds a whole checkpoint of a step saved, no older than the last save that returned (or
    nothing, before the first returned); ``verify`` agrees."""
    floor = max(committed) if committed else None
    try:
        state = trainstate.load(place.at("latest"), storage=place.storage)
    except (trainstate.CheckpointNotFoundError, trainstate.IncompleteCheckpointError):
        # nothing committed there (an object store shows the first save's data files before its manifest)
        assert floor is None, f"nothing at the path, though the save of step {floor} returned"
        return
    step = int(state["step"])
    assert step in saved and (floor is None or step >= floor), f"holds step {step}; committed: {floor}"
    check_numpy_state(state, step)
    with trainstate.open(place.at("latest"), storage=place.storage) as ck:
        ck.verify()


def _committed_at(place: Place, name: str) -> bool:
    """Whether a committed checkpoint is at ``name``: its directory, or (object stores) its manifest object."""
    if place.storage is None:
        return bool(place.at(name).is_dir())
    return place.storage.stat(f"{place.at(name)}/{MANIFEST_NAME}") is not None


def oracle(place: Place, w: Workload, seen: list[str], saved: set[int]) -> None:
    """Judge one crash state of ``w``, given the marks made before the crash (see the module docstring)."""
    committed = _steps(seen, "committed")
    if w.judge == "overwrite":
        _judge_overwrite(place, w, committed, saved)
        return
    floor = max(committed) if committed else None
    pins = _pinned(seen)
    state = _target(w)
    with _manager(place, w) as mgr:
        got = mgr.restore_latest(state)
        if floor is not None:
            assert got is not None, f"nothing restored, though step {floor} was committed"
            assert got - 1 >= floor, f"restored step {got - 1}, older than step {floor}, committed before"
        if got is not None:
            assert got - 1 in saved, f"restored step {got - 1}, which was never saved"
            check_numpy_state(state, got - 1)
            assert w.local or _committed_at(place, f"run/step_{got - 1:08d}"), (
                "the manager's start deleted the checkpoint it then restored"
            )
        listed = sorted(info.step for info in mgr.list())
        assert pins <= set(listed), f"pinned step(s) {sorted(pins - set(listed))} gone, though the pin returned"
        mgr.save(99, _state(99, w), force=True)  # a new manager starts and saves
    keep = w.settings.get("keep_last")
    kept = set(listed if keep is None else listed[len(listed) - keep + 1 :] if keep > 1 else []) | pins
    after = _target(w)
    with _manager(place, w) as mgr:
        assert mgr.restore_latest(after) == 100, "the new manager's save is not the newest"
        check_numpy_state(after, 99)
        infos = {info.step: info for info in mgr.list()}
        assert pins <= set(infos), f"pinned step(s) {sorted(pins - set(infos))} deleted: a pin that returned was lost"
        assert kept <= set(infos), f"after the new save, step(s) {sorted(kept - set(infos))} its policy keeps are gone"
        assert all(infos[step].pinned for step in pins), "a pin that returned was lost"
        for info in infos.values():  # every checkpoint listed verifies, byte for byte
            with trainstate.open(mgr.path_for(info.step), key=w.settings.get("key"), storage=place.storage) as ck:
                ck.verify()
        mgr.history()


ON_DISK = [
    Workload("save(path, overwrite=True), three times", _overwrites, {}, judge="overwrite"),
    Workload("sync saves, retention (keep_last=2)", saves([0, 1, 2, 3]), {"keep_last": 2}),
    Workload("async saves, waited for every other one", saves([0, 1, 2, 3], 2), {"async_save": True}),
    Workload("pins: pin, retention past it, unpin", _pins, {"keep_last": 1}),
    Workload(
        "incremental saves and the pool's collection",
        saves([0, 1, 2, 3]),
        {"incremental": True, "keep_last": 1},
        frozen=True,
    ),
    Workload("zstd + encryption", saves([0, 1, 2]), {"compression": "zstd", "key": KEY, "keep_last": 2}),
    Workload(
        "local tier every step (not flushed) behind durable saves",
        saves([0, 1, 2, 3, 4], force=False),
        {"every_steps": 3},
        local=True,
    ),
    Workload(
        "local tier every step (fsync=True) behind durable saves",
        saves([0, 1, 2, 3, 4], force=False),
        {"every_steps": 3},
        local=True,
        local_fsync=True,
    ),
]

# The same paths on an object store (tools/crashstates/objects.py); the local tier is a local disk's.
ON_STORE = [
    Workload(f"object store: {w.name}", w.run, w.settings, frozen=w.frozen, judge=w.judge, objects=True)
    for w in ON_DISK
    if not w.local
]

WORKLOADS = ON_DISK + ON_STORE
