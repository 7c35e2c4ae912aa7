"""Collective save and restore on real gloo process groups (2 and 4 spawned ranks on loopback)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed")

import dist_workers as workers  # noqa: E402
import ranks  # noqa: E402
import trainstate  # noqa: E402
from trainstate._format.run_dir import is_staging_name  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is missing")


def _same(a, b):
    return all(np.array_equal(a[k], b[k]) for k in b if k != "optim") and all(
        np.array_equal(a["optim"][k], b["optim"][k]) for k in b["optim"]
    )


def test_replicated_state_is_written_once_spread_over_ranks_and_per_rank_values_come_back_to_their_rank(tmp_path):
    path = str(tmp_path / "c")
    saved = ranks.ok(ranks.run(2, workers.replicated_save, path))
    body = json.loads((tmp_path / "c" / "manifest.json").read_bytes())
    writers = {c["file"].split("-")[1] for t in body["tensors"].values() for c in t["chunks"]}
    assert writers == {"r00000", "r00001"}  # both ranks wrote a share
    assert all(len(t["chunks"]) == 1 for t in body["tensors"].values())  # replicated: once
    back = ranks.ok(ranks.run(2, workers.replicated_load, path))
    for rank in range(2):
        assert np.array_equal(back[rank]["weight"], saved[rank]["weight"])
        assert back[rank]["step"] == 7 and back[rank]["mine"] == {"rank": rank}
        assert np.array_equal(back[rank]["draw_next"], saved[rank]["draw_next"])  # its own RNG stream
    assert not np.array_equal(saved[0]["draw_next"], saved[1]["draw_next"])


def test_fsdp2_save_on_4_restores_on_4_on_2_and_in_one_plain_process_into_fresh_optimizers(tmp_path):
    path = str(tmp_path / "c")
    saved = ranks.ok(ranks.run(4, workers.fsdp_save, path))[0]
    names = sorted(os.listdir(path))
    assert [n for n in names if n.startswith("data-r")] and "manifest.json" in names
    with trainstate.open(path) as ck:
        assert ck.info("model.0.weight").chunks == 4 and ck.info("model.0.weight").shape == (24, 16)
    for world in (4, 2):
        assert all(_same(g, saved) for g in ranks.ok(ranks.run(world, workers.fsdp_load, path)))
    torch.manual_seed(123)
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.ReLU(), torch.nn.Linear(24, 5))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    trainstate.load(path, {"model": model, "optim": optim, "step": 0})
    got = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    got["optim"] = {f"{i}.{k}": v.numpy() for i, s in optim.state_dict()["state"].items() for k, v in s.items()}
    assert _same(got, saved)


def test_a_shard_saved_by_its_rank_alone_is_refused_not_committed_as_a_whole_tensor(tmp_path):
    got = ranks.ok(ranks.run(2, workers.fsdp_save_alone, str(tmp_path / "c")))
    for rank in range(2):
        refused = got[rank]["refused"]
        assert refused.startswith("UnsupportedValueError: model.0.weight: this process holds only part of it")
        assert "collective=False" in refused
        assert not (tmp_path / f"c-{rank}").exists()


def test_a_one_process_checkpoint_restores_into_fsdp2_on_2_ranks(tmp_path):
    path = str(tmp_path / "c")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.ReLU(), torch.nn.Linear(24, 5))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(8, 16)).sum().backward()
    optim.step()
    trainstate.save(path, {"model": model, "optim": optim, "step": 1})
    want = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    want["optim"] = {f"{i}.{k}": v.numpy() for i, s in optim.state_dict()["state"].items() for k, v in s.items()}
    assert all(_same(g, want) for g in ranks.ok(ranks.run(2, workers.plain_to_fsdp_load, path)))


def test_a_rank_that_fails_before_writing_fails_every_rank_and_commits_nothing(tmp_path):
    path = tmp_path / "c"
    results = ranks.run(2, workers.one_rank_fails_to_encode, str(path))
    assert all(isinstance(r, ranks.RankError) for r in results), results
    assert "cannot be read" in results[1].message
    assert results[0].kind == "DistributedError" and "rank 1" in results[0].message
    assert not path.exists() and not [p for p in tmp_path.iterdir() if is_staging_name(p.name)]


def test_a_save_on_one_rank_only_is_a_distributed_error_that_names_the_fix(tmp_path):
    """``if rank == 0: trainstate.save(...)``: was torch's raw DistStoreError from making the group."""
    results = ranks.run(2, workers.save_on_rank_0_only, str(tmp_path / "c"), timeout=120)
    assert results[1] == "skipped" and isinstance(results[0], ranks.RankError), results
    assert results[0].kind == "DistributedError" and "collective=False" in results[0].message, results[0]
    assert not (tmp_path / "c").exists()


def test_a_rank_that_dies_while_writing_leaves_no_checkpoint_and_the_others_raise_within_the_timeout(tmp_path):
    path = tmp_path / "c"
    results = ranks.run(2, workers.one_rank_dies_while_writing, str(path), timeout=120)
    assert results[1] == "exit code 17", results
    assert isinstance(results[0], ranks.RankError) and results[0].kind == "DistributedError", results
    assert not path.exists()  # nothing committed; the staging directory is the sweep's (docs/distributed.md)


def test_plain_values_that_differ_between_ranks_are_refused_naming_the_key(tmp_path):
    results = ranks.run(2, workers.structure_differs, str(tmp_path / "c"))
    assert all(isinstance(r, ranks.RankError) for r in results), results
    assert all("'lr'" in r.message and "PerRank" in r.message for r in results)
    assert not (tmp_path / "c").exists()


def test_per_rank_values_at_another_world_size_are_a_clear_error_and_generators_are_re_derived(tmp_path):
    path = str(tmp_path / "c")
    ranks.ok(ranks.run(2, workers.replicated_save, path))
    torch.manual_seed(5)
    mine = trainstate.PerRank({"rank": -1})
    with pytest.raises(trainstate.StateMismatchError, match="saved by 2 ranks") as info:
        trainstate.load(path, {"model": torch.nn.Linear(64, 32), "step": 0, "mine": mine}, strict=False)
    assert "world size" in str(info.value)
    # an RNGState has a rule for another world size: seeded from (its seed, the step, this rank)
    trainstate.load(
        path, {"model": torch.nn.Linear(64, 32), "step": 0, "rng": trainstate.RNGState(seed=9)}, strict=False
    )
    got = torch.rand(3)
    trainstate.RNGState(seed=9).rederive(rank=0, step=0)  # a plain save records no step: 0
    assert torch.equal(torch.rand(3), got)
    trainstate.load(path, {"model": torch.nn.Linear(64, 32), "step": 0}, strict=False)  # without them: fine
    assert trainstate.load(path)["mine"] == {"0": {"rank": 0}, "1": {"rank": 1}}  # no target: every rank's
