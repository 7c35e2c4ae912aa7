"""The README's first command: ``trainstate demo`` ends with a bit-identical resumed run."""

import importlib.util

import pytest

from helpers import cli

pytest.importorskip("torch")
# the demo reads scikit-learn's digits file without importing sklearn; importing it here (collecting, in each
# pytest process) would cost seconds
pytestmark = pytest.mark.skipif(importlib.util.find_spec("sklearn") is None, reason="scikit-learn not installed")


def test_demo_resumes_bit_identically(tmp_path):
    """The demo's three training runs (the reference, the SIGKILLed one, its resume) are fresh
    ``python -m trainstate demo --worker`` processes, the entry point included; the command that starts and
    compares them runs here, through the same ``main()`` (a fourth process would import torch for nothing)."""
    proc = cli("demo", "--dir", str(tmp_path), "--seed", "1", "--steps", "60")
    assert "BIT-IDENTICAL to the uninterrupted run" in proc.stdout
    assert "checkpoints kept, and why" in proc.stdout
