"""Randomness drawn inside ``Dataset.__getitem__`` resumes exactly, in worker processes and without them.

A fine-tune that masks tokens in its DataLoader workers used to diverge at the first resumed step: a
worker's generators depended on which samples that worker had served, and after a resume the samples land
on other workers with fresh seeds. trainstate now seeds every sample from (seed, epoch, index).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import trainstate
from helpers import assert_same

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader, Dataset, IterableDataset  # noqa: E402 - after importorskip

import resume_recipe  # noqa: E402 - after importorskip

HAS_TORCHDATA = pytest.importorskip("importlib").util.find_spec("torchdata") is not None
LOADERS = [
    "sampler",
    pytest.param("stateful", marks=pytest.mark.skipif(not HAS_TORCHDATA, reason="torchdata not installed")),
]
RECIPE = Path(__file__).with_name("resume_recipe.py")


def _run(out: Path, args: list[str]) -> tuple[int, str]:
    """Run the recipe in a fresh process group; once it has exited, kill what it left behind.

    A SIGKILLed loop orphans its DataLoader workers, which hold the output pipes open until they notice
    (subprocess.run would wait for them): output goes to a file and the group is killed.
    """
    out.mkdir(parents=True, exist_ok=True)
    log = out / f"log{len(list(out.glob('log*.txt')))}.txt"
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, str(RECIPE), str(out), *args], stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=300)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return rc, log.read_text()


def _kill_and_resume(tmp_path: Path, flags: list[str], kill_at: int) -> tuple[Any, Any]:
    """The final states of an uninterrupted run and of a run SIGKILLed at ``kill_at`` in a fresh process and
    resumed in another. The uninterrupted run is the same recipe in this process (which process runs it is
    not what is tested; a fresh ``python`` importing torch costs seconds of CPU)."""
    resume_recipe.main([str(tmp_path / "ref"), *flags])
    rc, out = _run(tmp_path / "run", [*flags, "--kill-at", str(kill_at)])
    assert rc == -signal.SIGKILL, out
    assert not (tmp_path / "run" / "final").exists()
    rc, out = _run(tmp_path / "run", flags)
    assert rc == 0, out
    start = int(out.split("start ")[1].split()[0])
    assert 0 < start <= kill_at  # resumed mid-epoch (13 steps an epoch), from a checkpoint before the kill
    return trainstate.load(tmp_path / "ref" / "final"), trainstate.load(tmp_path / "run" / "final")


@pytest.mark.parametrize(
    ("loader_kind", "workers"),
    [
        pytest.param("sampler", 0, marks=pytest.mark.slow),  # in-process with a sampler: the DDP resume test too
        pytest.param(*LOADERS[1].values, 0, marks=[*LOADERS[1].marks, pytest.mark.slow]),
        # CI: the same workers and per-sample seeding run in the StatefulDataLoader case below; a SIGKILLed
        # ResumableSampler run resumes in test_demo and the 2-rank DDP test
        pytest.param("sampler", 2, marks=pytest.mark.slow),
        pytest.param(*LOADERS[1].values, 2, marks=LOADERS[1].marks),
    ],
)
def test_augmentation_in_workers_resumes_bit_identically_after_sigkill(tmp_path, loader_kind, workers):
    """Dropout plus a dataset drawing from random, np.random and torch in ``__getitem__``, killed at step 8
    of 20 (the run goes on into the next epoch) and resumed in a new process."""
    flags = ["--loader", loader_kind, "--workers", str(workers), "--augment", "--steps", "20", "--every", "3"]
    reference, resumed = _kill_and_resume(tmp_path, flags, kill_at=8)
    assert_same(reference, resumed)


@pytest.mark.skipif(not HAS_TORCHDATA, reason="torchdata not installed")
@pytest.mark.slow  # the control experiment for the test above
def test_without_per_sample_seeding_augmenting_workers_diverge(tmp_path):
    """The failure is real: a StatefulDataLoader left to torch's per-worker seeds diverges after a resume."""
    flags = [
        "--loader",
        "stateful",
        "--workers",
        "2",
        "--augment",
        "--steps",
        "20",
        "--every",
        "3",
        "--no-seed-per-sample",
    ]
    reference, resumed = _kill_and_resume(tmp_path, flags, kill_at=8)
    assert not np.array_equal(reference["model"]["0.weight"], resumed["model"]["0.weight"])


class Noisy(Dataset[tuple[int, float, float, float]]):
    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> tuple[int, float, float, float]:
        assert type(i) is int  # the dataset sees a plain index, whatever carried the seed
        return i, random.random(), float(np.random.random()), torch.rand(()).item()


class NoisyBatches(Noisy):
    """Fetches a whole batch in one call (``__getitems__``): seeded once per batch, from its first sample."""

    def __getitems__(self, indices: list[int]) -> list[tuple[int, float, float, float]]:
        return [self[i] for i in indices]


def _epochs(
    workers: int,
    persistent: bool = False,
    epochs: int = 2,
    dataset: type[Noisy] = Noisy,
) -> list[list[list[float]]]:
    sampler = trainstate.ResumableSampler(dataset(), seed=5)
    loader = sampler.attach(
        DataLoader(dataset(), batch_size=4, sampler=sampler, num_workers=workers, persistent_workers=persistent)
    )
    return [
        [torch.stack([torch.as_tensor(c, dtype=torch.float64) for c in b], 1).tolist() for b in loader]
        for _ in range(epochs)
    ]


@pytest.mark.parametrize("dataset", [Noisy, NoisyBatches])
def test_a_sample_draws_the_same_numbers_whichever_worker_serves_it(dataset):
    """0 workers, 2 workers, persistent workers: the same batches, and fresh draws in every epoch."""
    single = _epochs(0, dataset=dataset)
    assert _epochs(2, dataset=dataset) == single
    assert _epochs(2, persistent=True, dataset=dataset) == single
    by_index = [{int(row[0]): row[1:] for b in epoch for row in b} for epoch in single]
    assert all(by_index[0][i] != by_index[1][i] for i in range(24))


def test_fetching_in_the_main_process_leaves_the_training_rng_alone():
    """With num_workers=0 the dataset runs in the training process: its draws must not move the loop's RNG."""
    sampler = trainstate.ResumableSampler(Noisy(), seed=5)
    loader = sampler.attach(DataLoader(Noisy(), batch_size=4, sampler=sampler))
    it = iter(loader)
    before = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    next(it), next(it)
    assert random.getstate() == before[0]
    assert np.array_equal(np.random.get_state()[1], before[1])
    assert torch.equal(torch.get_rng_state(), before[2])


def test_seed_per_sample_refuses_what_it_cannot_make_exact():
    class Stream(IterableDataset[int]):
        def __iter__(self) -> Any:
            return iter(range(4))

    with pytest.raises(trainstate.CheckpointError, match="map-style"):
        trainstate.seed_per_sample(DataLoader(Stream(), batch_size=2))
    if HAS_TORCHDATA:
        from torchdata.stateful_dataloader import StatefulDataLoader

        with pytest.raises(trainstate.CheckpointError, match="persistent_workers"):
            trainstate.seed_per_sample(
                StatefulDataLoader(Noisy(), batch_size=2, num_workers=1, persistent_workers=True)
            )


@pytest.mark.skipif(not HAS_TORCHDATA, reason="torchdata not installed")
def test_a_dropped_stateful_loader_is_freed_at_once_and_its_workers_stop():
    """seed_per_sample puts the loader in no reference cycle: dropped mid-epoch, a StatefulDataLoader (which
    keeps its iterator) is freed by its last reference, and the iterator stops its workers. In a cycle, a
    garbage collection would free them later, and torch joins each worker only after a 5 s timeout then."""
    import gc
    import weakref

    from torchdata.stateful_dataloader import StatefulDataLoader

    loader = trainstate.seed_per_sample(StatefulDataLoader(Noisy(), batch_size=4, shuffle=True, num_workers=2))
    it = iter(loader)
    next(it)
    workers, freed = list(it._workers), weakref.ref(loader)
    collecting = gc.isenabled()
    gc.disable()
    try:
        del it, loader
        assert freed() is None
        assert not any(w.is_alive() for w in workers)
    finally:
        if collecting:
            gc.enable()


def test_saving_a_sampler_before_attach_is_a_checkpoint_error(tmp_path):
    sampler = trainstate.ResumableSampler(10)
    with pytest.raises(trainstate.CheckpointError, match="attach"):
        trainstate.save(tmp_path / "c", {"sampler": sampler})
