"""A Lightning run SIGKILLed mid-epoch and resumed with ``ckpt_path="last"`` in a fresh process ends
bit-identical to one never interrupted, with TrainstateCheckpointIO and ExactResume; Lightning alone does not.

Two processes (lightning_run.py; importing Lightning costs seconds of CPU each): the run killed in the batch
after its step-10 checkpoint (the third batch of epoch 2 of 8-batch epochs: mid-epoch), and a fresh one that
resumes it, then resumes a copy of its checkpoints with Lightning alone (the control, which must differ), then
trains the uninterrupted run. Checkpoints are saved in the background, so the kill may land while the newest
one is still being written: the resume then starts from the one before, and must be exact all the same.
"""

from __future__ import annotations

import importlib.util
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("lightning") is None:  # not imported here: only the runs need it
    pytest.skip("lightning is not installed", allow_module_level=True)
torch = pytest.importorskip("torch")

import trainstate  # noqa: E402

RUN = Path(__file__).with_name("lightning_run.py")


def _start(*args: object) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-X", "faulthandler", str(RUN), *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _finish(proc: subprocess.Popen[str]) -> str:
    try:
        out, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:  # hung: SIGABRT makes faulthandler print every thread's stack
        proc.send_signal(signal.SIGABRT)
        out, _ = proc.communicate()
        pytest.fail("a run hung; its threads:\n" + out[-8000:])
    assert proc.returncode == 0, out[-3000:]
    return out


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return trainstate.load(path, framework="torch")["model"]


def test_sigkill_mid_epoch_then_resume_last_is_bit_identical(tmp_path):
    killed = _start(tmp_path / "run", "--workers", 2, "--async-save", "--hang-after", 10)
    assert killed.stdout is not None
    lines = []
    for line in killed.stdout:  # wait until it reports the checkpoint, then kill it where it stands
        lines.append(line)
        if line.startswith("checkpointed 10"):
            break
    else:
        killed.wait()
        pytest.fail("the run ended without reaching its step-10 checkpoint:\n" + "".join(lines)[-3000:])
    killed.send_signal(signal.SIGKILL)
    killed.communicate()
    assert killed.returncode == -signal.SIGKILL
    checkpoints = tmp_path / "run" / "checkpoints"
    assert (checkpoints / "last.ckpt" / "manifest.json").exists()
    shutil.copytree(checkpoints, tmp_path / "control" / "checkpoints", symlinks=True)

    out = _finish(
        _start(
            tmp_path / "run",
            "--workers",
            2,
            "--async-save",
            "--control",
            tmp_path / "control",
            "--reference",
            tmp_path / "reference",
        )
    )
    assert f"Restoring states from the checkpoint path at {checkpoints / 'last.ckpt'}" in out  # resumed

    expected = _weights(tmp_path / "reference" / "final")
    got = _weights(tmp_path / "run" / "final")
    control = _weights(tmp_path / "control" / "final")
    for name, value in expected.items():
        assert torch.equal(got[name], value), f"{name}: the resumed run differs from the uninterrupted one"
    assert any(not torch.equal(control[n], v) for n, v in expected.items()), (
        "Lightning alone resumed bit-identically: the comparison cannot tell an exact resume from an inexact one"
    )
    # what the kill may have left (a half-written background save) was swept by the next save of that name
    assert not [p.name for p in checkpoints.iterdir() if p.name.startswith(".")]
