"""Shared fixtures: small real models and a training state with every part a checkpoint holds."""

from __future__ import annotations

import os
from typing import Any

# JAX on the CPU as eight devices, so sharded arrays (a 4x2 mesh) are tested here: set before JAX is imported.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import pytest

from helpers import make_training_state


@pytest.fixture
def training_state() -> dict[str, Any]:
    return make_training_state()
