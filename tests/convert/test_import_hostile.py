"""Imports of untrusted files (downloaded weights, archives from elsewhere), each built hostile here: a
refusal is a trainstate CheckpointError naming the file, and nothing is allocated or read beyond what the
file holds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import trainstate

# -- Hugging Face folders: shards stay inside the folder (or the hub cache's blob store) ------------------


def _hf_sharded(folder: Path, shard_names: list[str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    weight_map = {f"w{i}": name for i, name in enumerate(shard_names)}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_a_shard_linked_outside_its_folder_is_refused(tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    save_file({"w0": torch.ones(2)}, outside / "secret.safetensors")
    folder = tmp_path / "model"
    _hf_sharded(folder, ["model-00001-of-00001.safetensors"])
    (folder / "model-00001-of-00001.safetensors").symlink_to(outside / "secret.safetensors")
    with pytest.raises(trainstate.CorruptCheckpointError, match=r"model-00001-of-00001.safetensors.*outside"):
        trainstate.import_checkpoint(folder, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_single_weights_file_linked_outside_its_folder_is_refused(tmp_path):
    save_file({"w": torch.ones(2)}, tmp_path / "secret.safetensors")
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors").symlink_to(tmp_path / "secret.safetensors")
    with pytest.raises(trainstate.CorruptCheckpointError, match=r"model.safetensors.*outside"):
        trainstate.import_checkpoint(folder, tmp_path / "out")


def _hub_cache(root: Path, target_of: dict[str, str]) -> Path:
    """A hub cache's repo folder as huggingface_hub lays it out: blobs by hash, a snapshot of links to them."""
    repo = root / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    for i, (name, target) in enumerate(target_of.items()):
        blob = repo / "blobs" / f"{i:040x}"
        save_file({f"w{i}": torch.full((2,), float(i))}, blob)
        (snapshot / name).symlink_to(target or f"../../blobs/{blob.name}")
    index = repo / "blobs" / "index"
    index.write_text(json.dumps({"weight_map": {f"w{i}": name for i, name in enumerate(target_of)}}))
    (snapshot / "model.safetensors.index.json").symlink_to("../../blobs/index")
    return snapshot


def test_a_hub_cache_snapshot_imports_through_its_links_to_blobs(tmp_path):
    snapshot = _hub_cache(tmp_path, {"model-00001-of-00002.safetensors": "", "model-00002-of-00002.safetensors": ""})
    trainstate.import_checkpoint(snapshot, tmp_path / "out")
    with trainstate.open(tmp_path / "out") as ck:
        assert sorted(ck.keys()) == ["w0", "w1"]
        assert ck.read("w1", framework="torch").tolist() == [1.0, 1.0]


def test_a_hub_cache_link_out_of_its_blobs_is_refused(tmp_path):
    save_file({"w1": torch.ones(2)}, tmp_path / "secret.safetensors")
    snapshot = _hub_cache(
        tmp_path,
        {"model-00001-of-00002.safetensors": "", "model-00002-of-00002.safetensors": "../../../secret.safetensors"},
    )
    with pytest.raises(trainstate.CorruptCheckpointError, match=r"model-00002-of-00002.safetensors.*outside"):
        trainstate.import_checkpoint(snapshot, tmp_path / "out")


@pytest.mark.parametrize(
    "shard", ["../model.safetensors", "/etc/model.safetensors", "sub/../model.safetensors", "..", "a\\..\\b.bin"]
)
def test_a_shard_name_that_leaves_the_folder_is_refused(tmp_path, shard):
    save_file({"w0": torch.ones(2)}, tmp_path / "model.safetensors")
    folder = tmp_path / "model"
    _hf_sharded(folder, [shard])
    with pytest.raises(trainstate.CorruptCheckpointError, match="not a file of its folder"):
        trainstate.import_checkpoint(folder, tmp_path / "out")
