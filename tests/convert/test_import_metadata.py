"""What an import keeps of its source beside the tensors: a safetensors file's ``__metadata__`` survives
import then export."""

from __future__ import annotations

from typing import Any

import pytest
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


def test_a_hugging_face_folder_of_one_weights_file_keeps_its_metadata(tmp_path):
    """A one-file Hugging Face folder is that file: its __metadata__ (a license) was dropped in silence."""
    meta = {"format": "pt", "license": "mit"}
    (tmp_path / "hf").mkdir()
    save_file({"fc.weight": torch.ones(2, 3)}, tmp_path / "hf" / "model.safetensors", metadata=meta)
    trainstate.import_checkpoint(tmp_path / "hf", tmp_path / "ckpt")
    trainstate.export(tmp_path / "ckpt", tmp_path / "again.safetensors", format="safetensors")
    with safe_open(tmp_path / "again.safetensors", "pt") as f:
        assert f.metadata() == meta


def test_metadata_trainstate_writes_itself_is_not_copied_from_the_source(tmp_path):
    # the source's list of tied names describes the source's tensors: an export writes its own
    meta = {"format": "pt", "trainstate.tied": '{"head.weight": "embed.weight"}'}
    save_file({"embed.weight": torch.ones(4, 2)}, tmp_path / "w.safetensors", metadata=meta)
    trainstate.import_checkpoint(tmp_path / "w.safetensors", tmp_path / "ckpt")
    trainstate.export(tmp_path / "ckpt", tmp_path / "out.safetensors", format="safetensors")
    with safe_open(tmp_path / "out.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt", "trainstate.tied": '{"head.weight": "embed.weight"}'}
        assert sorted(f.keys()) == ["embed.weight"]


# -- a published Hugging Face model loads into the installed transformers' class where from_pretrained does ----


def _tiny_bert() -> Any:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=40,
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=16,
        max_position_embeddings=16,
    )
    torch.manual_seed(0)
    return transformers.BertModel(config)


def test_a_published_checkpoint_with_a_buffer_newer_transformers_dropped_loads(tmp_path):
    # all-MiniLM-L6-v2's files hold embeddings.position_ids, a buffer BertModel no longer persists: from_pretrained
    # ignores it (the class's rules), and so does trainstate.load into that class
    published = _tiny_bert()
    weights = {k: v.contiguous() for k, v in published.state_dict().items()}
    assert "embeddings.position_ids" not in weights
    weights["embeddings.position_ids"] = torch.arange(16).unsqueeze(0)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    trainstate.import_checkpoint(tmp_path / "model.safetensors", tmp_path / "ckpt", prefix="model")
    fresh = _tiny_bert()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    trainstate.load(tmp_path / "ckpt", {"model": fresh})  # strict
    for k, v in published.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k


def test_a_key_the_class_does_not_ignore_still_fails_a_strict_load_and_is_named(tmp_path):
    weights = {k: v.contiguous() for k, v in _tiny_bert().state_dict().items()}
    weights["embeddings.position_ids"] = torch.arange(16).unsqueeze(0)
    weights["pooler.extra.weight"] = torch.ones(2)
    del weights["pooler.dense.bias"]
    save_file(weights, tmp_path / "model.safetensors")
    trainstate.import_checkpoint(tmp_path / "model.safetensors", tmp_path / "ckpt", prefix="model")
    with pytest.raises(trainstate.StateMismatchError) as e:
        trainstate.load(tmp_path / "ckpt", {"model": _tiny_bert()})
    assert e.value.unexpected == ["model.pooler.extra.weight"] and e.value.missing == ["model.pooler.dense.bias"]
