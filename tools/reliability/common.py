"""Shared by the reliability campaigns: one result row per campaign, and small state builders."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


TEST_KEY = bytes(range(32))  # public, docs/format.md §12.4's test key: never for real data


@dataclass(frozen=True)
class Flavor:
    """How a campaign's checkpoints are written: plain, compressed, encrypted, incremental or all three.

    Each campaign runs once per flavor with the same checks; the flavor only adds its keyword arguments to
    every save, manager and reader call. ``incremental`` needs a manager (``trainstate.save`` has no pool),
    so a campaign that saves a single checkpoint saves it through one (:func:`save_one`).
    """

    name: str
    compression: str | None = None
    key: bytes | None = None
    incremental: bool = False

    @property
    def label(self) -> str:
        """Appended to a row's campaign name; empty for plain, so the plain rows keep their names."""
        return "" if self.name == "plain" else f" [{self.name}]"

    def save_kwargs(self) -> dict[str, Any]:
        """For ``trainstate.save`` (an incremental flavor saves through a manager instead)."""
        return {k: v for k, v in (("compression", self.compression), ("key", self.key)) if v is not None}

    def manager_kwargs(self) -> dict[str, Any]:
        """For ``trainstate.CheckpointManager``."""
        return {**self.save_kwargs(), **({"incremental": True} if self.incremental else {})}

    def open_kwargs(self) -> dict[str, Any]:
        """For ``trainstate.load`` / ``trainstate.open``."""
        return {"key": self.key} if self.key is not None else {}


FLAVORS = {
    f.name: f
    for f in (
        Flavor("plain"),
        Flavor("zstd", compression="zstd"),
        Flavor("encrypted", key=TEST_KEY),
        Flavor("incremental", incremental=True),
        Flavor("zstd+encrypted+incremental", compression="zstd", key=TEST_KEY, incremental=True),
    )
}
PLAIN = FLAVORS["plain"]


def numpy_state(step: int, size: int = 1 << 16, frozen: bool = False) -> dict:
    """A deterministic NumPy state for ``step``: every value can be checked against the step.

    ``frozen`` adds a tensor that never changes (a frozen base), which an incremental run shares between
    checkpoints instead of writing it again.
    """
    state = {
        "w": np.full((size // 256, 64), step, dtype=np.float32),
        "b": np.arange(size // 64, dtype=np.int64) + step,
        "step": step,
        "opt": {"state": {0: {"m": np.full(512, -step, dtype=np.float64)}}, "lr": 0.1 / (step + 1)},
    }
    if frozen:
        state["base"] = frozen_base(size)
    return state


def frozen_base(size: int) -> np.ndarray:
    """The frozen tensor of :func:`numpy_state`: the same bytes at every step, not all alike (so that
    compression has something to do without making it vanish)."""
    return (np.arange(size // 8, dtype=np.int64) * 2654435761 % 1000).astype(np.float32)


def check_numpy_state(state: dict, step: int) -> None:
    """Raise AssertionError unless ``state`` is exactly what numpy_state(step) saved."""
    expected = numpy_state(step, size=state["w"].size * 4, frozen="base" in state)
    assert state["step"] == step, (state["step"], step)
    for key in ("w", "b", "base") if "base" in state else ("w", "b"):
        assert np.array_equal(state[key], expected[key]), key
    assert np.array_equal(state["opt"]["state"][0]["m"], expected["opt"]["state"][0]["m"])
    assert state["opt"]["lr"] == expected["opt"]["lr"]


def must_be_tampered(raw: bytes, original: bytes) -> bool:
    """Whether changed bytes of an encrypted manifest, not re-sealed, must be refused by its MAC alone
    (``TamperedCheckpointError``): they pass every check a reader makes before the MAC (docs/format.md
    §7 and §12.3: size, JSON, format, major version, the ``encryption`` object and the MAC's form), so
    only the MAC can object, and it must. Other changes may give any CheckpointError."""
    from trainstate._format.manifest import over_limits

    if raw == original or over_limits(raw) is not None:
        return False
    try:
        before, after = json.loads(original), json.loads(raw)
    except (ValueError, RecursionError):
        return False
    if not isinstance(after, dict) or "encryption" not in before:
        return False
    mac, version = after.get("checksum"), after.get("format_version")
    return (
        isinstance(mac, str)
        and re.fullmatch(r"hmac-sha256:[0-9a-f]{64}", mac) is not None
        and isinstance(version, str)
        and re.fullmatch(r"\d{1,6}\.\d{1,6}", version) is not None
        and version.split(".")[0] == before["format_version"].split(".")[0]
        and after.get("format") == before["format"]
        and after.get("encryption") == before["encryption"]
    )


def save_steps(run: Path, states: list[tuple[int, Any]], flavor: Flavor, metadata: dict[str, Any]) -> list[Path]:
    """Save ``states`` (step, state) as the checkpoints of one run of ``flavor`` and return their paths.

    A manager writes them, as a user's incremental run would, so an incremental flavor shares the tensors
    that did not change between the steps through the run's pool (``run/_shared``).
    """
    import trainstate

    with trainstate.CheckpointManager(
        run, every_steps=1, capture_rng=False, fsync=False, metadata=metadata, **flavor.manager_kwargs()
    ) as mgr:
        for step, state in states:
            mgr.save(step, state)
    return [run / f"step_{step:08d}" for step, _ in states]


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
