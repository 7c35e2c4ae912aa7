"""Shared by the reliability campaigns: one result row per campaign, and small state builders."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Row:
    """One campaign's figures for docs/reliability.md."""

    campaign: str  # e.g. "SIGKILL during async save"
    trials: int  # attempts made
    passed: int  # attempts where every invariant held (or: corruptions detected)
    measure: str = "survived"  # what ``passed`` counts: "survived", "detected", "clean error", ...
    notes: list[str] = field(default_factory=list)

    @property
    def rate(self) -> str:
        return f"{100.0 * self.passed / self.trials:.2f}%" if self.trials else "n/a"


def numpy_state(step: int, size: int = 1 << 16) -> dict:
    """A deterministic NumPy state for ``step``: every value can be checked against the step."""
    return {
        "w": np.full((size // 256, 64), step, dtype=np.float32),
        "b": np.arange(size // 64, dtype=np.int64) + step,
        "step": step,
        "opt": {"state": {0: {"m": np.full(512, -step, dtype=np.float64)}}, "lr": 0.1 / (step + 1)},
    }


def check_numpy_state(state: dict, step: int) -> None:
    """Raise AssertionError unless ``state`` is exactly what numpy_state(step) saved."""
    expected = numpy_state(step, size=state["w"].size * 4)
    assert state["step"] == step, (state["step"], step)
    for key in ("w", "b"):
        assert np.array_equal(state[key], expected[key]), key
    assert np.array_equal(state["opt"]["state"][0]["m"], expected["opt"]["state"][0]["m"])
    assert state["opt"]["lr"] == expected["opt"]["lr"]


def spawn(code: str, *args: str) -> tuple[subprocess.Popen[str], str]:
    """Start ``python -c code args`` with the repo importable; returns it and the first line it printed."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    assert proc.stdout is not None
    return proc, proc.stdout.readline()


def print_rows(rows: list[Row], notes: int = 10) -> None:
    for row in rows:
        print(f"| {row.campaign} | {row.passed}/{row.trials} {row.measure} | {row.rate} |")
        for note in row.notes[:notes]:
            print(f"|   {note} | | |")
