"""Lightning under DDP (``strategy="ddp"``, two processes, gloo on CPU, launched with torchrun) with
TrainstateCheckpointIO writing zstd-compressed, encrypted checkpoints and ExactResume: SIGKILLed on every rank
mid-epoch after a checkpoint and resumed with ``ckpt_path="last"`` in a fresh launch, it ends bit-identical to a
run that never stopped.

Under DDP Lightning's checkpoint is rank 0's alone (its strategy saves on rank 0 only), so the plugin saves it as
one process does, compressed and encrypted the same way; every rank loads it back. The resume crosses what a
DistributedSampler adds: Lightning starts the resumed epoch's iterator before it sets the sampler's epoch, and
ExactResume sets it (failed before: the resumed epoch replayed epoch 0's shuffle).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest

if importlib.util.find_spec("lightning") is None:  # not imported here: only the runs need it
    pytest.skip("lightning is not installed", allow_module_level=True)
pytest.importorskip("zstandard")
pytest.importorskip("cryptography")
torch = pytest.importorskip("torch")

import trainstate  # noqa: E402
from helpers import torchrun  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is missing")

SCRIPT = Path(__file__).with_name("lightning_ddp_run.py")
KEY = "3c" * 32


def _launch(*args: object) -> subprocess.CompletedProcess[str]:
    return torchrun(SCRIPT, *args, env={"TRAINSTATE_TEST_KEY": KEY})


def _weights(path: Path) -> dict[str, torch.Tensor]:
    loaded: dict[str, torch.Tensor] = trainstate.load(path, framework="torch")["model"]
    return loaded


def test_ddp_two_ranks_zstd_and_key_sigkill_mid_epoch_then_resume_last_is_bit_identical(tmp_path: Path) -> None:
    killed = _launch(tmp_path / "run", "--kill-after", 6)
    assert killed.returncode != 0 and "rank 0: checkpointed 6" in killed.stdout, killed.stdout[-3000:]
    checkpoints = tmp_path / "run" / "checkpoints"
    last = checkpoints / "last.ckpt"
    assert (last / "manifest.json").exists()
    # rank 0's checkpoint, compressed and encrypted: unreadable without the key, whole with it
    body = json.loads((last / "manifest.json").read_bytes())
    chunks = [c for t in body["tensors"].values() for c in t["chunks"]]
    assert body["encryption"]["algorithm"] == "aes-256-gcm" and body.get("world_size", 1) == 1
    assert all(c["transforms"][-1]["name"] == "aes-256-gcm" for c in chunks)
    assert any([s["name"] for s in c["transforms"]] == ["zstd", "aes-256-gcm"] for c in chunks)
    with pytest.raises(trainstate.EncryptionKeyError):
        trainstate.load(last)
    assert trainstate.load(last, key=KEY, include="global_step")["global_step"] == 6

    resumed = _launch(tmp_path / "run", "--reference", tmp_path / "reference")
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    assert f"Restoring states from the checkpoint path at {last}" in resumed.stdout

    expected = _weights(tmp_path / "reference" / "final" / "rank0")
    for rank in (0, 1):
        got = _weights(tmp_path / "run" / "final" / f"rank{rank}")
        theirs = _weights(tmp_path / "reference" / "final" / f"rank{rank}")
        for name, value in expected.items():
            assert torch.equal(got[name], value), f"rank {rank}, {name}: the resumed run differs from the reference"
            assert torch.equal(theirs[name], value), f"rank {rank}, {name}: the reference's ranks differ"
