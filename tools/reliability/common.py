"""Shared by the reliability campaigns: one result row per campaign, and small state builders."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


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
