"""``trainstate inspect`` shows who saved a checkpoint and how its tensors are chunked; ``trainstate
consolidate`` on checkpoints one process wrote. Checkpoints saved by real ranks: tests/distributed/test_consolidate.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from test_cli import cli, cli_json, state

import trainstate


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    path = tmp_path / "ckpt"
    trainstate.save(path, state())
    return path


def test_inspect_a_one_process_checkpoint(ckpt: Path) -> None:
    doc = cli_json("inspect", str(ckpt))
    assert doc["world_size"] == 1 and all(t["chunks"] == 1 and "boxes" not in t for t in doc["tensors"])
    doc = cli_json("inspect", str(ckpt), "--chunks", "--filter", "model.w")
    (w,) = doc["tensors"]
    assert w["boxes"] == [
        {"offset": [0, 0], "shape": [3, 4], "file": "data-00000.safetensors", "byte_range": w["boxes"][0]["byte_range"]}
    ]
    assert w["boxes"][0]["byte_range"][1] - w["boxes"][0]["byte_range"][0] == 48
    text = cli("inspect", str(ckpt)).stdout
    assert re.search(r"saved by +1 process", text)
    assert not re.search(r"^\s*tensor .*\bchunks\b", text, re.M)  # no chunk column when every tensor is whole


def test_consolidate_copies_a_one_process_checkpoint_and_refuses_bad_arguments(ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    report = cli_json("consolidate", str(ckpt), str(out))
    assert report["source_world_size"] == 1 and report["tensors"] == 2
    back = trainstate.load(out)
    assert np.array_equal(back["model"]["w"], state()["model"]["w"]) and back["step"] == 7
    assert "rank 5" in cli("consolidate", str(ckpt), str(tmp_path / "o2"), "--rank", "5", code=2).stderr
    assert (
        "expected a rank (0, 1, ...), got -1"
        in cli("consolidate", str(ckpt), str(tmp_path / "o3"), "--rank", "-1", code=2).stderr
    )
    assert cli("consolidate", str(tmp_path / "missing"), str(tmp_path / "o4"), code=3)
    assert not (tmp_path / "o2").exists() and not (tmp_path / "o3").exists()
