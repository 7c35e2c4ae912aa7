"""Attacks on the global sample stream (issue 29) as users break it: loops that stop early, persistent
workers, saves between micro-batches and at an epoch's end, ``len(loader)``, the same-world RNG trap."""

from __future__ import annotations

import numpy as np
import pytest

import trainstate
from trainstate._sample_stream import SampleStream

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader, Dataset  # noqa: E402

TOTAL, G, SEED = 20, 4, 1


class Indexed(Dataset):
    """Each sample: its index and one draw of torch's global generator (seeded per sample)."""

    def __init__(self, n: int = TOTAL) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([int(i), int(torch.randint(0, 10**6, ()))])


def _loader(workers: int = 0, persistent: bool = False, micro: int = 1, total: int = TOTAL, **kw):
    sampler = trainstate.ResumableSampler(total, seed=SEED, global_batch_size=G, micro_batches=micro, **kw)
    loader = sampler.attach(
        DataLoader(Indexed(total), batch_sampler=sampler, num_workers=workers, persistent_workers=persistent)
    )
    return sampler, loader


def _indices(batches) -> list[int]:
    return [i for b in batches for i in b[:, 0].tolist()]


def _order(epoch: int, total: int = TOTAL) -> list[int]:
    return SampleStream(total, G, seed=SEED).order(epoch).tolist()


@pytest.mark.parametrize("workers, persistent", [(0, False), (2, False), (2, True)])
def test_a_loop_that_breaks_or_stops_on_the_last_batch_continues_the_stream(workers, persistent):
    """persistent_workers=True is accepted, and a ``break`` or a loop that took the last batch without seeing
    StopIteration (``zip``) continues the stream with the next iterator, persistent workers included."""
    sampler, loader = _loader(workers, persistent)
    seen = []
    for i, b in enumerate(loader):
        seen.append(b)
        if i == 1:
            break
    seen += list(loader)
    assert _indices(seen) == _order(0) and sampler.epoch == 1
    taken = [b for _, b in zip(range(TOTAL // G), loader)]  # epoch 1's last batch, StopIteration never seen
    assert _indices(taken) == _order(1)
    assert _indices(loader) == _order(2) and sampler.epoch == 3


def test_global_batches_that_stopped_on_the_last_batch_start_the_next_epoch():
    batches = trainstate.GlobalBatches(TOTAL, global_batch_size=G, seed=SEED)
    first = [i for _, part in zip(range(TOTAL // G), batches) for i in part.tolist()]
    assert first == _order(0)
    assert [i for part in batches for i in part.tolist()] == _order(1)


def test_len_of_the_loader_stays_fixed_while_an_epoch_is_iterated():
    """``(step + 1) == len(loader)`` marks the last batch, as with any DataLoader (and the per-rank sampler)."""
    sampler, loader = _loader(micro=2)
    lens = [len(loader) for _ in loader]
    assert lens == [10] * 10
    it = iter(loader)
    next(it), next(it), next(it)
    del it
    assert [len(loader) for _ in loader] == [7] * 7  # a new iterator yields the 7 left
    batches = trainstate.GlobalBatches(TOTAL, global_batch_size=G, seed=SEED)
    assert [len(batches) for _ in batches] == [5] * 5


def test_the_per_rank_sampler_with_persistent_workers_continues_after_a_break_and_a_zip():
    """A persistent-workers loader makes no new iterator for the next ``for`` (it resets the old one), so
    the per-rank sampler restarted the epoch after a ``break``, and repeated it after the last batch."""
    data = list(range(TOTAL))
    sampler = trainstate.ResumableSampler(data, seed=SEED)
    loader = sampler.attach(DataLoader(data, batch_size=4, sampler=sampler, num_workers=2, persistent_workers=True))
    order = sampler._order()
    seen = []
    for i, b in enumerate(loader):
        seen += b.tolist()
        if i == 1:
            break
    seen += [i for b in loader for i in b.tolist()]
    assert seen == order and sampler.epoch == 1
    second = [i for _, b in zip(range(5), loader) for i in b.tolist()]
    third = [i for b in loader for i in b.tolist()]
    assert sorted(second) == sorted(third) == data and second != third and sampler.epoch == 3


def test_a_changed_stream_is_refused_through_load_with_state_mismatch_error(tmp_path):
    """docs/distributed.md promises StateMismatchError; the restore wrapped it into a plain CheckpointError."""
    sampler, loader = _loader()
    next(iter(loader))
    trainstate.save(tmp_path / "c", {"sampler": sampler})
    for kw in ({"total": TOTAL + 1}, {"drop_last": True}, {"shuffle": False}):
        other, _ = _loader(**kw)
        with pytest.raises(trainstate.StateMismatchError, match="keep global_batch_size") as err:
            trainstate.load(tmp_path / "c", {"sampler": other})
        assert [k for k, _, _ in err.value.mismatched] == ["sampler." + next(iter(kw))]


def test_a_save_between_micro_batches_and_one_after_the_epochs_last_batch(tmp_path):
    sampler, loader = _loader(micro=2)
    it = iter(loader)
    taken = [next(it) for _ in range(3)]  # a global batch and a half
    trainstate.save(tmp_path / "mid", {"sampler": sampler})
    rest = list(it)
    assert _indices(taken + rest) == _order(0)
    again, loader2 = _loader(micro=2)
    trainstate.load(tmp_path / "mid", {"sampler": again})
    assert len(loader2) == 7 and _indices(loader2) == _indices(rest)
    # another micro-batch count: that global batch again from its first sample
    other, loader3 = _loader(micro=1)
    trainstate.load(tmp_path / "mid", {"sampler": other})
    assert _indices(loader3) == _order(0)[G:]
    # the epoch's last batch taken, StopIteration not yet seen
    sampler, loader = _loader()
    it = iter(loader)
    [next(it) for _ in range(TOTAL // G)]
    trainstate.save(tmp_path / "end", {"sampler": sampler})
    after, loader4 = _loader()
    trainstate.load(tmp_path / "end", {"sampler": after})
    assert after.epoch == 1 and len(loader4) == TOTAL // G and _indices(loader4) == _order(1)


class Noisy(Dataset):
    def __len__(self) -> int:
        return 26

    def __getitem__(self, i: int):
        g = np.random.default_rng(i)
        x = torch.from_numpy(g.standard_normal(6).astype(np.float32)) + torch.rand(6)  # augmentation
        return x, int(i) % 3


def _build(workers: int, init_seed: int, persistent: bool = False):
    torch.manual_seed(init_seed)
    np.random.seed(init_seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Dropout(0.4), torch.nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = trainstate.ResumableSampler(26, seed=5, global_batch_size=8, micro_batches=2)
    loader = sampler.attach(
        DataLoader(Noisy(), batch_sampler=sampler, num_workers=workers, persistent_workers=persistent)
    )
    return {"model": model, "optim": opt, "sampler": sampler, "rng": trainstate.RNGState()}, loader


def _train(state, loader, start: int, stop: int, save=None) -> None:
    step, micro = start, 0
    while step < stop:
        for x, y in loader:
            torch.nn.functional.cross_entropy(state["model"](x), y).backward()
            micro += 1
            if micro % 2:
                continue
            state["optim"].step()
            state["optim"].zero_grad()
            if save is not None:
                save(step)
            step += 1
            if step >= stop:
                break


@pytest.mark.parametrize("workers, persistent", [(0, False), (2, False), (2, True)])
@pytest.mark.parametrize("save_at", [1, 3])  # mid-epoch; the epoch's last global batch (4 per epoch)
def test_dropout_after_a_resume_at_the_same_world_size_is_bit_identical(tmp_path, workers, persistent, save_at):
    state, loader = _build(workers, 0, persistent)
    _train(state, loader, 0, 9, lambda s: trainstate.save(tmp_path / "c", state) if s == save_at else None)
    resumed, loader2 = _build(workers, 99, persistent)
    trainstate.load(tmp_path / "c", resumed)
    _train(resumed, loader2, save_at + 1, 9)
    for a, b in zip(state["model"].parameters(), resumed["model"].parameters()):
        assert torch.equal(a, b)


def test_a_restore_that_brings_another_seed_is_not_served_the_cached_order_of_the_old_one():
    saved_run = trainstate.GlobalBatches(TOTAL, global_batch_size=G, seed=SEED)
    next(iter(saved_run))
    resumed = trainstate.GlobalBatches(TOTAL, global_batch_size=G, seed=0)
    next(iter(resumed))  # a sanity batch before the restore: epoch 0's order of seed 0, cached
    resumed.load_state_dict(saved_run.state_dict())
    assert next(iter(resumed)).tolist() == _order(0)[G : 2 * G]


def test_a_numpy_integer_length_is_a_length():
    """``GlobalBatches(x.shape[0])`` of a JAX/NumPy loop can be a NumPy integer: it raised "has no len()"."""
    assert len(trainstate.GlobalBatches(np.int64(TOTAL), global_batch_size=G)) == TOTAL // G
    assert len(trainstate.ResumableSampler(np.int64(TOTAL), global_batch_size=G)) == TOTAL // G


@pytest.mark.parametrize("per_rank", [False, True], ids=["global", "per-rank"])
def test_a_stateful_dataloader_with_workers_saved_beside_its_sampler_resumes_mid_epoch(tmp_path, per_rank):
    """The sampler's own position wins over the loader's snapshot, which torchdata takes with workers ahead of
    training (it restarted the epoch: 5 batches, 2 seen twice)."""
    pytest.importorskip("torchdata")
    from torchdata.stateful_dataloader import StatefulDataLoader

    def build():
        sampler = trainstate.ResumableSampler(TOTAL, seed=SEED, **({} if per_rank else {"global_batch_size": G}))
        how = {"batch_size": G, "sampler": sampler} if per_rank else {"batch_sampler": sampler}
        loader = sampler.attach(StatefulDataLoader(list(range(TOTAL)), num_workers=2, **how))
        return {"sampler": sampler, "loader": loader}

    state = build()
    it = iter(state["loader"])
    next(it), next(it)
    trainstate.save(tmp_path / "c", state)
    rest = [b.tolist() for b in it]
    resumed = build()
    trainstate.load(tmp_path / "c", resumed)
    assert [b.tolist() for b in resumed["loader"]] == rest
