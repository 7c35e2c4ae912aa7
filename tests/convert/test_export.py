"""trainstate.export / ``trainstate export``: a training checkpoint's model weights as Hugging Face, safetensors
and torch.save files, read back with the safetensors package and torch.load as other tools would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from convert_helpers import BIG, Mixed, TiedLM, cli, cli_json, same_tensors, seeded, training_state
from measure_peak import peaks
from safetensors import safe_open
from safetensors.torch import load_file, load_model

import trainstate
from trainstate._format.run_dir import staged_target


@pytest.fixture
def mixed_ckpt(tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    model = seeded(Mixed, 0)
    trainstate.save(tmp_path / "ckpt", training_state(model))
    return tmp_path / "ckpt", model


def test_default_export_is_the_model_alone_under_its_own_names(mixed_ckpt, tmp_path):
    ckpt, model = mixed_ckpt
    result = trainstate.export(ckpt, tmp_path / "out")
    assert result.files == ("model.safetensors",) and not [n for n in os.listdir(tmp_path) if n.startswith(".")]
    weights = load_file(tmp_path / "out" / "model.safetensors")
    assert same_tensors(weights, model.state_dict())  # names, order, dtypes and bytes; no optimizer, no RNG
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}  # what from_pretrained checks
    assert (
        result.tensors == len(model.state_dict())
        and result.nbytes == (tmp_path / "out/model.safetensors").stat().st_size
    )


def test_shards_and_their_index_are_the_layout_from_pretrained_reads(mixed_ckpt, tmp_path):
    ckpt, model = mixed_ckpt
    sd = model.state_dict()
    limit = 60  # bytes: the 80-byte fc.weight gets a shard of its own, the rest share
    result = trainstate.export(ckpt, tmp_path / "out", max_shard_size=limit)
    n = len(result.files) - 1
    shards = [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert list(result.files) == shards + ["model.safetensors.index.json"] and n > 2
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert index["metadata"] == {
        "total_size": sum(t.nbytes for t in sd.values()),
        "total_parameters": sum(t.numel() for t in sd.values()),
    }
    assert sorted(index["weight_map"]) == sorted(sd)
    back: dict[str, torch.Tensor] = {}
    for shard in shards:
        part = load_file(tmp_path / "out" / shard)
        assert {k for k, f in index["weight_map"].items() if f == shard} == set(part)
        size = sum(t.nbytes for t in part.values())
        assert size <= limit or len(part) == 1, (shard, size)
        back.update(part)
    assert same_tensors({k: back[k] for k in sd}, sd)
    # the greedy rule of save_pretrained: a shard closes when the next tensor would overflow it
    sizes = [sum(t.nbytes for t in load_file(tmp_path / "out" / s).values()) for s in shards]
    firsts = [next(iter(load_file(tmp_path / "out" / s).values())).nbytes for s in shards[1:]]
    assert all(a + b > limit for a, b in zip(sizes, firsts))
    assert trainstate.export(ckpt, tmp_path / "one", max_shard_size="5GB").files == ("model.safetensors",)


def test_a_cast_rounds_floats_as_torch_does_and_keeps_integers(mixed_ckpt, tmp_path):
    ckpt, model = mixed_ckpt
    sd = model.state_dict()
    for dtype, torch_dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        trainstate.export(ckpt, tmp_path / dtype, dtype=dtype)
        got = load_file(tmp_path / dtype / "model.safetensors")
        want = {k: v.to(torch_dtype) if v.is_floating_point() else v for k, v in sd.items()}
        assert same_tensors(got, want), dtype
        assert got["norm.num_batches_tracked"].dtype == torch.int64 and got["mask"].dtype == torch.bool


def test_torch_format_loads_with_weights_only_and_keeps_tied_names(tmp_path):
    model = seeded(TiedLM, 1)
    trainstate.save(tmp_path / "ckpt", training_state(model))
    result = trainstate.export(tmp_path / "ckpt", tmp_path / "weights.pt", format="torch")
    assert result.files == ("weights.pt",) and result.tied == {}
    loaded = torch.load(tmp_path / "weights.pt", weights_only=True)
    assert same_tensors(loaded, model.state_dict())
    assert loaded["head.weight"].data_ptr() == loaded["embed.weight"].data_ptr()  # one storage, as torch.save
    fresh = TiedLM()
    fresh.load_state_dict(loaded)  # strict
    x = torch.tensor([[1, 2, 3]])
    assert torch.equal(fresh(x), model(x))
    # into a folder: pytorch_model.bin, the name transformers looks for
    assert trainstate.export(tmp_path / "ckpt", tmp_path / "dir", format="torch").files == ("pytorch_model.bin",)
    assert same_tensors(torch.load(tmp_path / "dir" / "pytorch_model.bin", weights_only=True, mmap=True), loaded)


def test_a_tied_tensor_is_written_once_under_its_first_name(tmp_path):
    model = seeded(TiedLM, 2)
    trainstate.save(tmp_path / "ckpt", {"model": model})
    result = trainstate.export(tmp_path / "ckpt", tmp_path / "hf")
    assert result.tied == {"head.weight": "embed.weight"} and result.tensors == 3
    path = tmp_path / "hf" / "model.safetensors"
    assert sorted(load_file(path)) == ["body.bias", "body.weight", "embed.weight"]
    with safe_open(path, "pt") as f:
        assert json.loads(f.metadata()["trainstate.tied"]) == {"head.weight": "embed.weight"}
    fresh = TiedLM()
    load_model(fresh, path)  # safetensors' own loader of tied models: strict, ties kept
    x = torch.tensor([[4, 5]])
    assert torch.equal(fresh(x), model(x)) and fresh.head.weight is fresh.embed.weight
    one = trainstate.export(tmp_path / "ckpt", tmp_path / "m.safetensors", format="safetensors")
    assert one.files == ("m.safetensors",) and sorted(load_file(tmp_path / "m.safetensors")) == sorted(load_file(path))


def test_select_and_strip_prefix_pick_any_part(tmp_path):
    student, teacher = seeded(Mixed, 3), seeded(TiedLM, 4)
    trainstate.save(tmp_path / "ckpt", {"step": 9, "student": student, "teacher": teacher})
    trainstate.export(tmp_path / "ckpt", tmp_path / "default")
    assert same_tensors(load_file(tmp_path / "default" / "model.safetensors"), student.state_dict())  # the first
    trainstate.export(tmp_path / "ckpt", tmp_path / "t", select="teacher.*", strip_prefix="teacher.")
    assert sorted(load_file(tmp_path / "t" / "model.safetensors")) == ["body.bias", "body.weight", "embed.weight"]
    trainstate.export(tmp_path / "ckpt", tmp_path / "both", select=["teacher.body.*", "student.fc.*"])
    assert sorted(load_file(tmp_path / "both" / "model.safetensors")) == [
        "student.fc.bias",
        "student.fc.weight",
        "teacher.body.bias",
        "teacher.body.weight",
    ]
    with pytest.raises(trainstate.InvalidArgumentError, match="match no key"):
        trainstate.export(tmp_path / "ckpt", tmp_path / "x", select="techer.*")
    with pytest.raises(trainstate.InvalidArgumentError, match="does not start"):
        trainstate.export(tmp_path / "ckpt", tmp_path / "x", select=["teacher.*", "student.*"], strip_prefix="teacher.")
    with pytest.raises(trainstate.InvalidArgumentError, match="hold no tensors"):
        trainstate.export(tmp_path / "ckpt", tmp_path / "x", select="step")
    assert not (tmp_path / "x").exists()
    wrapped = torch.nn.Module()  # how DDP holds a model: its names start with "module."
    wrapped.module = student
    trainstate.save(tmp_path / "ddp", {"model": wrapped})
    trainstate.export(tmp_path / "ddp", tmp_path / "bare", strip_prefix="module.")
    assert same_tensors(load_file(tmp_path / "bare" / "model.safetensors"), student.state_dict())


def test_a_state_without_a_module_asks_for_select(tmp_path):
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    trainstate.save(tmp_path / "ckpt", {"model": {"w": w}, "step": 1, "rng": trainstate.RNGState()})
    with pytest.raises(
        trainstate.InvalidArgumentError, match=r"holds no module.*\['model', 'step', 'rng'\].*select='model\.\*'"
    ):
        trainstate.export(tmp_path / "ckpt", tmp_path / "out")
    trainstate.export(tmp_path / "ckpt", tmp_path / "out", select="model.*", strip_prefix="model.")
    assert np.array_equal(load_file(tmp_path / "out" / "model.safetensors")["w"].numpy(), w)


def test_copy_from_brings_config_and_tokenizer_but_not_old_weights(mixed_ckpt, tmp_path):
    ckpt, model = mixed_ckpt
    base = tmp_path / "base"
    (base / "1_Pooling").mkdir(parents=True)
    (base / ".cache").mkdir()
    for name, text in {
        "config.json": '{"model_type": "x"}',
        "tokenizer.json": "{}",
        "1_Pooling/config.json": "{}",
        "model.safetensors": "stale weights",
        "pytorch_model.bin.index.json": "{}",
        ".cache/junk": "x",
    }.items():
        (base / name).write_text(text)
    result = trainstate.export(ckpt, tmp_path / "out", copy_from=base)
    assert result.copied == ("1_Pooling/config.json", "config.json", "tokenizer.json")
    assert (tmp_path / "out" / "config.json").read_text() == '{"model_type": "x"}'
    assert sorted(os.listdir(tmp_path / "out")) == ["1_Pooling", "config.json", "model.safetensors", "tokenizer.json"]
    assert same_tensors(load_file(tmp_path / "out" / "model.safetensors"), model.state_dict())
    with pytest.raises(trainstate.InvalidArgumentError, match="needs a folder"):
        trainstate.export(ckpt, tmp_path / "w.safetensors", format="safetensors", copy_from=base)
    with pytest.raises(trainstate.CheckpointNotFoundError, match="not a directory"):
        trainstate.export(ckpt, tmp_path / "o2", copy_from=tmp_path / "nope")
    with pytest.raises(trainstate.InvalidArgumentError, match="is a trainstate checkpoint, not a model folder"):
        trainstate.export(ckpt, tmp_path / "o2", copy_from=ckpt)  # its manifest made OUT a broken checkpoint
    assert not (tmp_path / "o2").exists()


def test_out_is_replaced_only_when_asked_and_never_half_written(mixed_ckpt, tmp_path):
    ckpt, model = mixed_ckpt
    out = tmp_path / "out"
    trainstate.export(ckpt, out, dtype="bf16")
    before = (out / "model.safetensors").read_bytes()
    with pytest.raises(trainstate.CheckpointExistsError, match="overwrite=True"):
        trainstate.export(ckpt, out)
    # a damaged tensor stops the export part-way: OUT keeps the old export, nothing is left behind
    damaged = tmp_path / "damaged"
    trainstate.save(damaged, {"model": model})
    data = damaged / "data-00000.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-3] ^= 0xFF  # the last tensor's bytes
    data.write_bytes(bytes(raw))
    with pytest.raises(trainstate.CorruptCheckpointError):
        trainstate.export(damaged, out, overwrite=True)
    assert (out / "model.safetensors").read_bytes() == before and sorted(os.listdir(tmp_path)) == [
        "ckpt",
        "damaged",
        "out",
    ]
    trainstate.export(ckpt, out, overwrite=True)
    assert same_tensors(load_file(out / "model.safetensors"), model.state_dict())
    with pytest.raises(trainstate.CheckpointExistsError, match="is a trainstate checkpoint"):
        trainstate.export(ckpt, ckpt, overwrite=True)  # never onto a checkpoint, least of all its own source
    with pytest.raises(trainstate.CheckpointExistsError, match="holds folders"):
        trainstate.export(ckpt, tmp_path, overwrite=True)  # nor onto the run's directory
    with pytest.raises(trainstate.CheckpointExistsError, match="holds folders"):
        trainstate.export(ckpt, tmp_path.parent, overwrite=True)  # nor onto a folder of runs (new-user trial)
    assert trainstate.load(ckpt)["step"] == 3


def test_a_torch_export_of_a_damaged_checkpoint_raises_and_the_process_lives_on(tmp_path):
    """torch's file writer, left alive past the file it writes when a tensor failed its checksum, wrote to
    the closed file from its destructor and aborted the process after the error was caught."""
    model = torch.nn.Linear(64, 64)
    trainstate.save(tmp_path / "damaged", {"model": model})
    data = tmp_path / "damaged" / "data-00000.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-3] ^= 0xFF
    data.write_bytes(bytes(raw))
    code = (
        "import sys, trainstate\n"
        "try:\n"
        f"    trainstate.export({str(tmp_path / 'damaged')!r}, {str(tmp_path / 'out.pt')!r}, format='torch')\n"
        "except trainstate.CorruptCheckpointError:\n"
        "    print('caught', flush=True)\n"
        "import gc; gc.collect()\n"
        "print('alive', flush=True)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.split() == ["caught", "alive"], (proc.returncode, proc.stderr)
    assert not (tmp_path / "out.pt").exists()


def test_bad_arguments_are_clear_errors(mixed_ckpt, tmp_path):
    ckpt, _ = mixed_ckpt
    cases = [
        ({"format": "onnx"}, "format must be one of"),
        ({"dtype": "int8"}, "dtype must be one of"),
        ({"max_shard_size": "2 parsecs"}, "expected a size like 2GB"),
        ({"max_shard_size": 0}, "at least one byte"),
        ({"format": "safetensors", "max_shard_size": "1GB"}, "applies to format='hf'"),
    ]
    for kwargs, message in cases:
        with pytest.raises(trainstate.InvalidArgumentError, match=message):
            trainstate.export(ckpt, tmp_path / "out", **kwargs)
    with pytest.raises(trainstate.CheckpointNotFoundError):
        trainstate.export(tmp_path / "missing", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_export_holds_one_tensor_at_a_time(big_checkpoints, tmp_path):
    """Four 64 MiB weights (256 MiB): the export's own memory stays near one tensor, not the model."""
    ckpt, _ = big_checkpoints
    tensor = BIG * BIG * 4
    plain, cast, as_torch = peaks(
        ("export", [ckpt, tmp_path / "hf"], {}),
        ("export", [ckpt, tmp_path / "bf16"], {"dtype": "bf16"}),
        ("export", [ckpt, tmp_path / "w.pt"], {"format": "torch"}),
    )
    print(f"export peak: {plain / 2**20:.1f} MiB, bf16 cast {cast / 2**20:.1f} MiB, torch {as_torch / 2**20:.1f} MiB")
    assert max(plain, cast, as_torch) < 1.5 * tensor, (plain, cast, as_torch)
    with safe_open(tmp_path / "bf16" / "model.safetensors", "pt") as f:
        assert f.get_slice("3.weight").get_dtype() == "BF16" and f.get_tensor("3.weight")[0, 0].item() == 1.0


def test_cli_export(mixed_ckpt, tmp_path):
    ckpt, model = mixed_ckpt
    report = cli_json("export", str(ckpt), str(tmp_path / "out"), "--format", "torch", "--dtype", "fp16")
    assert report["files"] == ["pytorch_model.bin"] and report["tensors"] == len(model.state_dict())
    loaded = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
    assert loaded["fc.weight"].dtype == torch.float16
    out = cli("export", str(ckpt), str(tmp_path / "hf"), "--select", "model.fc.*", "--strip-prefix", "model.").stdout
    assert "exported 2 tensors" in out and sorted(load_file(tmp_path / "hf" / "model.safetensors")) == [
        "fc.bias",
        "fc.weight",
    ]
    assert "pass --overwrite" in cli("export", str(ckpt), str(tmp_path / "hf"), code=8).stderr
    assert "match no key" in cli("export", str(ckpt), str(tmp_path / "x"), "--select", "nope.*", code=2).stderr
    assert cli("export", str(tmp_path / "missing"), str(tmp_path / "x"), code=3)
    assert "invalid choice" in cli("export", str(ckpt), str(tmp_path / "x"), "--format", "onnx", code=2).stderr


def test_what_a_killed_export_left_is_cleared_by_the_next_and_a_running_one_is_left_alone(mixed_ckpt, tmp_path):
    ckpt, model = mixed_ckpt
    out = tmp_path / "out"
    killed = (  # SIGKILL in the middle of writing, after the first tensor was produced
        "import os, signal, trainstate\n"
        "from trainstate._convert import export\n"
        "real = export._produce\n"
        "def dying(ck, t):\n"
        "    if t.stored.endswith('bias'): os.kill(os.getpid(), signal.SIGKILL)\n"
        "    return real(ck, t)\n"
        "export._produce = dying\n"
        f"trainstate.export({str(ckpt)!r}, {str(out)!r})\n"
    )
    left = []
    for _ in range(2):  # the second killed export clears the first one's leftover before it starts
        proc = subprocess.run([sys.executable, "-c", killed], capture_output=True, text=True, timeout=120)
        assert proc.returncode == -9, proc.stderr
        left.append([n for n in os.listdir(tmp_path) if staged_target(n) == ("out", "tmp")])
    assert len(left[0]) == len(left[1]) == 1 and left[0] != left[1] and not out.exists()
    running = subprocess.Popen(  # an export to the same OUT that is still writing
        [
            sys.executable,
            "-c",
            "import sys\nfrom trainstate._convert.output import staged\n"
            f"with staged({str(out)!r}, overwrite=True, directory=True) as tmp:\n"
            "    print(tmp, flush=True); sys.stdin.readline()\n",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        live = Path(running.stdout.readline().strip())
        trainstate.export(ckpt, out)
        assert same_tensors(load_file(out / "model.safetensors"), model.state_dict())
        assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == [live.name]
    finally:
        running.communicate("\n", timeout=60)
    assert running.returncode == 0 and not live.exists()


def test_a_cast_that_overflows_is_refused_and_names_the_tensor(tmp_path):
    trainstate.save(tmp_path / "ckpt", {"model": {"w": torch.tensor([1.0, 7e4, -2.0]), "ok": torch.ones(3)}})
    with pytest.raises(trainstate.UnsupportedValueError, match=r"model.w: casting to F16 overflows .*70000"):
        trainstate.export(tmp_path / "ckpt", tmp_path / "out", dtype="fp16", select="model")
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    trainstate.export(tmp_path / "ckpt", tmp_path / "out", dtype="bf16", select="model")  # float32's range
    inf = {"model": {"w": torch.tensor([float("inf"), 1.0])}}  # an infinity the model already had is kept
    trainstate.save(tmp_path / "inf", inf)
    trainstate.export(tmp_path / "inf", tmp_path / "inf16", dtype="fp16", select="model")
    assert torch.isinf(load_file(tmp_path / "inf16" / "model.safetensors")["model.w"][0])
