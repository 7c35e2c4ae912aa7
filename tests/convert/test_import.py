"""trainstate.import_checkpoint / ``trainstate import``: safetensors files, torch.save files, Hugging Face folders
and torch.distributed.checkpoint directories made by those tools themselves, imported and loaded back."""

from __future__ import annotations

import json
import os
import pickle
import struct
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from convert_helpers import BIG, Mixed, TiedLM, cli, cli_json, same_tensors, seeded, training_state
from measure_peak import peaks
from safetensors.torch import save_file

import trainstate

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def stored(ckpt: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """The checkpoint's tensors by table name (under ``prefix``, without it), read as torch tensors."""
    with trainstate.open(ckpt) as ck:
        return {k[len(prefix) :]: ck.read(k, framework="torch") for k in ck.keys() if k.startswith(prefix)}


@pytest.mark.parametrize("layout", ["safetensors", "torch", "hf"])
def test_export_then_import_is_exact(layout, tmp_path):
    model = seeded(Mixed, 5)
    trainstate.save(tmp_path / "ckpt", training_state(model))
    out = tmp_path / ("w.safetensors" if layout == "safetensors" else "w.bin" if layout == "torch" else "hf")
    kwargs = {"max_shard_size": 64} if layout == "hf" else {}
    trainstate.export(tmp_path / "ckpt", out, format=layout, **kwargs)
    trainstate.import_checkpoint(out, tmp_path / "back", prefix="model")
    sd = model.state_dict()
    assert same_tensors(stored(tmp_path / "back", "model."), sd)  # names, order, dtypes, bytes
    with trainstate.open(tmp_path / "ckpt") as a, trainstate.open(tmp_path / "back") as b:
        info = [(i.dtype, i.shape, i.nbytes, i.kind) for i in map(a.info, a.keys()) if i.name.startswith("model.")]
        assert [(i.dtype, i.shape, i.nbytes, i.kind) for i in map(b.info, b.keys())] == info
    fresh = seeded(Mixed, 6)
    trainstate.load(tmp_path / "back", {"model": fresh})  # an imported state dict loads into the module
    assert same_tensors(fresh.state_dict(), sd)
    if layout == "safetensors":  # exported again: the same bytes
        trainstate.export(tmp_path / "back", tmp_path / "again.safetensors", format="safetensors")
        assert (tmp_path / "again.safetensors").read_bytes() == out.read_bytes()


def test_tied_weights_come_back_tied(tmp_path):
    model = seeded(TiedLM, 7)
    trainstate.save(tmp_path / "ckpt", {"model": model})
    trainstate.export(tmp_path / "ckpt", tmp_path / "hf")  # written once, the alias in __metadata__
    trainstate.import_checkpoint(tmp_path / "hf", tmp_path / "back", prefix="model")
    with trainstate.open(tmp_path / "back") as ck:
        assert sorted(ck.manifest.tensors) == ["model.body.bias", "model.body.weight", "model.embed.weight"]
    fresh = TiedLM()
    trainstate.load(tmp_path / "back", {"model": fresh})  # strict: head.weight is there, as embed.weight
    assert same_tensors(fresh.state_dict(), model.state_dict()) and fresh.head.weight is fresh.embed.weight
    torch.save(model.state_dict(), tmp_path / "tied.pt")  # torch.save keeps one storage for both names
    trainstate.import_checkpoint(tmp_path / "tied.pt", tmp_path / "from_torch")
    with trainstate.open(tmp_path / "from_torch") as ck:
        assert len(ck.manifest.tensors) == 3 and len(ck.keys()) == 3
    back = trainstate.load(tmp_path / "from_torch")
    assert back["head.weight"] is back["embed.weight"]


def test_hugging_face_folders_as_save_pretrained_writes_them(tmp_path):
    """Sharded safetensors with their index, and the older pytorch_model.bin shards with theirs."""
    sd = seeded(Mixed, 8).state_dict()
    names = list(sd)
    halves = [names[: len(names) // 2], names[len(names) // 2 :]]
    st, pt = tmp_path / "st", tmp_path / "pt"
    st.mkdir()
    pt.mkdir()
    for folder, stem, ext in ((st, "model", "safetensors"), (pt, "pytorch_model", "bin")):
        files = [f"{stem}-0000{i + 1}-of-00002.{ext}" for i in range(2)]
        for part, file in zip(halves, files):
            if ext == "safetensors":
                save_file({k: sd[k].contiguous() for k in part}, folder / file, metadata={"format": "pt"})
            else:
                torch.save({k: sd[k] for k in part}, folder / file)
        index = {"metadata": {"total_size": 0}, "weight_map": {k: files[i] for i, p in enumerate(halves) for k in p}}
        (folder / f"{stem}.{ext}.index.json").write_text(json.dumps(index))
        (folder / "config.json").write_text("{}")
        trainstate.import_checkpoint(folder, tmp_path / f"ck-{ext}")
        back = trainstate.load(tmp_path / f"ck-{ext}", framework="torch")
        assert same_tensors({k: back[k] for k in names}, sd), ext
    single = tmp_path / "single"
    single.mkdir()
    torch.save(sd, single / "pytorch_model.bin")
    trainstate.import_checkpoint(single, tmp_path / "ck-single", prefix="model")
    assert same_tensors(stored(tmp_path / "ck-single", "model."), sd)


def test_a_training_scripts_torch_save_keeps_its_structure(tmp_path):
    model = seeded(Mixed, 9)
    opt = training_state(model)["optim"]
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 3}, tmp_path / "run.pt")
    trainstate.import_checkpoint(tmp_path / "run.pt", tmp_path / "ck")
    fresh = seeded(Mixed, 10)
    trainstate.load(tmp_path / "ck", {"model": fresh}, strict=False)
    assert same_tensors(fresh.state_dict(), model.state_dict())
    back = trainstate.load(tmp_path / "ck", framework="torch")
    assert back["epoch"] == 3
    moments = back["optimizer"]["state"][0]  # int keys stay ints
    assert torch.equal(moments["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert back["optimizer"]["param_groups"][0]["lr"] == 1e-2
    torch.save(model.state_dict(), tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    trainstate.import_checkpoint(tmp_path / "legacy.pt", tmp_path / "from_legacy", prefix="model")
    assert same_tensors(stored(tmp_path / "from_legacy", "model."), model.state_dict())


def test_a_dcp_directory(tmp_path):
    model = seeded(Mixed, 11)
    opt = training_state(model)["optim"]
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 5, "extra": [torch.ones(2), 7]}
    dcp.save(state, checkpoint_id=tmp_path / "dcp", no_dist=True)
    trainstate.import_checkpoint(tmp_path / "dcp", tmp_path / "ck")
    fresh = seeded(Mixed, 12)
    trainstate.load(tmp_path / "ck", {"model": fresh}, strict=False)
    assert same_tensors(fresh.state_dict(), model.state_dict())
    back = trainstate.load(tmp_path / "ck", framework="torch")
    assert back["step"] == 5 and torch.equal(back["extra"][0], torch.ones(2)) and back["extra"][1] == 7
    # DCP writes dict keys as strings: an optimizer's positions come back as ints, or its load_state_dict
    # would keep the moments under "0" and give the parameters none, in silence
    assert sorted(back["optim"]["state"]) == sorted(opt.state_dict()["state"])
    assert torch.equal(back["optim"]["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert back["optim"]["param_groups"][0]["betas"] == (0.9, 0.999)
    trainstate.export(tmp_path / "ck", tmp_path / "hf")  # the imported model is found as the model
    with trainstate.open(tmp_path / "ck") as ck:
        assert ck.metadata["imported_from"]["format"] == "dcp"


def test_a_dcp_model_and_optimizer_resume_as_dcp_load_resumes_them(tmp_path):
    model = seeded(Mixed, 11)
    opt = training_state(model)["optim"]
    dcp.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, checkpoint_id=tmp_path / "dcp", no_dist=True)
    trainstate.import_checkpoint(tmp_path / "dcp", tmp_path / "ck")
    fresh = seeded(Mixed, 12)
    fresh_opt = torch.optim.AdamW([p for p in fresh.parameters() if p.dtype == torch.float32], lr=1e-2)
    trainstate.load(tmp_path / "ck", {"model": fresh, "optimizer": fresh_opt})
    want, got = opt.state_dict()["state"], fresh_opt.state_dict()["state"]
    assert sorted(got) == sorted(want) and len(got) == len(opt.param_groups[0]["params"])
    for i in want:
        assert all(torch.equal(got[i][k], want[i][k]) for k in want[i]), i


class Exploit:
    """Unpickling this would create a file: what a hostile checkpoint does with a shell command instead."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (Path.touch, (self.marker,))


def test_pickled_code_is_refused_never_run(tmp_path):
    marker = tmp_path / "pwned"
    torch.save({"w": torch.ones(2), "payload": Exploit(marker)}, tmp_path / "evil.pt")
    with pytest.raises(trainstate.UnsupportedValueError, match="never unpickles code"):
        trainstate.import_checkpoint(tmp_path / "evil.pt", tmp_path / "ck")
    dcp.save({"w": torch.ones(2)}, checkpoint_id=tmp_path / "dcp", no_dist=True)
    with open(tmp_path / "dcp" / ".metadata", "wb") as f:
        pickle.dump(Exploit(marker), f)  # DCP itself would run this with pickle.load
    with pytest.raises(trainstate.UnsupportedValueError, match="not part of DCP's metadata"):
        trainstate.import_checkpoint(tmp_path / "dcp", tmp_path / "ck")
    dcp.save({"w": torch.ones(2), "obj": Exploit(marker)}, checkpoint_id=tmp_path / "dcp2", no_dist=True)
    with pytest.raises(trainstate.UnsupportedValueError, match="never unpickles code"):
        trainstate.import_checkpoint(tmp_path / "dcp2", tmp_path / "ck")
    assert not marker.exists() and not (tmp_path / "ck").exists()


def test_what_is_not_a_source_is_a_clear_error(tmp_path):
    with pytest.raises(trainstate.CheckpointNotFoundError, match="no such file"):
        trainstate.import_checkpoint(tmp_path / "missing.pt", tmp_path / "ck")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("x")
    with pytest.raises(trainstate.InvalidArgumentError, match=r"model.safetensors.*\.metadata.*notes.txt"):
        trainstate.import_checkpoint(tmp_path / "empty", tmp_path / "ck")
    trainstate.save(tmp_path / "already", {"w": torch.ones(1)})
    with pytest.raises(trainstate.InvalidArgumentError, match="is a trainstate checkpoint already"):
        trainstate.import_checkpoint(tmp_path / "already", tmp_path / "ck")
    (tmp_path / "noise.bin").write_bytes(b"\x01" + os.urandom(299))  # neither a zip nor a pickle: no checkpoint
    with pytest.raises(trainstate.InvalidArgumentError, match="not a file trainstate can import"):
        trainstate.import_checkpoint(tmp_path / "noise.bin", tmp_path / "ck")
    (tmp_path / "noise.pt").write_bytes(b"\x80" + os.urandom(299))  # a pickle's start, then noise: damage
    with pytest.raises(trainstate.CorruptCheckpointError, match="not a torch.save file"):
        trainstate.import_checkpoint(tmp_path / "noise.pt", tmp_path / "ck")
    torch.save({"w": torch.randn(100, 100)}, tmp_path / "whole.pt")  # cut in half: damage, not a disk error
    whole = (tmp_path / "whole.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(trainstate.CorruptCheckpointError, match="damaged or truncated"):
        trainstate.import_checkpoint(tmp_path / "cut.pt", tmp_path / "ck")
    save_file({"w": torch.ones(1000)}, tmp_path / "w.safetensors")
    raw = (tmp_path / "w.safetensors").read_bytes()
    (tmp_path / "short.safetensors").write_bytes(raw[:-100])
    with pytest.raises(trainstate.CorruptCheckpointError, match="data_offsets"):
        trainstate.import_checkpoint(tmp_path / "short.safetensors", tmp_path / "ck")
    (tmp_path / "huge.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + raw[8:])
    with pytest.raises(trainstate.CorruptCheckpointError, match="no safetensors header"):
        trainstate.import_checkpoint(tmp_path / "huge.safetensors", tmp_path / "ck")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "../w.safetensors"}}))
    with pytest.raises(trainstate.CorruptCheckpointError, match="not a file of its folder"):
        trainstate.import_checkpoint(hf, tmp_path / "ck")
    with pytest.raises(trainstate.InvalidArgumentError, match="prefix must be"):
        trainstate.import_checkpoint(tmp_path / "w.safetensors", tmp_path / "ck", prefix="a..b")
    assert not (tmp_path / "ck").exists()


def test_import_holds_one_tensor_at_a_time(big_checkpoints, tmp_path):
    """Four 64 MiB weights from a safetensors file, a torch.save file and a DCP directory."""
    model = trainstate.load(big_checkpoints[0], framework="torch")["model"]
    save_file(model, tmp_path / "w.safetensors")
    torch.save(model, tmp_path / "w.pt")
    dcp.save({"model": model}, checkpoint_id=tmp_path / "dcp", no_dist=True)
    del model
    tensor = BIG * BIG * 4
    from_st, from_pt, from_dcp = peaks(
        ("import_checkpoint", [tmp_path / "w.safetensors", tmp_path / "a"], {}),
        ("import_checkpoint", [tmp_path / "w.pt", tmp_path / "b"], {}),
        ("import_checkpoint", [tmp_path / "dcp", tmp_path / "c"], {}),
    )
    print(
        f"import peak: safetensors {from_st / 2**20:.1f} MiB, torch {from_pt / 2**20:.1f}, DCP {from_dcp / 2**20:.1f}"
    )
    assert from_st < 1.5 * tensor and from_pt < 1.5 * tensor, (from_st, from_pt)
    assert from_dcp < 2.5 * tensor, from_dcp  # DCP loads each chunk itself, then copies it into ours
    with trainstate.open(tmp_path / "c") as ck:
        assert ck.read("model.3.weight")[0, 0] == 1.0


def test_cli_import(tmp_path):
    model = seeded(Mixed, 13)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "w.safetensors")
    report = cli_json("import", str(tmp_path / "w.safetensors"), str(tmp_path / "ck"), "--prefix", "model")
    assert report["format"] == "safetensors" and report["tensors"] == len(model.state_dict())
    back, sd = stored(tmp_path / "ck", "model."), model.state_dict()
    assert same_tensors({k: back[k] for k in sd}, sd)  # in the file's order: save_file sorts them
    assert "pass --overwrite" in cli("import", str(tmp_path / "w.safetensors"), str(tmp_path / "ck"), code=8).stderr
    assert "imported" in cli("import", str(tmp_path / "w.safetensors"), str(tmp_path / "ck"), "--overwrite").stdout
    assert cli("import", str(tmp_path / "missing"), str(tmp_path / "x"), code=3)
    (tmp_path / "noise.pt").write_bytes(b"\x80" + b"\x00" * 63)
    assert "not a torch.save file" in cli("import", str(tmp_path / "noise.pt"), str(tmp_path / "x"), code=5).stderr
    (tmp_path / "notes.txt").write_text("not weights")
    said = cli("import", str(tmp_path / "notes.txt"), str(tmp_path / "x"), code=2).stderr
    assert "not a file trainstate can import" in said and len(said.strip().splitlines()) == 1
