"""Attacks on the exact resume at any number of ranks through the integrations (attack29): Lightning's ExactResume
over a global-stream ``ResumableSampler`` when Lightning's epoch and the stream's epoch part ways, and the HF
callback's check of a crafted saved data position. In one process on the CPU."""

from __future__ import annotations

import importlib.util
import logging
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import trainstate  # noqa: E402
from trainstate.errors import CheckpointError  # noqa: E402

TOTAL, GLOBAL_BATCH = 24, 4  # 6 global batches an epoch


@pytest.fixture(scope="module")
def run() -> ModuleType:
    if importlib.util.find_spec("lightning") is None:
        pytest.skip("lightning is not installed")
    from integrations import lightning_run

    return lightning_run


class _Crash(Exception):
    pass


def _fit(
    run: ModuleType, root: Path, crash: int | None = None, micro: int = 1, every: int | None = 2, **trainer_kw: Any
) -> list[tuple[int, int, list[int]]]:
    """Train (resuming from ``root``'s last.ckpt when there is one); each training batch's (Lightning epoch,
    global step, sample indices); ``crash`` raises as that step's batch starts (a checkpoint every 2 steps)."""

    class Indexed(torch.utils.data.Dataset):  # type: ignore[misc]
        def __len__(self) -> int:
            return TOTAL

        def __getitem__(self, i: int) -> Any:
            return torch.randn(4), torch.randn(1), torch.tensor(int(i))

    seen: list[tuple[int, int, list[int]]] = []

    class Streamed(run.Tiny):  # type: ignore[misc,name-defined]
        def train_dataloader(self) -> Any:
            sampler = trainstate.ResumableSampler(
                TOTAL,
                global_batch_size=GLOBAL_BATCH,
                seed=5,
                num_replicas=self.trainer.world_size,
                rank=self.trainer.global_rank,
                micro_batches=micro,
            )
            return torch.utils.data.DataLoader(Indexed(), batch_sampler=sampler)

        def val_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(Indexed(), batch_size=4)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            return None

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y, index = batch
            seen.append((self.trainer.current_epoch, self.trainer.global_step, index.tolist()))
            return super().training_step((x, y), batch_idx)

    class CrashAt(run.L.Callback):  # type: ignore[misc,name-defined]
        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == crash:
                raise _Crash

    run.L.seed_everything(0, verbose=False)
    last = root / "checkpoints" / "last.ckpt"
    trainer = run.L.Trainer(
        default_root_dir=root,
        accelerator="cpu",
        devices=1,
        use_distributed_sampler=False,
        accumulate_grad_batches=micro,
        plugins=[run.TrainstateCheckpointIO()],
        callbacks=[
            run.ExactResume(),
            run.ModelCheckpoint(dirpath=root / "checkpoints", every_n_train_steps=every, save_last=True, save_top_k=-1),
            CrashAt(),
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **({"limit_val_batches": 0} if "val_check_interval" not in trainer_kw else {}),
        **trainer_kw,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(Streamed(), ckpt_path=str(last) if last.exists() else None)
        except _Crash:
            pass
    _fit.warnings = [str(w.message) for w in caught]  # type: ignore[attr-defined]
    return seen


def _interrupted_and_resumed(run: ModuleType, tmp_path: Path, crash: int, **trainer_kw: Any) -> tuple[Any, Any]:
    logging.getLogger("lightning").setLevel(logging.ERROR)
    reference = _fit(run, tmp_path / "reference", **trainer_kw)
    before = _fit(run, tmp_path / "run", crash=crash, **trainer_kw)
    after = _fit(run, tmp_path / "run", **trainer_kw)
    first = min(step for _, step, _ in after)
    return reference, [r for r in before if r[1] < first] + after


def test_lightning_limit_train_batches_resumes_where_the_uninterrupted_run_was(run: ModuleType, tmp_path: Path) -> None:
    # 6 global batches an epoch, Lightning trains 4 of them per epoch; the crash at step 7 resumes from step 6
    reference, resumed = _interrupted_and_resumed(run, tmp_path, 7, max_epochs=3, limit_train_batches=4)
    assert [step for _, step, _ in reference] == list(range(10))
    assert resumed == reference


def test_lightning_reloaded_loader_resumed_mid_epoch_sees_every_sample_once(run: ModuleType, tmp_path: Path) -> None:
    reference, resumed = _interrupted_and_resumed(run, tmp_path, 9, max_epochs=3, reload_dataloaders_every_n_epochs=1)
    epoch1 = [i for epoch, _, indices in resumed if epoch == 1 for i in indices]
    assert sorted(epoch1) == list(range(TOTAL)), "every sample once in the resumed epoch"
    assert resumed == reference


def test_lightning_global_stream_warns_of_a_checkpoint_amid_accumulation(run: ModuleType, tmp_path: Path) -> None:
    logging.getLogger("lightning").setLevel(logging.ERROR)
    _fit(run, tmp_path / "run", crash=3, micro=2, every=None, max_epochs=1, val_check_interval=3)
    saved = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert "epoch=0-step=1.ckpt" in saved, saved  # saved after validation, 3 batches in: one micro-batch of step 1
    assert any("accumulat" in w for w in _fit.warnings), _fit.warnings  # type: ignore[attr-defined]


def test_lightning_fit_continued_after_max_steps_mid_epoch_sees_the_next_global_batch(
    run: ModuleType, tmp_path: Path
) -> None:
    logging.getLogger("lightning").setLevel(logging.ERROR)
    reference = _fit(run, tmp_path / "reference", every=100, max_steps=10)
    first = _fit(run, tmp_path / "run", every=100, max_steps=4)  # last.ckpt written as the fit stops
    continued = _fit(run, tmp_path / "run", every=100, max_steps=10)
    assert [step for _, step, _ in first + continued] == list(range(10))
    assert [indices for _, _, indices in first + continued] == [indices for _, _, indices in reference]


# -- the HF callback: a crafted data position --------------------------------------------------------------------


def _hf_position(per_device: int, accumulation: int, world: int, **changes: Any) -> dict[str, Any]:
    pytest.importorskip("transformers")
    from test_hf_elastic_rules import _position

    return _position(per_device, accumulation, world, **changes)


@pytest.mark.parametrize(
    "crafted",
    [
        {"gradient_accumulation_steps": 0},
        {"train_batch_size": None},
        {"batches_per_epoch": float("nan")},
        {"world_size": None},
        {"train_batch_size": "x"},
    ],
    ids=["accumulation-0", "batch-None", "batches-NaN", "world-None", "batch-str"],
)
def test_hf_crafted_saved_position_is_refused_by_name(crafted: dict[str, Any]) -> None:
    from trainstate.integrations import _hf_data as data

    loader = torch.utils.data.DataLoader(list(range(40)), batch_size=8)
    saved = _hf_position(4, 2, 2, **crafted)
    try:
        wrong = data.elastic_differences(saved, _hf_position(8, 2, 1), loader)
    except CheckpointError:
        return  # a trainstate error is a refusal too
    assert wrong, "a position that cannot be the saved run's must be refused"


# -- Lightning: a crafted stream position in the checkpoint -------------------------------------------------------


@pytest.mark.parametrize(
    "crafted",
    [
        {"stream": {"micro_batches": None}},
        {"stream": {"batches": "x", "micro_batches": 2}},
        {"stream": {"micro_batches": float("nan")}},
        {"stream": {"seed": None}},
        {"step": "x"},
    ],
    ids=["micro_batches-None", "batches-str", "micro_batches-NaN", "seed-None", "step-str"],
)
def test_lightning_crafted_stream_position_is_refused_with_a_trainstate_error(crafted: dict[str, Any]) -> None:
    from torch.utils.data import DataLoader

    from trainstate.integrations import _lightning_stream as stream

    sampler = trainstate.ResumableSampler(TOTAL, global_batch_size=GLOBAL_BATCH, seed=0)
    sampler.attach(DataLoader(list(range(TOTAL)), batch_sampler=sampler))
    state: dict[str, Any] = {"stream": {**sampler.state_dict(), **crafted.get("stream", {})}, "step": 3}
    state.update({k: v for k, v in crafted.items() if k != "stream"})
    with pytest.raises(CheckpointError):
        stream.resume(sampler, state["stream"])
        stream.generators(state, 0, 2)  # saved by 1 process, resumed by 2: re-derived from (seed, step, rank)
