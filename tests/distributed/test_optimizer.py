"""Optimizer state keyed by parameter name, restored into fresh optimizers at any world size; a 2-D mesh.

The real check that optimizer state came back right: one more training step after the restore, compared
bit for bit with the run that never stopped (dist_workers_optim.py explains why runs on different world
sizes can be compared exactly).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed")

import dist_workers_optim as workers  # noqa: E402
import ranks  # noqa: E402
import trainstate  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is missing")

NAMES = ["model.0.weight", "model.0.bias", "model.2.weight", "model.2.bias"]
POSITIONAL = Path(__file__).parent.parent / "fixtures" / "v1.0" / "positional-optimizer"


def _same(got: dict, want: dict) -> None:
    values = [k for k in want if k not in ("kinds", "lr")]
    assert sorted(k for k in got if k not in ("kinds", "lr")) == sorted(values)
    different = [k for k in values if not np.array_equal(got[k], want[k])]
    assert not different, f"differ: {different}"
    assert got["lr"] == want["lr"]


def _optim_node(path: Path) -> dict:
    body = json.loads((path / "manifest.json").read_bytes())
    (node,) = [v for k, v in body["tree"]["v"] if k == "optim"]
    return dict(node["v"]["v"])  # the stateful node's state: {"state": ..., "param_groups": ...}


def _plain_run(steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = workers.model()
    optim = workers.adamw(model)
    for i in range(steps):
        workers.step(model, optim, i)
    return model, optim


def test_optimizer_state_is_saved_by_parameter_name_and_a_fresh_optimizer_resumes_bit_identically(tmp_path):
    model, optim = _plain_run(2)
    trainstate.save(tmp_path / "c", {"model": model, "optim": optim, "step": 2})
    workers.step(model, optim, 2)
    uninterrupted = workers.snapshot(model, optim)

    node = _optim_node(tmp_path / "c")
    assert [k for k, _ in node["state"]["v"]] == NAMES
    (group,) = node["param_groups"]["v"]
    assert [dict(group["v"])["params"]["v"]] == [NAMES]
    with trainstate.open(tmp_path / "c") as ck:
        assert {f"optim.state.{n}.{k}" for n in NAMES for k in ("exp_avg", "exp_avg_sq", "step")} <= set(ck.keys())

    fresh = workers.model(seed=123)
    fresh_optim = workers.adamw(fresh)  # no state at all: no warm-up step before the load
    trainstate.load(tmp_path / "c", {"model": fresh, "optim": fresh_optim, "step": 0})
    workers.step(fresh, fresh_optim, 2)
    _same(workers.snapshot(fresh, fresh_optim), uninterrupted)


def test_fsdp2_on_2_ranks_resumes_on_2_ranks_and_in_one_plain_process_bit_identically(tmp_path):
    path = tmp_path / "c"
    uninterrupted = ranks.ok(ranks.run(2, workers.fsdp_train_save_and_go_on, str(path)))
    assert uninterrupted[0]["kinds"] == ["DTensor"]
    _same(uninterrupted[1], uninterrupted[0])
    assert [k for k, _ in _optim_node(path)["state"]["v"]] == NAMES
    chunks = json.loads((path / "manifest.json").read_bytes())["tensors"]["optim.state.model.0.weight.exp_avg"][
        "chunks"
    ]
    assert sorted(c["file"].split("-")[1] for c in chunks) == ["r00000", "r00001"]  # each rank wrote its shard
    for rank in ranks.ok(ranks.run(2, workers.fsdp_restore_and_step, str(path))):
        assert rank["restored"]["kinds"] == ["DTensor"]  # a fresh FSDP2 optimizer gets DTensors, not plain tensors
        _same(rank["stepped"], uninterrupted[0])

    model = workers.model(seed=123)  # one plain process, no process group: a plain module, a fresh AdamW
    optim = workers.adamw(model)
    trainstate.load(path, {"model": model, "optim": optim, "step": 0})
    assert workers.snapshot(model, optim)["kinds"] == ["Tensor"]
    workers.step(model, optim, 2)
    _same(workers.snapshot(model, optim), uninterrupted[0])


def test_one_plain_process_resumes_on_2_fsdp2_ranks_bit_identically(tmp_path):
    model, optim = _plain_run(2)
    trainstate.save(tmp_path / "c", {"model": model, "optim": optim, "step": 2})
    workers.step(model, optim, 2)
    uninterrupted = workers.snapshot(model, optim)
    for rank in ranks.ok(ranks.run(2, workers.fsdp_restore_and_step, str(tmp_path / "c"))):
        assert rank["restored"]["kinds"] == ["DTensor"]
        _same(rank["stepped"], uninterrupted)


def test_parameter_names_that_do_not_match_are_reported_and_change_nothing(tmp_path):
    model, optim = _plain_run(2)
    trainstate.save(tmp_path / "c", {"model": model, "optim": optim, "step": 2})
    torch.manual_seed(5)
    other = torch.nn.ModuleDict({"enc": torch.nn.Linear(16, 64), "dec": torch.nn.Linear(64, 32)})
    other_optim = workers.adamw(other)
    before = [p.detach().clone() for p in other.parameters()]
    with pytest.raises(trainstate.StateMismatchError) as err:
        trainstate.load(tmp_path / "c", {"model": other, "optim": other_optim, "step": 0})
    e = err.value
    assert {"optim.state.model.enc.weight", "optim.state.model.dec.bias"} <= set(e.missing)
    assert {"optim.state.model.0.weight", "optim.state.model.2.bias"} <= set(e.unexpected)
    assert "optim.state.model.enc.weight" in str(e)
    assert not other_optim.state  # the restore stopped before reading: the optimizer is as it was
    assert all(torch.equal(a, b) for a, b in zip(before, other.parameters()))


def test_non_strict_restores_the_parameters_whose_names_match(tmp_path):
    model, optim = _plain_run(2)
    trainstate.save(tmp_path / "c", {"model": model, "optim": optim, "step": 2})
    torch.manual_seed(5)
    grown = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
    )
    grown_optim = workers.adamw(grown)
    trainstate.load(tmp_path / "c", {"model": grown, "optim": grown_optim, "step": 0}, strict=False)
    for i in (0, 2):
        for p, q in ((grown[i].weight, model[i].weight), (grown[i].bias, model[i].bias)):
            for k in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(grown_optim.state[p][k], optim.state[q][k])
    assert not grown_optim.state.get(grown[4].weight)  # missing from the checkpoint: no state, as if fresh
    grown(torch.randn(2, 16)).sum().backward()
    grown_optim.step()
    assert int(grown_optim.state[grown[4].weight]["step"]) == 1 and int(grown_optim.state[grown[0].weight]["step"]) == 3


def test_saving_an_optimizer_that_has_not_stepped_changes_nothing(tmp_path):
    model = workers.model()
    optim = workers.adamw(model)
    before = [p.detach().clone() for p in model.parameters()]
    trainstate.save(tmp_path / "c", {"model": model, "optim": optim})
    assert not optim.state and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    node = _optim_node(tmp_path / "c")
    assert node["state"]["v"] == [] and [dict(g["v"])["params"]["v"] for g in node["param_groups"]["v"]] == [NAMES]
    fresh = workers.model(seed=123)
    fresh_optim = workers.adamw(fresh)
    trainstate.load(tmp_path / "c", {"model": fresh, "optim": fresh_optim})
    assert not fresh_optim.state
    for i in range(2):
        workers.step(model, optim, i)
        workers.step(fresh, fresh_optim, i)
    _same(workers.snapshot(fresh, fresh_optim), workers.snapshot(model, optim))


def test_an_optimizer_whose_step_needs_a_closure_is_restored_by_name(tmp_path):
    """DCP initializes a fresh optimizer with step(closure=None), which LBFGS refuses."""

    def run(model, optim):
        def closure():
            optim.zero_grad()
            loss = model(torch.ones(4, 16)).pow(2).mean()
            loss.backward()
            return loss

        optim.step(closure)

    model = workers.model()
    optim = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3)
    run(model, optim)
    trainstate.save(tmp_path / "c", {"model": model, "optim": optim})
    fresh = workers.model(seed=123)
    fresh_optim = torch.optim.LBFGS(fresh.parameters(), lr=0.1, max_iter=3)
    trainstate.load(tmp_path / "c", {"model": fresh, "optim": fresh_optim})
    assert fresh_optim.param_groups[0]["lr"] == 0.1
    run(model, optim)
    run(fresh, fresh_optim)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))


def test_a_position_keyed_checkpoint_still_loads_in_one_process_and_on_2_fsdp2_ranks(tmp_path):
    with trainstate.open(POSITIONAL) as ck:
        assert "optim.state.0.exp_avg" in ck.keys()  # written before names (make_positional_optimizer.py)
        want = {f"{n}:{k}": ck.read(f"optim.state.{i}.{k}") for i, n in enumerate(NAMES) for k in ("exp_avg", "step")}
        want.update({n: ck.read(f"model.{n.removeprefix('model.')}") for n in NAMES})
    torch.manual_seed(123)
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.ReLU(), torch.nn.Linear(24, 5))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    trainstate.load(POSITIONAL, {"model": model, "optim": optim, "step": 0})
    got = workers.snapshot(model, optim)
    assert all(np.array_equal(got[k.removeprefix("model.")], v) for k, v in want.items())
    for rank in ranks.ok(ranks.run(2, workers.fsdp_restore, str(POSITIONAL))):
        assert rank["kinds"] == ["DTensor"] and rank["step_ok"]
        assert all(np.array_equal(rank[k.removeprefix("model.")], v) for k, v in want.items())


def test_a_2d_fsdp_tp_checkpoint_restores_on_a_1d_mesh_and_in_one_plain_process(tmp_path):
    path = tmp_path / "c"
    saved = ranks.ok(ranks.run(4, workers.tp_train_save, str(path)))
    placements = saved[0]["placements"]
    assert "_StridedShard" in placements["0.weight"] and "Shard(dim=1)" in placements["2.weight"]
    values = saved[0]["values"]
    assert values["kinds"] == ["DTensor"]
    with trainstate.open(path) as ck:
        assert ck.info("model.0.weight").chunks == 4 and ck.info("model.2.bias").chunks == 2  # replicated over tp
    for rank in ranks.ok(ranks.run(2, workers.fsdp_restore_tp_model, str(path))):
        assert rank["kinds"] == ["DTensor"]
        _same(rank, values)
    model = workers.tp_model(seed=123)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    trainstate.load(path, {"model": model, "optim": optim, "step": 0})
    _same(workers.snapshot(model, optim), values)


def test_a_shard_that_is_not_one_box_is_refused_on_save_and_on_load(tmp_path):
    path = tmp_path / "c"
    results = ranks.run(4, workers.strided_rows, str(path), "save")
    assert all(isinstance(r, ranks.RankError) for r in results), results
    assert all(r.kind == "UnsupportedValueError" and "not one contiguous box" in r.message for r in results), results
    assert not path.exists()
    trainstate.save(path, {"w": torch.arange(16.0).reshape(8, 2)})
    results = ranks.run(4, workers.strided_rows, str(path), "load")
    assert all(isinstance(r, ranks.RankError) for r in results), results
    assert all(r.kind == "UnsupportedValueError" and r.message.startswith("w: ") for r in results), results
