"""Without an optional extra, its features fail with MissingDependencyError naming the extra to install.

Each check runs in a fresh process where torch is not importable, the way it is for someone who ran
``pip install trainstate`` without ``[torch]``: a ``sitecustomize`` on PYTHONPATH puts an import blocker
in front of every other finder, so ``import torch`` fails exactly as it does when torch is not installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import trainstate

BLOCKER = '''
import sys

class _NotInstalled:
    """Acts as if these top-level packages were not installed."""
    names = {"torch"}

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NotInstalled())
'''


@pytest.fixture
def no_torch(tmp_path: Path) -> dict[str, str]:
    """An environment for subprocesses in which torch cannot be imported."""
    site = tmp_path / "site-no-torch"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER)
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "COLUMNS": "200"}


def _python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, check=False
    )


def test_the_blocker_really_hides_torch(no_torch: dict[str, str]) -> None:
    proc = _python("import torch", no_torch)
    assert proc.returncode == 1 and "No module named 'torch'" in proc.stderr


def test_demo_without_torch_says_to_install_the_demo_extra(tmp_path: Path, no_torch: dict[str, str]) -> None:
    runs = tmp_path / "runs"
    proc = subprocess.run(
        [sys.executable, "-m", "trainstate", "demo", "--dir", str(runs), "--steps", "30"],
        capture_output=True,
        text=True,
        env=no_torch,
        timeout=300,
        check=False,
    )
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 8, (proc.returncode, proc.stderr)  # "other trainstate error": a missing extra
    (line,) = proc.stderr.splitlines()
    assert 'pip install "trainstate[demo]"' in line and "torch" in line, line
    assert not runs.exists()  # it stopped before starting any training process


@pytest.mark.parametrize(
    "use",
    [
        "trainstate.ResumableSampler",
        "import trainstate._data",
        "from trainstate._data import ResumableSampler",
        "trainstate.load(CKPT, framework='torch')",
        "trainstate.open(CKPT).read('w', framework='torch')",
        "d = pathlib.Path(CKPT + '_dcp'); d.mkdir(); (d / '.metadata').write_bytes(b'x'); "
        "trainstate.import_checkpoint(d, CKPT + '_imported')",
    ],
)
def test_torch_features_without_torch_name_the_torch_extra(tmp_path: Path, no_torch: dict[str, str], use: str) -> None:
    ckpt = tmp_path / "ckpt"
    trainstate.save(ckpt, {"w": np.arange(4.0)})
    code = f"""
import pathlib
import trainstate
CKPT = {str(ckpt)!r}
assert trainstate.load(CKPT)["w"].tolist() == [0, 1, 2, 3]  # NumPy-only use works without torch
try:
    {use}
except trainstate.MissingDependencyError as e:
    assert isinstance(e, ImportError)
    print("MissingDependencyError:", e)
"""
    proc = _python(code, no_torch)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("MissingDependencyError:"), proc.stdout
    assert 'pip install "trainstate[torch]"' in proc.stdout, proc.stdout


def test_a_numpy_only_run_never_imports_torch(tmp_path: Path) -> None:
    """torch installed but unused: a NumPy script's manager must not pay for importing it (seconds per start)."""
    code = (
        "import sys, numpy as np, trainstate\n"
        f"with trainstate.CheckpointManager({str(tmp_path / 'run')!r}, keep_last=2) as m:\n"
        "    for step in range(3):\n"
        "        m.save(step, {'w': np.arange(4.0) + step})\n"
        "    m.restore_latest({'w': np.zeros(4)})\n"
        "print('torch' in sys.modules)\n"
    )
    proc = _python(code, dict(os.environ))
    assert proc.returncode == 0 and proc.stdout.split() == ["False"], proc.stdout + proc.stderr
