"""EpochReplay with a DistributedSampler: the epoch its shuffle is drawn from travels with the position, so a
framework that starts the resumed epoch's iterator before it sets the sampler's epoch (Lightning under DDP) still
replays the interrupted epoch's order."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch.utils.data import DataLoader, DistributedSampler  # noqa: E402

from trainstate._replay import EpochReplay  # noqa: E402
from trainstate._rng import RNGState  # noqa: E402


def _loader() -> DataLoader[Any]:
    data = torch.arange(40.0)
    return DataLoader(data, batch_size=4, sampler=DistributedSampler(data, num_replicas=2, rank=1, seed=3))  # type: ignore[arg-type]


def test_the_sampler_epoch_is_set_before_the_replay_pulls() -> None:
    loader = _loader()
    replay = EpochReplay(loader)
    assert isinstance(loader.sampler, DistributedSampler)
    loader.sampler.set_epoch(1)  # as a framework does before an epoch's iterator starts
    it = iter(loader)
    seen = [next(it) for _ in range(3)]  # trained on 2, one more pulled ahead
    position = replay.position(trained=2)
    assert position is not None and position["sampler_epoch"] == 1
    rest = [seen[2], *it]
    replay.close(loader)

    resumed = _loader()
    again = EpochReplay(resumed)
    again.resume(position, RNGState().state_dict())
    got = list(resumed)  # its epoch is still 0 here, as Lightning leaves it when it resumes
    assert [b.tolist() for b in got] == [b.tolist() for b in rest]
    again.close(resumed)


def test_a_position_saved_without_the_sampler_epoch_still_replays() -> None:
    loader = _loader()
    replay = EpochReplay(loader)
    it = iter(loader)
    first = [next(it) for _ in range(2)]
    position = replay.position(trained=1)
    assert position is not None
    del position["sampler_epoch"]  # a checkpoint saved before it was kept
    replay.close(loader)
    resumed = _loader()
    again = EpochReplay(resumed)
    again.resume(position, RNGState().state_dict())
    assert [b.tolist() for b in resumed][0] == first[1].tolist()
    again.close(resumed)
