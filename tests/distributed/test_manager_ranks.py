"""The CheckpointManager under a process group: decided once, applied on every rank (real gloo ranks)."""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed")

import dist_workers_manager as workers  # noqa: E402
import ranks  # noqa: E402
import trainstate  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is missing")


@pytest.mark.parametrize("async_save", [False, True])
def test_policies_and_retention_are_the_same_on_every_rank_and_restore_latest_resumes_each_rank(tmp_path, async_save):
    out = ranks.ok(ranks.run(2, workers.run_with_retention, str(tmp_path / "run"), async_save))
    for rank, got in enumerate(out):
        assert got["saved"] == [step % 2 == 0 for step in range(10)]
        assert got["listed"] == [6, 8]  # keep_last=2, as rank 0 applied it
        assert got["history"] == [(s, None) for s in (0, 2, 4, 6, 8)]
        assert got["start"] == 9
        assert np.array_equal(got["weight"], np.full((64, 64), 8.0, np.float32))
        assert np.array_equal(got["mine"], np.full(1024, rank + 8.0, np.float32))  # its own value
        assert got["rng_next"] == got["expected_rng_next"]  # its own RNG stream came back
    assert out[0]["rng_next"] != out[1]["rng_next"]
    assert sorted(os.listdir(tmp_path / "run")) == [".trainstate.lock", "_history", "step_00000006", "step_00000008"]
    # one record per save, rank 0's: the run's history as one process would have written it
    fates = [(e.step, e.status, e.background) for e in trainstate.history(tmp_path / "run")]
    assert fates == [(s, "deleted" if s < 6 else "kept", async_save) for s in (0, 2, 4, 6, 8)]
    assert len(os.listdir(tmp_path / "run" / "_history")) == 5


def test_a_preemption_signal_on_one_rank_makes_every_rank_save_that_step_and_stop(tmp_path):
    out = ranks.ok(ranks.run(2, workers.preempted_on_one_rank, str(tmp_path / "run")))
    for got in out:
        assert got["last"] == 3 and got["steps"] == [0, 3]
    assert out[0]["reasons"] == ["every 100 steps", "preemption (signalled on another rank)"]
    assert out[1]["reasons"] == ["every 100 steps", "preemption (SIGUSR1)"]


def test_save_with_different_steps_on_the_ranks_is_refused_on_every_rank(tmp_path):
    out = ranks.run(2, workers.different_steps, str(tmp_path / "run"))
    for got in out:
        assert isinstance(got, ranks.RankError) and got.kind == "InvalidArgumentError", got
        assert "different steps" in got.message
    assert not any(n.startswith("step_") for n in os.listdir(tmp_path / "run"))


@pytest.mark.parametrize("async_save", [False, True])
def test_a_rank_whose_state_cannot_be_saved_fails_that_save_on_every_rank_without_a_hang(tmp_path, async_save):
    out = ranks.ok(ranks.run(2, workers.one_rank_cannot_encode, str(tmp_path / "run"), async_save, timeout=120))
    for rank, got in enumerate(out):
        assert [e[0] for e in got["errors"]] == [2], got
        assert got["errors"][0][1] == ("UnsupportedValueError" if rank == 1 else "DistributedError")
        assert got["steps"] == [0, 4]  # step 2 never committed; the run went on
    assert "rank 1" in out[0]["errors"][0][2]


def test_an_async_save_one_rank_cannot_encode_is_raised_on_every_rank_at_one_step_and_training_goes_on(tmp_path):
    out = ranks.ok(
        ranks.run(2, workers.one_rank_cannot_encode_and_the_loop_goes_on, str(tmp_path / "run"), timeout=150)
    )
    zero, one = ({e[0]: e[1] for e in got["errors"]} for got in out)
    assert one.pop(1) == "UnsupportedValueError", out  # its own error, at once
    assert len(zero) == 1 and zero == one, out  # then one agreed step, the same on both ranks
    assert set(zero.values()) == {"DistributedError"}
    assert not any("lost contact" in e[2] for got in out for e in got["errors"]), out
    later = [e[2] for e in out[1]["errors"] if e[0] != 1]
    assert "step 1" in later[0] and "this rank's state could not be saved" in later[0], later  # not "another"
    assert 1 not in out[0]["steps"] and 5 in out[0]["steps"] and out[0]["steps"] == out[1]["steps"]


def test_restore_latest_moves_every_rank_to_the_older_checkpoint_when_one_rank_cannot_read_its_part(tmp_path):
    directory = tmp_path / "run"
    files = ranks.ok(ranks.run(2, workers.write_two, str(directory)))[0]
    assert files["weight"][0].startswith("data-r00000")  # rank 0 wrote the shared tensor
    mine_1 = [f for name, fs in files.items() if "1" in name.split(".") for f in fs]
    assert mine_1 and all(f.startswith("data-r00001") for f in mine_1)
    for f in mine_1:  # rank 1's own value in the newest checkpoint is damaged; rank 0 reads nothing of it
        path = directory / "step_00000002" / f
        data = bytearray(path.read_bytes())
        data[-5] ^= 0xFF
        path.write_bytes(bytes(data))
    out = ranks.ok(ranks.run(2, workers.restore_skips_what_one_rank_cannot_read, str(directory)))
    for rank, got in enumerate(out):
        assert got["start"] == 2  # both resumed from step 1: the same step everywhere
        assert np.array_equal(got["weight"], np.full((64, 64), 1.0, np.float32))
        assert np.array_equal(got["mine"], np.full(1024, rank + 1.0, np.float32))


def test_a_state_that_does_not_fit_on_one_rank_raises_on_every_rank(tmp_path):
    directory = tmp_path / "run"
    ranks.ok(ranks.run(2, workers.write_two, str(directory)))
    out = ranks.run(2, workers.restore_into_other_structure, str(directory))
    assert isinstance(out[1], ranks.RankError) and out[1].kind == "StateMismatchError", out[1]
    assert isinstance(out[0], ranks.RankError) and out[0].kind == "DistributedError", out[0]
    assert "rank 1" in out[0].message


def test_two_rank_ddp_killed_mid_epoch_resumes_bit_identical(tmp_path):
    """Two DDP ranks with a shuffling, augmenting loader, async saves every 4 steps, SIGKILLed after step 9
    (mid-epoch); the resumed run ends bit-identical to one that never stopped: weights, AdamW moments and
    each rank's RNG. (Augmentation in loader worker processes: tests/test_worker_randomness.py.)"""
    steps, kill_at, workers_per_rank = 16, 9, 0
    args = (steps, -1, True, workers_per_rank)
    ref = ranks.ok(ranks.run(2, workers.ddp_train, str(tmp_path / "ref"), *args, timeout=240))
    killed = ranks.run(2, workers.ddp_train, str(tmp_path / "run"), steps, kill_at, True, workers_per_rank, timeout=240)
    assert killed == ["exit code -9", "exit code -9"], killed
    resumed = ranks.ok(ranks.run(2, workers.ddp_train, str(tmp_path / "run"), *args, timeout=240))
    for rank in range(2):
        assert 0 < resumed[rank]["start"] <= kill_at + 1
        assert resumed[rank]["start"] == resumed[0]["start"]
        for name, value in ref[rank]["model"].items():
            assert np.array_equal(value, resumed[rank]["model"][name]), name
        assert all(np.array_equal(a, b) for a, b in zip(ref[rank]["optim"], resumed[rank]["optim"], strict=True))
        assert ref[rank]["rng_next"] == resumed[rank]["rng_next"]
    assert ref[0]["rng_next"] != ref[1]["rng_next"]


def test_resumable_sampler_splits_each_epoch_over_the_ranks_like_distributed_sampler():
    data = list(range(11))
    parts = [list(trainstate.ResumableSampler(data, seed=3, num_replicas=3, rank=r)) for r in range(3)]
    assert [len(p) for p in parts] == [4, 4, 4]
    assert sorted(set(parts[0] + parts[1] + parts[2])) == data  # every sample, one padded again
    whole = list(trainstate.ResumableSampler(data, seed=3))
    assert parts[0] == (whole + whole)[0:12:3]
    with pytest.raises(trainstate.InvalidArgumentError, match="rank"):
        trainstate.ResumableSampler(data, num_replicas=2, rank=2)


def test_collective_false_gives_each_rank_a_manager_of_its_own(tmp_path):
    out = ranks.ok(ranks.run(2, workers.own_managers, str(tmp_path)))
    assert out == [[3], [4]]
    for rank in range(2):  # plain single-process checkpoints, one directory per rank
        back = trainstate.load(tmp_path / f"rank{rank}" / f"step_0000000{3 + rank}", {"x": torch.zeros(4)})
        assert torch.equal(back["x"], torch.full((4,), float(rank)))


def test_a_closed_manager_gives_back_its_coordination_groups(tmp_path):
    """Each manager under a process group talks over gloo groups of its own (two threads and sockets each):
    closing it destroys them, so a process that makes managers one after another (a sweep, a manager per
    phase) does not pile them up. 30 managers, each with an async save and a restore, on 2 ranks."""
    out = ranks.ok(ranks.run(2, workers.threads_of_many_managers, str(tmp_path), 30))
    for threads in out:
        assert threads[-1] <= threads[4] + 4, threads  # was 6 more threads per manager
