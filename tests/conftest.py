"""Shared fixtures: small real models and a training state with every part a checkpoint holds."""

from __future__ import annotations

from typing import Any

import pytest

from helpers import make_training_state


@pytest.fixture
def training_state() -> dict[str, Any]:
    return make_training_state()
