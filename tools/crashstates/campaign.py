"""Run each workload under the recorder, generate every crash state of its recording, judge each with the oracle."""

from __future__ import annotations

import logging
import random
import shutil
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trainstate

from . import collective, objects
from .record import Image, Op, Recorder, snapshot
from .states import crash_states, digest, materialize, replayed
from .workloads import WORKLOADS, Place, Workload, oracle

EVERY = WORKLOADS + collective.COLLECTIVE


@dataclass
class Result:
    workload: str
    operations: int = 0
    states: int = 0  # distinct crash states generated
    checked: int = 0
    failures: list[str] = field(default_factory=list)


@dataclass
class Recording:
    """A workload's recorded run: its operations (requests, on an object store), the steps it saved, its crash
    states as (where it crashed, how the state was made, the marks made before, the state), and how to lay a
    state out for the oracle."""

    operations: int
    saved: set[int]
    states: list[tuple[str, str, list[int], Any]]
    lay_out: Callable[[Any], Place]
    judge: Callable[[Place, Workload, list[int], set[int]], None] = oracle
    close: Callable[[], None] = lambda: None


def _seen(marks: list[tuple[int, str]], point: int) -> list[str]:
    """The marks made before a crash at ``point`` (one at the point itself counts: nothing ran between)."""
    return [label for at, label in marks if at <= point]


def _saved(marks: list[tuple[int, str]]) -> set[int]:
    return {int(label.split()[1]) for _, label in marks if label.startswith("saving")}


def complete(before: Image, ops: list[Op], root: Path) -> None:
    """Stop unless the recording, replayed, gives the tree the work left: a mutation the recorder did not see
    would make every crash state one of a history that did not happen."""
    got, want = replayed(before, ops), snapshot(root)
    if digest(got) != digest(want):
        differ = sorted(
            {p for p in {*got.files, *want.files} if got.files.get(p) != want.files.get(p)} | (got.dirs ^ want.dirs)
        )
        raise RuntimeError(f"the recording misses mutations the work made under {root}: {differ[:10]}")


def _in_directory(root: Path) -> Callable[[Any], Place]:
    """Each state laid out where the recording ran (a local tier names its run's path)."""

    def lay_out(image: Any) -> Place:
        shutil.rmtree(root)
        root.mkdir()
        materialize(image, root)
        return Place(root)

    return lay_out


def _on_disk(w: Workload, work: Path) -> Recording:
    root = work / "recorded"
    root.mkdir()
    recorder = Recorder(root)
    with recorder:
        w.run(Place(root), recorder, w)
    complete(recorder.before, recorder.ops, root)
    states = [
        (f"after op {k}", how, _seen(recorder.marks, k), image)
        for k, how, image in crash_states(recorder.before, recorder.ops)
    ]
    return Recording(len(recorder.ops), _saved(recorder.marks), states, _in_directory(root))


def _on_store(w: Workload, work: Path) -> Recording:
    log = objects.Log()
    # parts of 1 KiB: the checkpoints' data files go up as multipart uploads (create, parts, complete); each
    # request takes 2 ms, so the uploads of one save are in flight together
    store = objects.ObjectStore(log=log, latency=0.002)
    storage = trainstate.FsspecStorage(store, part_size=1 << 10)
    storage.target_file_bytes = 1 << 10  # a data file per tensor or so, uploaded side by side
    w.run(Place(work, storage), log, w)
    states = [
        (f"after event {t}", how, _seen(log.marks, t), objects_) for t, how, objects_ in objects.crash_states({}, log)
    ]

    def lay_out(state: Any) -> Place:
        return Place(work, trainstate.FsspecStorage(objects.ObjectStore(state), retries=0))

    return Recording(len(log.requests), _saved(log.marks), states, lay_out)


def _by_ranks(w: Workload, work: Path) -> Recording:
    root = work / "recorded"
    root.mkdir()
    recordings = collective.record(w, root, work)
    complete(recordings[0].before, sorted([op for r in recordings for op in r.ops], key=lambda op: op.at), root)
    states = list(collective.crash_states(recordings))
    operations = sum(len(r.ops) for r in recordings)
    recording = Recording(operations, _saved(recordings[0].marks), states, _in_directory(root))
    if w.local:  # a local tier restores at the world size that wrote it: judged by as many ranks
        judges = collective.Judges(w)
        recording.judge, recording.close = judges.judge, judges.close
    return recording


def distinct(states: list[tuple[str, str, list[str], Any]]) -> list[tuple[str, str, list[str], Any]]:
    """Each (state, marks made before it) once, at the first crash point that makes it: one state at several
    points (nothing changed between them) is one case for the oracle."""
    seen: set[tuple[str, tuple[str, ...]]] = set()
    out = []
    for where, how, told, state in states:
        key = (digest(state) if isinstance(state, Image) else objects.digest(state), tuple(told))
        if key not in seen:
            seen.add(key)
            out.append((where, how, told, state))
    return out


def keep_state(state: Any, where: Path) -> None:
    """Write a state out for a look by hand: a tree as it is; an object store's objects as files by key."""
    if isinstance(state, Image):
        materialize(state, where)
        return
    for key, data in state.items():
        (where / key).parent.mkdir(parents=True, exist_ok=True)
        (where / key).write_bytes(data)


def run(w: Workload, *, sample: int | None = None, seed: int = 0, keep: Path | None = None) -> Result:
    """All distinct crash states of ``w`` (``sample``: that many of them, drawn at random) judged by its oracle;
    ``keep``: a directory each failing state is written into (``keep/<n>``), with ``keep/<n>.txt`` saying why."""
    result = Result(w.name)
    logging.getLogger("trainstate").setLevel(logging.CRITICAL)  # the oracle's restores warn on purpose
    with tempfile.TemporaryDirectory(prefix="crashstates-") as tmp:
        recording = (_by_ranks if w.ranks > 1 else _on_store if w.objects else _on_disk)(w, Path(tmp))
        states = distinct(recording.states)
        result.operations, result.states = recording.operations, len(states)
        if sample is not None and sample < len(states):
            states = random.Random(seed).sample(states, sample)
        try:
            for where, how, seen, state in states:
                try:
                    recording.judge(recording.lay_out(state), w, seen, recording.saved)
                except Exception as e:  # noqa: BLE001 - each failure is a finding, reported with its state
                    trace = traceback.format_exception_only(type(e), e)[-1].strip()
                    result.failures.append(f"{where} ({how}): {trace}")
                    if keep is not None:
                        n = len(result.failures)
                        keep_state(state, keep / str(n))
                        (keep / f"{n}.txt").write_text(f"{w.name}\n{where} ({how})\nmarks before: {seen}\n{trace}\n")
                result.checked += 1
        finally:
            recording.close()
    return result
