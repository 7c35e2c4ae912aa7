"""Run each workload under the recorder, generate every crash state of its recording, judge each with the oracle."""

from __future__ import annotations

import logging
import random
import shutil
import tempfile
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from .record import Recorder
from .states import crash_states, materialize
from .workloads import WORKLOADS, Workload, oracle


@dataclass
class Result:
    workload: str
    operations: int = 0
    states: int = 0  # distinct crash states generated
    checked: int = 0
    failures: list[str] = field(default_factory=list)


def record(w: Workload, work: Path) -> tuple[Recorder, set[int]]:
    root = work / "recorded"
    root.mkdir()
    recorder = Recorder(root)
    with recorder:
        w.run(root, recorder, w)
    saved = {int(label.split()[1]) for _, label in recorder.marks}
    return recorder, saved | set(range(0, 10))  # every step the workload saved (marked or in flight)


def run(w: Workload, *, sample: int | None = None, seed: int = 0) -> Result:
    """All crash states of ``w`` (``sample``: that many of them, drawn at random) judged by its oracle."""
    result = Result(w.name)
    logging.getLogger("trainstate").setLevel(logging.CRITICAL)  # the oracle's restores warn on purpose
    with tempfile.TemporaryDirectory(prefix="crashstates-") as tmp:
        work = Path(tmp)
        recorder, saved = record(w, work)
        result.operations = len(recorder.ops)
        states = list(crash_states(recorder.before, recorder.ops))
        result.states = len(states)
        if sample is not None and sample < len(states):
            states = random.Random(seed).sample(states, sample)
        root = work / "recorded"  # each state where the recording ran (a local tier names its run's path)
        for k, how, image in states:
            shutil.rmtree(root)
            root.mkdir()
            materialize(image, root)
            committed = [
                int(label.split()[1]) for at, label in recorder.marks if at <= k and label.startswith("committed")
            ]
            try:
                oracle(root, w, committed, saved)
            except Exception as e:  # noqa: BLE001 - each failure is a finding, reported with its state
                trace = traceback.format_exception_only(type(e), e)[-1].strip()
                result.failures.append(f"after op {k} ({how}): {trace}")
            result.checked += 1
    return result


def run_all(sample: int | None = None) -> list[Result]:
    return [run(w, sample=sample) for w in WORKLOADS]
