"""Checkpoint names inside a manager's directory: ``step_00001200``, zero-padded so names sort by step.

Only names this scheme produces are ever listed or deleted by a manager.
"""

from __future__ import annotations

import re

_NAME = re.compile(r"^step_(\d{8,})$")


def name_for(step: int) -> str:
    if step < 0:
        raise ValueError(f"step must be non-negative, got {step}")
    return f"step_{step:08d}"


def step_of(name: str) -> int | None:
    """The step a managed name stands for, or None for any other name."""
    m = _NAME.match(name)
    return int(m.group(1)) if m else None
