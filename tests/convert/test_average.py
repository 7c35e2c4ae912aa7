"""trainstate.average / ``trainstate average``: the mean of a run's checkpoints, as a CheckpointManager saved them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from convert_helpers import BIG, Mixed, cli, cli_json, same_tensors, seeded, training_state
from measure_peak import peaks

import trainstate


def run(tmp_path: Path, steps: tuple[int, ...] = (10, 20, 30)) -> list[Path]:
    """A short training run saved by a CheckpointManager at ``steps``: model, AdamW, counters, RNG."""
    model = seeded(Mixed, 0)
    state = training_state(model)
    mgr = trainstate.CheckpointManager(tmp_path / "run", save_on_preemption=False)
    for step in steps:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p.float()).to(p.dtype))
        model.norm.num_batches_tracked.fill_(step)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        state["optim"].step()
        state["step"] = step
        mgr.save(step, state, force=True)
    mgr.close()
    return [tmp_path / "run" / f"step_{s:08d}" for s in steps]


def test_floats_are_averaged_and_the_rest_comes_from_the_newest(tmp_path):
    paths = run(tmp_path)
    shuffled = [paths[2], paths[0], paths[1]]  # the newest is the highest step, not the last argument
    trainstate.average(shuffled, tmp_path / "avg")
    loaded = [trainstate.load(p, framework="torch") for p in paths]
    avg = trainstate.load(tmp_path / "avg", framework="torch")
    newest = loaded[-1]
    for name, value in avg["model"].items():
        values = [c["model"][name] for c in loaded]
        if value.is_floating_point():
            wide = torch.float64 if value.dtype == torch.float32 else torch.float32
            want = (sum(v.to(wide) for v in values[1:]) + values[0].to(wide)) / 3
            assert torch.equal(value, want.to(value.dtype)), name
        else:  # BatchNorm's int counter, the bool mask
            assert torch.equal(value, newest["model"][name]), name
    opt, newest_opt = avg["optim"]["state"], newest["optim"]["state"]
    for param, moments in opt.items():
        assert torch.equal(moments["step"], newest_opt[param]["step"])  # a counter, not averaged
        mean = sum(c["optim"]["state"][param]["exp_avg"].double() for c in loaded) / 3
        assert torch.equal(moments["exp_avg"], mean.float())
    assert avg["step"] == 30 and torch.equal(avg["rng"]["torch"], newest["rng"]["torch"])
    with trainstate.open(tmp_path / "avg") as ck:
        meta = ck.metadata
    assert meta["trainstate"]["step"] == 30 and meta["averaged_from"] == [str(p) for p in shuffled]
    model = seeded(Mixed, 1)
    trainstate.load(tmp_path / "avg", {"model": model}, strict=False)  # loads like any checkpoint
    assert same_tensors(model.state_dict(), avg["model"])


def test_the_mean_of_equal_checkpoints_is_exactly_them(tmp_path):
    path = run(tmp_path, (5,))[0]
    trainstate.average([path, path, path], tmp_path / "avg")
    assert same_tensors(
        trainstate.load(tmp_path / "avg", framework="torch")["model"], trainstate.load(path, framework="torch")["model"]
    )


def test_without_recorded_steps_the_last_argument_is_the_newest(tmp_path):
    a, b = (
        {"w": np.float32([1, 2]), "n": np.int64([1]), "epoch": 1},
        {"w": np.float32([3, 6]), "n": np.int64([2]), "epoch": 2},
    )
    trainstate.save(tmp_path / "b", b)
    trainstate.save(tmp_path / "a", a)  # saved later, but the order given decides
    trainstate.average([tmp_path / "a", tmp_path / "b"], tmp_path / "ab")
    back = trainstate.load(tmp_path / "ab")
    assert back["w"].tolist() == [2, 4] and back["n"].tolist() == [2] and back["epoch"] == 2
    with trainstate.open(tmp_path / "ab") as ck:  # inputs without metadata: the mean still says its sources
        assert ck.metadata == {"averaged_from": [str(tmp_path / "a"), str(tmp_path / "b")]}
    trainstate.average([tmp_path / "b", tmp_path / "a"], tmp_path / "ba")
    assert trainstate.load(tmp_path / "ba")["epoch"] == 1


def test_different_states_are_refused_naming_the_tensors(tmp_path):
    base = {"w": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.float32)}
    variants = {
        "shape": {"w": np.zeros((3, 3), np.float32), "b": np.zeros(3, np.float32)},
        "dtype": {"w": np.zeros((2, 3), np.float16), "b": np.zeros(3, np.float32)},
        "missing": {"w": np.zeros((2, 3), np.float32)},
        "extra": {**base, "c": np.zeros(1, np.float32)},
    }
    trainstate.save(tmp_path / "base", base)
    messages = {
        "shape": r"w is F32\[2, 3\] in .*base, F32\[3, 3\] in .*shape",
        "dtype": r"w is F32\[2, 3\] in .*base, F16\[2, 3\] in .*dtype",
        "missing": r"missing lacks b",
        "extra": r"extra has c, which .*base lacks",
    }
    for name, state in variants.items():
        trainstate.save(tmp_path / name, state)
        with pytest.raises(trainstate.InvalidArgumentError, match=messages[name]):
            trainstate.average([tmp_path / "base", tmp_path / name], tmp_path / "out")
    with pytest.raises(trainstate.InvalidArgumentError, match="two or more"):
        trainstate.average([tmp_path / "base"], tmp_path / "out")
    with pytest.raises(trainstate.InvalidArgumentError, match="two or more"):
        trainstate.average(str(tmp_path / "base"), tmp_path / "out")  # type: ignore[arg-type]
    with pytest.raises(trainstate.CheckpointNotFoundError):
        trainstate.average([tmp_path / "base", tmp_path / "nope"], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_average_holds_about_one_tensor_at_a_time(big_checkpoints, tmp_path):
    """Two checkpoints of four 64 MiB weights (512 MiB read): one tensor and a small accumulator."""
    (peak,) = peaks(("average", [list(big_checkpoints), tmp_path / "avg"], {}))
    print(f"average peak: {peak / 2**20:.1f} MiB")
    assert peak < 1.5 * BIG * BIG * 4, peak
    with trainstate.open(tmp_path / "avg") as ck:
        assert ck.read("model.3.weight")[0, 0] == 0.25 * 4.5  # the mean of 0.25 * 4 and 0.25 * 5


def test_cli_average(tmp_path):
    paths = run(tmp_path, (1, 2))
    report = cli_json("average", *map(str, paths), "-o", str(tmp_path / "avg"))
    assert report["sources"] == [str(p) for p in paths] and (tmp_path / "avg" / "manifest.json").exists()
    assert "pass --overwrite" in cli("average", *map(str, paths), "-o", str(tmp_path / "avg"), code=8).stderr
    assert (
        "averaged 2 checkpoints" in cli("average", *map(str, paths), "-o", str(tmp_path / "avg"), "--overwrite").stdout
    )
    assert "required: -o" in cli("average", *map(str, paths), code=2).stderr
    assert cli("average", str(paths[0]), str(tmp_path / "missing"), "-o", str(tmp_path / "x"), code=3)
