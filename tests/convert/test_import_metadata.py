"""What an import keeps of its source beside the tensors: a safetensors file's ``__metadata__`` survives
import then export."""

from __future__ import annotations

import torch
from safetensors import safe_open
from safetensors.torch import save_file

import trainstate


def test_import_then_export_keeps_the_safetensors_metadata(tmp_path):
    meta = {"format": "pt", "source": "the hub", "license": "mit"}
    save_file({"fc.weight": torch.ones(2, 3), "fc.bias": torch.zeros(2)}, tmp_path / "w.safetensors", metadata=meta)
    trainstate.import_checkpoint(tmp_path / "w.safetensors", tmp_path / "ckpt", prefix="model")
    for layout, out in (("safetensors", "again.safetensors"), ("hf", "folder")):
        trainstate.export(tmp_path / "ckpt", tmp_path / out, format=layout)
        written = tmp_path / out if layout == "safetensors" else tmp_path / out / "model.safetensors"
        with safe_open(written, "pt") as f:
            assert f.metadata() == meta, layout


def test_metadata_trainstate_writes_itself_is_not_copied_from_the_source(tmp_path):
    # the source's list of tied names describes the source's tensors: an export writes its own
    meta = {"format": "pt", "trainstate.tied": '{"head.weight": "embed.weight"}'}
    save_file({"embed.weight": torch.ones(4, 2)}, tmp_path / "w.safetensors", metadata=meta)
    trainstate.import_checkpoint(tmp_path / "w.safetensors", tmp_path / "ckpt")
    trainstate.export(tmp_path / "ckpt", tmp_path / "out.safetensors", format="safetensors")
    with safe_open(tmp_path / "out.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt", "trainstate.tied": '{"head.weight": "embed.weight"}'}
        assert sorted(f.keys()) == ["embed.weight"]
