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
from .record import Recorder
from .states import crash_states, materialize
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
    states as (where it crashed, how the state was made, the steps committed before, the state), and how to lay
    a state out for the oracle."""

    operations: int
    saved: set[int]
    states: list[tuple[str, str, list[int], Any]]
    lay_out: Callable[[Any], Place]
    judge: Callable[[Place, Workload, list[int], set[int]], None] = oracle
    close: Callable[[], None] = lambda: None


def _committed(marks: list[tuple[int, str]], point: int) -> list[int]:
    return [int(label.split()[1]) for at, label in marks if at <= point and label.startswith("committed")]


def _saved(marks: list[tuple[int, str]]) -> set[int]:
    return {int(label.split()[1]) for _, label in marks} | set(range(10))  # marked, or in flight


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
    states = [
        (f"after op {k}", how, _committed(recorder.marks, k), image)
        for k, how, image in crash_states(recorder.before, recorder.ops)
    ]
    return Recording(len(recorder.ops), _saved(recorder.marks), states, _in_directory(root))


def _on_store(w: Workload, work: Path) -> Recording:
    log = objects.Log()
    # parts of 1 KiB: the checkpoints' data files go up as multipart uploads (create, parts, complete)
    w.run(Place(work, trainstate.FsspecStorage(objects.ObjectStore(log=log), part_size=1 << 10)), log, w)
    states = [
        (f"after event {t}", how, _committed(log.marks, t), objects_)
        for t, how, objects_ in objects.crash_states({}, log)
    ]

    def lay_out(state: Any) -> Place:
        return Place(work, trainstate.FsspecStorage(objects.ObjectStore(state), retries=0))

    return Recording(len(log.requests), _saved(log.marks), states, lay_out)


def _by_ranks(w: Workload, work: Path) -> Recording:
    root = work / "recorded"
    root.mkdir()
    recordings = collective.record(w, root, work)
    states = list(collective.crash_states(recordings))
    operations = sum(len(r.ops) for r in recordings)
    recording = Recording(operations, _saved(recordings[0].marks), states, _in_directory(root))
    if w.local:  # a local tier restores at the world size that wrote it: judged by as many ranks
        judges = collective.Judges(w)
        recording.judge, recording.close = judges.judge, judges.close
    return recording


def run(w: Workload, *, sample: int | None = None, seed: int = 0) -> Result:
    """All crash states of ``w`` (``sample``: that many of them, drawn at random) judged by its oracle."""
    result = Result(w.name)
    logging.getLogger("trainstate").setLevel(logging.CRITICAL)  # the oracle's restores warn on purpose
    with tempfile.TemporaryDirectory(prefix="crashstates-") as tmp:
        recording = (_by_ranks if w.ranks > 1 else _on_store if w.objects else _on_disk)(w, Path(tmp))
        result.operations, result.states = recording.operations, len(recording.states)
        states = recording.states
        if sample is not None and sample < len(states):
            states = random.Random(seed).sample(states, sample)
        try:
            for where, how, committed, state in states:
                try:
                    recording.judge(recording.lay_out(state), w, committed, recording.saved)
                except Exception as e:  # noqa: BLE001 - each failure is a finding, reported with its state
                    trace = traceback.format_exception_only(type(e), e)[-1].strip()
                    result.failures.append(f"{where} ({how}): {trace}")
                result.checked += 1
        finally:
            recording.close()
    return result
