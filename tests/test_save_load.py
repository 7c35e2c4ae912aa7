"""save / load / open on real torch training state: in place, strict, partial, shared, devices."""

from __future__ import annotations

import os

import numpy as np
import pytest

import trainstate
from helpers import assert_same, fresh_like, make_training_state

torch = pytest.importorskip("torch")


def _params_equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_in_place_restore_of_a_training_state(tmp_path, training_state):
    trainstate.save(tmp_path / "c", training_state, metadata={"run": "exp1"})
    target = fresh_like()
    ptrs = [p.data_ptr() for p in target["model"].parameters()]
    trainstate.load(tmp_path / "c", target)
    assert _params_equal(training_state["model"], target["model"])
    assert [p.data_ptr() for p in target["model"].parameters()] == ptrs  # filled in place
    assert target["step"] == training_state["step"]
    assert target["sched"].state_dict() == training_state["sched"].state_dict()
    assert_same(training_state["optim"].state_dict()["state"], target["optim"].state_dict()["state"])
    assert target["optim"].state_dict()["param_groups"] == training_state["optim"].state_dict()["param_groups"]


def test_resumed_training_matches_uninterrupted(tmp_path):
    """Save mid-run, restore into a fresh process-like state, and the next steps are bit-identical."""
    a = make_training_state(steps=3)
    trainstate.save(tmp_path / "c", a)
    b = fresh_like()
    trainstate.load(tmp_path / "c", b)
    for s in (a, b):
        for _ in range(3):
            s["model"].train()
            loss = s["model"](torch.randn(8, 6)).pow(2).mean()  # dropout + data draw from the restored RNG
            s["optim"].zero_grad()
            loss.backward()
            s["optim"].step()
            s["sched"].step()
        if s is a:
            trainstate.load(tmp_path / "c", {"rng": a["rng"]}, strict=False, include="rng.*")
    assert _params_equal(a["model"], b["model"])


def test_optimizer_state_is_keyed_by_parameter_name_and_keeps_tuples(tmp_path, training_state):
    trainstate.save(tmp_path / "c", training_state)
    tree = trainstate.load(tmp_path / "c")
    names = ["model.0.weight", "model.0.bias", "model.3.weight", "model.3.bias"]
    assert list(tree["optim"]["state"]) == names  # its model is in the state: keyed by parameter name
    assert isinstance(tree["optim"]["param_groups"][0]["betas"], tuple)
    assert tree["optim"]["param_groups"][0]["params"] == names
    assert type(tree["step"]) is int and type(tree["optim"]["param_groups"][0]["lr"]) is float
    assert isinstance(tree["model"]["0.weight"], np.ndarray)


def test_an_optimizer_without_its_model_keeps_int_keys(tmp_path, training_state):
    trainstate.save(tmp_path / "c", {"optim": training_state["optim"]})
    tree = trainstate.load(tmp_path / "c")
    assert sorted(tree["optim"]["state"]) == [0, 1, 2, 3]
    assert tree["optim"]["param_groups"][0]["params"] == [0, 1, 2, 3]
    assert isinstance(tree["optim"]["param_groups"][0]["betas"], tuple)


def test_tied_weights_are_written_once_and_come_back_shared(tmp_path):
    emb = torch.nn.Embedding(100, 16)
    head = torch.nn.Linear(16, 100, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    trainstate.save(tmp_path / "c", {"model": model})
    with trainstate.open(tmp_path / "c") as ck:
        assert ck.keys() == ["model.emb.weight"]
        assert ck.nbytes < 100 * 16 * 4 * 2
    tree = trainstate.load(tmp_path / "c")
    assert tree["model"]["emb.weight"] is tree["model"]["head.weight"]
    target = torch.nn.ModuleDict({"emb": torch.nn.Embedding(100, 16), "head": torch.nn.Linear(16, 100, bias=False)})
    target["head"].weight = target["emb"].weight
    trainstate.load(tmp_path / "c", {"model": target})
    assert torch.equal(target["emb"].weight, emb.weight) and target["head"].weight is target["emb"].weight


def test_strict_reports_every_problem_at_once_and_changes_nothing(tmp_path, training_state):
    trainstate.save(tmp_path / "c", training_state)
    target = fresh_like()
    target["model"] = torch.nn.Sequential(
        torch.nn.Linear(6, 17), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(17, 3)
    )
    del target["epoch"]
    target["extra"] = 5
    before = [p.clone() for p in target["model"].parameters()]
    with pytest.raises(trainstate.StateMismatchError) as err:
        trainstate.load(tmp_path / "c", target)
    e = err.value
    assert e.missing == ["extra"] and e.unexpected == ["epoch"]
    assert {m[0] for m in e.mismatched} >= {"model.0.weight", "model.0.bias", "model.3.weight"}
    assert "model.0.weight" in str(e) and "epoch" in str(e)
    assert all(torch.equal(a, b) for a, b in zip(before, target["model"].parameters()))


def test_partial_restore_with_include_and_exclude(tmp_path, training_state):
    trainstate.save(tmp_path / "c", training_state)
    target = fresh_like()
    optim_before = target["optim"].state_dict()
    trainstate.load(tmp_path / "c", target, include="model.*")
    assert _params_equal(training_state["model"], target["model"])
    assert target["optim"].state_dict()["state"] == optim_before["state"] == {}
    assert target["step"] == 0
    target = fresh_like()
    w0 = target["model"][0].weight.clone()
    trainstate.load(tmp_path / "c", target, include="model.*", exclude="model.0.*")
    assert torch.equal(target["model"][0].weight, w0)
    assert torch.equal(target["model"][3].weight, training_state["model"][3].weight)


def test_non_strict_ignores_missing_and_unexpected(tmp_path):
    trainstate.save(tmp_path / "c", {"a": torch.ones(3), "b": 1})
    target = {"a": torch.zeros(3), "c": 2}
    trainstate.load(tmp_path / "c", target, strict=False)
    assert torch.equal(target["a"], torch.ones(3)) and target == {"a": target["a"], "c": 2}


def test_dtype_mismatch_is_an_error_when_strict_and_a_cast_otherwise(tmp_path):
    trainstate.save(tmp_path / "c", {"w": torch.arange(4.0)})
    with pytest.raises(trainstate.StateMismatchError, match="F32"):
        trainstate.load(tmp_path / "c", {"w": torch.zeros(4, dtype=torch.float64)})
    target = {"w": torch.zeros(4, dtype=torch.float64)}
    trainstate.load(tmp_path / "c", target, strict=False)
    assert target["w"].dtype == torch.float64 and target["w"].tolist() == [0, 1, 2, 3]


def test_non_contiguous_target_is_filled(tmp_path):
    src = torch.arange(12.0).reshape(3, 4)
    trainstate.save(tmp_path / "c", {"w": src.t()})
    base = torch.zeros(3, 4)
    target = {"w": base.t()}
    trainstate.load(tmp_path / "c", target)
    assert torch.equal(base, src) and target["w"].data_ptr() == base.data_ptr()


def test_overwrite_is_refused_unless_asked(tmp_path):
    trainstate.save(tmp_path / "c", {"x": 1})
    with pytest.raises(trainstate.CheckpointExistsError):
        trainstate.save(tmp_path / "c", {"x": 2})
    assert trainstate.load(tmp_path / "c") == {"x": 1}
    trainstate.save(tmp_path / "c", {"x": 2}, overwrite=True)
    assert trainstate.load(tmp_path / "c") == {"x": 2}
    assert sorted(os.listdir(tmp_path)) == ["c"]  # no staging leftovers


def test_a_foreign_directory_is_never_replaced(tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "notes.txt").write_text("precious")
    with pytest.raises(trainstate.CheckpointExistsError):
        trainstate.save(tmp_path / "c", {"x": 1}, overwrite=True)
    assert (tmp_path / "c" / "notes.txt").read_text() == "precious"


def test_open_is_lazy_and_reads_one_tensor(tmp_path, training_state):
    trainstate.save(tmp_path / "c", training_state, metadata={"run": "exp1", "lr": 0.01})
    with trainstate.open(tmp_path / "c") as ck:
        assert ck.metadata == {"run": "exp1", "lr": 0.01}
        assert "model.0.weight" in ck.keys() and "optim.state.model.0.weight.exp_avg" in ck.keys()
        info = ck.info("model.0.weight")
        assert (info.dtype, info.shape, info.nbytes) == ("F32", (16, 6), 16 * 6 * 4)
        w = ck.read("model.0.weight")
        assert isinstance(w, np.ndarray) and not w.flags.writeable  # memory-mapped, read-only
        assert np.array_equal(w, training_state["model"][0].weight.detach().numpy())
        t = ck.read("model.0.weight", framework="torch")
        assert torch.equal(t, training_state["model"][0].weight)
        with pytest.raises(KeyError, match="nope"):
            ck.read("nope")


def test_unsupported_values_are_refused_before_writing(tmp_path):
    with pytest.raises(trainstate.UnsupportedValueError, match="object"):
        trainstate.save(tmp_path / "c", {"f": object()})
    with pytest.raises(trainstate.UnsupportedValueError):
        trainstate.save(tmp_path / "c", {"s": torch.ones(3).to_sparse()})
    with pytest.raises(trainstate.UnsupportedValueError):
        trainstate.save(tmp_path / "c", {"x": 1}, metadata={"w": np.ones(2)})
    assert not os.listdir(tmp_path) or os.listdir(tmp_path) == []


@pytest.mark.filterwarnings("ignore:.*quantized tensor creation functions.*:UserWarning")
@pytest.mark.parametrize(
    "make",
    [
        lambda w: torch.quantize_per_tensor(w, 0.1, 3, torch.qint8),
        lambda w: torch.quantize_per_channel(w, torch.tensor([0.1, 0.2]), torch.tensor([0, 1]), 0, torch.quint8),
    ],
)
def test_quantized_tensors_are_refused_with_what_to_do(tmp_path, make):
    q = make(torch.randn(2, 3))
    with pytest.raises(trainstate.UnsupportedValueError) as err:
        trainstate.save(tmp_path / "c", {"model": {"fc.weight": q}, "step": 1})
    message = str(err.value)
    assert message.startswith("model.fc.weight: ")  # which value it was
    assert "quantized" in message and "layout" not in message
    assert "dequantize()" in message and "int_repr()" in message  # what to store instead
    assert not (tmp_path / "c").exists()
    # following the advice works: the integer values and the scale round-trip exactly
    trainstate.save(tmp_path / "c", {"w": q.dequantize(), "w_int": q.int_repr()})
    back = trainstate.load(tmp_path / "c", framework="torch")
    assert torch.equal(back["w"], q.dequantize()) and torch.equal(back["w_int"], q.int_repr())


def test_grad_scaler_and_user_stateful(tmp_path):
    class Counter:
        def __init__(self) -> None:
            self.n = 0
            self.hist = np.zeros(3)

        def state_dict(self):
            return {"n": self.n, "hist": self.hist}

        def load_state_dict(self, sd):
            self.n, self.hist = sd["n"], sd["hist"]

    c = Counter()
    c.n, c.hist = 7, np.arange(3.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    trainstate.save(tmp_path / "c", {"counter": c, "scaler": scaler})
    c2, scaler2 = Counter(), torch.amp.GradScaler("cpu", init_scale=1.0)
    trainstate.load(tmp_path / "c", {"counter": c2, "scaler": scaler2})
    assert c2.n == 7 and np.array_equal(c2.hist, np.arange(3.0))
    assert scaler2.state_dict() == scaler.state_dict()


def test_stateful_dataloader_position(tmp_path):
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    data = list(range(20))
    loader = sdl.StatefulDataLoader(data, batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(0))
    it = iter(loader)
    seen = [next(it) for _ in range(3)]
    trainstate.save(tmp_path / "c", {"loader": loader})
    rest = [b.tolist() for b in it]
    loader2 = sdl.StatefulDataLoader(data, batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(0))
    trainstate.load(tmp_path / "c", {"loader": loader2})
    assert [b.tolist() for b in loader2] == rest and len(seen) == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_tensors_keep_their_device(tmp_path):  # pragma: no cover - GPU only
    model = torch.nn.Linear(4, 4).cuda()
    trainstate.save(tmp_path / "c", {"m": model})
    target = torch.nn.Linear(4, 4).cuda()
    trainstate.load(tmp_path / "c", {"m": target})
    assert target.weight.device.type == "cuda" and torch.equal(target.weight, model.weight)


def test_tied_in_the_checkpoint_but_separate_in_the_target(tmp_path):
    w = np.arange(4, dtype=np.float32)
    trainstate.save(tmp_path / "c", {"a": w, "b": w})
    x, y = np.zeros(4, np.float32), np.zeros(4, np.float32)
    target = {"a": x, "b": y}
    trainstate.load(tmp_path / "c", target)
    assert target["a"] is x and target["b"] is y and (x == w).all() and (y == w).all()
    with pytest.raises(trainstate.StateMismatchError, match="b"):
        trainstate.load(tmp_path / "c", {"a": np.zeros(4, np.float32), "b": np.zeros((2, 2))})


@pytest.mark.parametrize("wrap", ["DataParallel", "compile"])
def test_a_wrapped_model_is_saved_as_the_model_and_loads_into_either(tmp_path, wrap):
    """DDP / DataParallel add ``module.`` and torch.compile ``_orig_mod.`` to state_dict names; the optimizer's
    names (from torch's helpers) never had them. A checkpoint of a wrapped run must load into the bare model
    (single-process evaluation of a DDP run) and the other way round, and the state keeps its wrapper."""

    def wrapped(m: torch.nn.Module) -> torch.nn.Module:
        return torch.nn.DataParallel(m) if wrap == "DataParallel" else torch.compile(m)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    optim.step()
    state = {"model": wrapped(model), "optim": optim}
    trainstate.save(tmp_path / "w", state)
    with trainstate.open(tmp_path / "w") as ck:
        names = set(ck.keys())
    assert "model.0.weight" in names and not any("module." in n or "_orig_mod" in n for n in names), names

    bare = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    bare_optim = torch.optim.AdamW(bare.parameters(), lr=0.1)
    trainstate.load(tmp_path / "w", {"model": bare, "optim": bare_optim})  # strict: every name matches
    assert torch.equal(bare[0].weight, model[0].weight.cpu())  # DataParallel moves the model to a GPU if any
    assert torch.equal(bare_optim.state[bare[0].weight]["exp_avg"], optim.state[model[0].weight]["exp_avg"].cpu())

    trainstate.save(tmp_path / "b", {"model": bare, "optim": bare_optim})
    again = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    target = {"model": wrapped(again), "optim": torch.optim.AdamW(again.parameters(), lr=0.1)}
    out = trainstate.load(tmp_path / "b", target)
    assert out["model"] is target["model"] and torch.equal(again[1].bias.cpu(), model[1].bias.cpu())


def test_a_checkpoint_with_wrapper_prefixed_names_still_loads_into_the_bare_model(tmp_path):
    """Checkpoints written before wrapped models were saved as the model they wrap hold ``model.module.*``
    (here made with a module whose one child is called ``module``, as DDP's is)."""

    class Holder(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.module = inner

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    trainstate.save(tmp_path / "old", {"model": Holder(model)})
    bare = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    trainstate.load(tmp_path / "old", {"model": bare})
    assert torch.equal(bare[1].weight, model[1].weight)
    held = Holder(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)))
    trainstate.load(tmp_path / "old", {"model": held})  # a module whose own names carry the prefix: kept
    assert torch.equal(held.module[0].bias, model[0].bias)
