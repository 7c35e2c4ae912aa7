"""The global sample stream (issue 29): one order per epoch, global batches, rank slices, a global position."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import trainstate
from trainstate._sample_stream import SampleStream, cut


def test_a_global_batch_of_32_on_3_ranks_is_cut_11_11_10_in_order():
    stream = SampleStream(100, 32, seed=3)
    whole = stream.order(0)[:32].tolist()
    parts = [stream.share(0, 0, r, 3) for r in range(3)]
    assert [len(p[0]) for p in parts] == [11, 11, 10]
    assert [i for p in parts for i in p[0].tolist()] == whole
    # micro-batches cut each rank's slice the same way: 11 -> 6, 5
    assert [len(m) for m in stream.share(0, 0, 0, 3, 2)] == [6, 5]
    assert [cut(10, 4, i) for i in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]


def test_the_tail_is_padded_with_the_first_samples_or_dropped():
    padded = SampleStream(100, 32, seed=1)
    order = padded.order(0)
    assert padded.batches == 4 and len(order) == 128
    assert sorted(set(order.tolist())) == list(range(100))
    assert order[100:].tolist() == order[:28].tolist()
    dropped = SampleStream(100, 32, seed=1, drop_last=True)
    assert dropped.batches == 3 and dropped.order(0).tolist() == order[:96].tolist()
    assert SampleStream(100, 32, seed=1).order(1).tolist() != order.tolist()  # a new shuffle each epoch
    assert SampleStream(10, 4, shuffle=False).order(0).tolist() == [*range(10), 0, 1]


def test_a_split_that_leaves_a_rank_empty_and_impossible_streams_are_refused():
    with pytest.raises(trainstate.InvalidArgumentError, match="at least 8"):
        trainstate.GlobalBatches(100, global_batch_size=6, world_size=4, micro_batches=2)
    with pytest.raises(trainstate.InvalidArgumentError, match="every epoch would be empty"):
        SampleStream(10, 16, drop_last=True)
    with pytest.raises(trainstate.InvalidArgumentError):
        trainstate.GlobalBatches(100, global_batch_size=8, rank=2, world_size=2)


def _consume(batches: trainstate.GlobalBatches, n: int) -> list[int]:
    out = []
    for part in batches:
        out += part.tolist()
        n -= 1
        if n == 0:
            break
    return out


def test_global_batches_resume_on_another_world_size_continue_the_same_stream():
    total, g = 60, 12
    stream = SampleStream(total, g, seed=5)
    four = [trainstate.GlobalBatches(total, global_batch_size=g, seed=5, rank=r, world_size=4) for r in range(4)]
    seen = [i for b in four for i in _consume(b, 2)]  # two global batches on 4 ranks
    saved = four[0].state_dict()
    assert all(b.state_dict() == saved for b in four)  # one global position, the same on every rank
    assert saved["batches"] == 2 and saved["samples"] == 24 and saved["world_size"] == 4
    three = [
        trainstate.GlobalBatches(total, global_batch_size=g, seed=5, rank=r, world_size=3, micro_batches=2)
        for r in range(3)
    ]
    for b in three:
        b.load_state_dict(saved)
    rest = [[i for part in b for i in part.tolist()] for b in three]  # to the end of the epoch
    per_batch = [[i for r in range(3) for i in rest[r][k * 4 : (k + 1) * 4]] for k in range(3)]
    got = sorted(seen) + [i for batch in per_batch for i in batch]
    assert sorted(got) == list(range(total)) and len(got) == total
    assert [i for batch in per_batch for i in batch] == stream.order(0)[24:].tolist()
    assert all(b.epoch == 1 and b.state_dict()["batches"] == 0 for b in three)


def test_a_resume_that_changes_the_global_batch_or_the_dataset_is_refused():
    saved = trainstate.GlobalBatches(60, global_batch_size=12).state_dict()
    for other in (
        trainstate.GlobalBatches(60, global_batch_size=6),
        trainstate.GlobalBatches(61, global_batch_size=12),
        trainstate.GlobalBatches(60, global_batch_size=12, drop_last=True),
    ):
        with pytest.raises(trainstate.StateMismatchError, match="keep global_batch_size"):
            other.load_state_dict(saved)


def test_a_position_part_way_through_a_global_batch_restarts_it_at_another_world_size(caplog):
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    data = torch.arange(48.0)
    sampler = trainstate.ResumableSampler(48, seed=2, num_replicas=1, global_batch_size=8, micro_batches=2)
    loader = sampler.attach(DataLoader(data, batch_sampler=sampler))
    it = iter(loader)
    first = [next(it).tolist() for _ in range(3)]  # a global batch and a half
    saved = sampler.state_dict()
    assert saved["batches"] == 1 and saved["micro"] == 1
    same = trainstate.ResumableSampler(48, seed=2, num_replicas=1, global_batch_size=8, micro_batches=2)
    same_loader = same.attach(DataLoader(data, batch_sampler=same))
    same.load_state_dict(saved)
    assert next(iter(same_loader)).tolist() == next(it).tolist()  # the same world size: its next micro-batch
    other = trainstate.ResumableSampler(48, seed=2, num_replicas=1, global_batch_size=8, micro_batches=4)
    other_loader = other.attach(DataLoader(data, batch_sampler=other))
    with caplog.at_level(logging.WARNING, "trainstate"):
        other.load_state_dict(saved)
    assert "starts that global batch again" in caplog.text
    assert [int(x) for x in next(iter(other_loader)).tolist()] == [int(x) for x in first[2][:2]]  # batch 1 anew
    stream = SampleStream(48, 8, seed=2)
    assert [int(x) for b in first[:2] for x in b] == stream.order(0)[:8].tolist()


def test_the_sampler_refuses_a_loader_built_without_batch_sampler_and_a_per_rank_position():
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    sampler = trainstate.ResumableSampler(16, global_batch_size=4)
    with pytest.raises(trainstate.InvalidArgumentError, match="batch_sampler=sampler"):
        sampler.attach(DataLoader(torch.arange(16.0), sampler=sampler, batch_size=4))
    sampler.attach(DataLoader(torch.arange(16.0), batch_sampler=sampler))
    with pytest.raises(trainstate.CheckpointError, match="per-rank position"):
        sampler.load_state_dict({"seed": 0, "epoch": 0, "consumed": 4})
    old = trainstate.ResumableSampler(16, seed=0)
    old.attach(DataLoader(torch.arange(16.0), sampler=old, batch_size=4))
    with pytest.raises(trainstate.CheckpointError, match="global_batch_size=4"):
        old.load_state_dict(sampler.state_dict())
    assert not trainstate._state.is_per_rank(sampler) and trainstate._state.is_per_rank(old)
    assert np.array_equal(
        np.sort(np.concatenate([b.numpy() for b in DataLoader(torch.arange(16.0), batch_sampler=sampler)])),
        np.arange(16.0),
    )
