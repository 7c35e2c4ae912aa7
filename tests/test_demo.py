"""The README's first command: ``trainstate demo`` ends with a bit-identical resumed run."""

import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("sklearn")


def test_demo_resumes_bit_identically(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "trainstate", "demo", "--dir", str(tmp_path), "--seed", "1", "--steps", "60"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "BIT-IDENTICAL to the uninterrupted run" in proc.stdout
    assert "checkpoints kept, and why" in proc.stdout
