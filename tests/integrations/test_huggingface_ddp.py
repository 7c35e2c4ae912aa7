"""The Hugging Face Trainer under DDP (two processes, gloo on CPU, launched with torchrun as a user launches one)
with TrainstateCallback saving zstd-compressed, encrypted checkpoints collectively: saving in the background, SIGKILLed on every
rank after a mid-epoch checkpoint and resumed in a fresh launch, it ends bit-identical to a run that never stopped.

Two launches of hf_trainer_ddp_run.py (each rank imports the Trainer: seconds of CPU each): the run killed after its
step-4 checkpoint (the first update of its second epoch: 3 updates an epoch per rank), then a fresh launch that
resumes it and, in the same processes, trains the uninterrupted reference.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("zstandard")
pytest.importorskip("cryptography")
torch = pytest.importorskip("torch")

import trainstate  # noqa: E402
from helpers import torchrun  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is missing")

SCRIPT = Path(__file__).with_name("hf_trainer_ddp_run.py")
KEY = "3c" * 32


def _launch(*args: object) -> subprocess.CompletedProcess[str]:
    return torchrun(SCRIPT, *args, env={"TRAINSTATE_TEST_KEY": KEY})


def _weights(path: Path) -> dict[str, torch.Tensor]:
    loaded: dict[str, torch.Tensor] = trainstate.load(path, framework="torch")["model"]
    return loaded


def test_ddp_two_ranks_zstd_and_key_sigkill_then_resume_is_bit_identical(tmp_path: Path) -> None:
    killed = _launch(tmp_path / "k", tmp_path / "never", "--kill-at", 4, "--async")
    assert killed.returncode != 0, killed.stdout[-3000:]
    assert "SIGKILL" in killed.stdout, killed.stdout[-3000:]
    assert not (tmp_path / "never").exists()

    resumed = _launch(
        tmp_path / "k", tmp_path / "k-final", "--reference", tmp_path / "u", tmp_path / "u-final", "--async"
    )
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    # the background save of step 4 may not have committed before the kill: then step 2's is the newest (both
    # mid-epoch: 3 updates an epoch); every rank resumes from the one rank 0 picked
    # found anywhere in a line: the two ranks' prints may interleave (print writes the text and its newline apart)
    said = re.findall(r"rank \d of 2 resumed from step (None|\d+)", resumed.stdout)
    steps = [step for step in said if step != "None"]  # the reference, trained after it, starts fresh
    assert len(steps) == 2 and len(set(steps)) == 1 and steps[0] in ("2", "4"), resumed.stdout[-4000:]

    reference = _weights(tmp_path / "u-final" / "rank0")
    for rank in (0, 1):
        got, theirs = _weights(tmp_path / "k-final" / f"rank{rank}"), _weights(tmp_path / "u-final" / f"rank{rank}")
        for name, value in reference.items():
            assert torch.equal(got[name], value), f"rank {rank}, {name}: the resumed run differs from the reference"
            assert torch.equal(theirs[name], value), f"rank {rank}, {name}: the reference's ranks differ"

    # one checkpoint written by both ranks: every chunk encrypted, zstd where it paid, the generators per rank
    last = tmp_path / "k" / "ckpt" / "step_00000009"
    body = json.loads((last / "manifest.json").read_bytes())
    assert body["world_size"] == 2 and body["encryption"]["algorithm"] == "aes-256-gcm"
    chunks = [c for t in body["tensors"].values() for c in t["chunks"]]
    assert all(c["transforms"][-1]["name"] == "aes-256-gcm" for c in chunks)
    assert any([s["name"] for s in c["transforms"]] == ["zstd", "aes-256-gcm"] for c in chunks)
    assert {c["file"].split("-")[1] for c in chunks} == {"r00000", "r00001"}  # the replicated model written once
    assert json.dumps(body["tree"]).count("trainstate.PerRank") >= 1
    # the trainer state saved is rank 0's, readable with the key like any checkpoint
    saved = trainstate.load(last, include="trainer_state.*", key=KEY)["trainer_state"]
    assert saved["global_step"] == 9 and saved["log_history"]
    assert not [p for p in (tmp_path / "k").iterdir() if p.name.startswith("checkpoint-")]  # no Trainer pickles
