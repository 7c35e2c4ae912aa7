"""TrainstateCheckpointIO and ExactResume in real Lightning runs, in this process (tiny model, few steps).

What a Lightning user meets: ModelCheckpoint's top-k files and last.ckpt (also as a link), resuming with
ckpt_path="last" (the same plugin object again), the dict Lightning gets back, background saves and their
failures, values that cannot be stored, files and folders other tools left at a checkpoint's path, and an
interrupted run resumed exactly (here the dataset's augmentation draws from the training process's RNG).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import pathlib
import pickle
import shutil
from types import ModuleType
from typing import Any

import numpy as np
import pytest

if importlib.util.find_spec("lightning") is None:
    pytest.skip("lightning is not installed", allow_module_level=True)
torch = pytest.importorskip("torch")

import trainstate  # noqa: E402
from helpers import assert_same  # noqa: E402
from trainstate.errors import (  # noqa: E402
    CheckpointExistsError,
    InvalidArgumentError,
    UnsupportedValueError,
)


@pytest.fixture(scope="module")
def run() -> ModuleType:
    """Lightning and the tiny run, imported by the first test that needs them: importing Lightning costs
    seconds of CPU, paid only by the pytest worker that runs these tests, not at collection by every one."""
    from integrations import lightning_run

    return lightning_run


def _names(directory: pathlib.Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


@pytest.mark.parametrize("async_save, save_last", [(False, True), (True, True), (False, "link"), (True, "link")])
def test_modelcheckpoint_topk_last_and_resume(run, tmp_path, async_save, save_last):
    plugin = run.Recording(async_save=async_save)
    checkpoints = tmp_path / "checkpoints"
    steps = run.Steps()

    def trainer(epochs: int) -> Any:
        cb = run.ModelCheckpoint(
            checkpoints, every_n_train_steps=2, save_top_k=2, monitor="step", mode="max", save_last=save_last
        )
        return run.L.Trainer(
            max_epochs=epochs,
            default_root_dir=tmp_path,
            plugins=[plugin],
            callbacks=[cb, steps],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )

    run.L.seed_everything(0, verbose=False)
    trainer(1).fit(run.Tiny(), run.loader())
    assert _names(checkpoints) == ["epoch=0-step=6.ckpt", "epoch=0-step=8.ckpt", "last.ckpt"]  # top 2, and last
    assert plugin.removed == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]  # ModelCheckpoint's removals
    for name, step in (("epoch=0-step=6.ckpt", 6), ("epoch=0-step=8.ckpt", 8), ("last.ckpt", 8)):
        with trainstate.open(checkpoints / name) as ck:  # a committed, checksummed trainstate checkpoint
            assert ck.metadata["step"] == step
    assert (checkpoints / "last.ckpt").is_symlink() == (save_last == "link")

    second = trainer(2)  # the same plugin object in a second Trainer, resuming from last.ckpt
    second.fit(run.Tiny(), run.loader(), ckpt_path="last")
    assert steps.count == 16  # 8 in the first fit, then only the 8 of epoch 2: it resumed
    assert second.checkpoint_callback.best_model_path.endswith("epoch=1-step=16.ckpt")
    assert not [n for n in _names(checkpoints) if n.startswith(".")]

    if async_save or save_last == "link":
        return
    # what load_checkpoint returns is what torch.load returns for the same Lightning dict
    second.save_checkpoint(tmp_path / "ours.ckpt")
    second.strategy.checkpoint_io = run.TorchCheckpointIO()
    second.save_checkpoint(tmp_path / "torch.ckpt")
    expected = torch.load(tmp_path / "torch.ckpt", weights_only=False)
    got = plugin.load_checkpoint(tmp_path / "ours.ckpt")
    assert_same(got, expected)
    assert dict(got["state_dict"]._metadata) == dict(expected["state_dict"]._metadata)


@dataclasses.dataclass
class Config:
    layers: int
    data: pathlib.Path


def _lightning_like_dict() -> dict[str, Any]:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    return {
        "epoch": 1,
        "global_step": 7,
        "pytorch-lightning_version": "2.6.6",
        "state_dict": model.state_dict(),
        "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 2}}}},
        "callbacks": {
            "ModelCheckpoint{'monitor': 'val/loss', 'mode': 'min'}": {
                "best_model_score": torch.tensor(0.25),
                "best_k_models": {"/runs/epoch=0-step=7.ckpt": torch.tensor(0.25)},
                "kth_value": torch.tensor(float("inf")),
                "dirpath": "/runs",
            }
        },
        "optimizer_states": [opt.state_dict()],
        "lr_schedulers": [{"base_lrs": [0.1], "last_epoch": 7, "_get_lr_called_within_step": False}],
        "hparams_name": "kwargs",
        "hyper_parameters": {
            "args": argparse.Namespace(lr=0.1, out=pathlib.Path("/tmp/out"), betas=(0.9, 0.99)),
            "config": Config(2, pathlib.Path("data")),
            "threshold": np.float32(0.5),
            "seed": np.int64(3),
            # NumPy values anywhere: a float64 (a subclass of float) in a list, a scalar beside a Path in a
            # tuple (a conversion inside a tuple), an array
            "scales": [np.float64(1.5), np.int32(2), np.float16(0.5), np.bool_(True)],
            "pair": (np.float32(0.25), pathlib.Path("a")),
            "table": np.arange(3),
            "nan": float("nan"),
            "blob": b"\x00\x01",
        },
    }


def test_round_trip_converts_hparams_and_keeps_everything_else(run, tmp_path):
    checkpoint = _lightning_like_dict()
    plugin = run.TrainstateCheckpointIO()
    plugin.save_checkpoint(checkpoint, tmp_path / "a.ckpt")
    got = plugin.load_checkpoint(tmp_path / "a.ckpt")
    expected = dict(checkpoint)
    expected["hyper_parameters"] = {
        **checkpoint["hyper_parameters"],
        "config": {"layers": 2, "data": pathlib.Path("data")},
    }
    nan = expected["hyper_parameters"].pop("nan")
    assert np.isnan(got["hyper_parameters"].pop("nan")) and np.isnan(nan)
    assert_same(got, expected)  # tensors, int keys, tuples, OrderedDict, Namespace, Path, NumPy scalar types
    assert got["state_dict"]._metadata == checkpoint["state_dict"]._metadata  # submodule versions, for migrations
    assert got["optimizer_states"][0]["state"][0]["exp_avg"].numpy().flags.writeable  # the optimizer updates it


def test_map_location(run, tmp_path):
    plugin = run.TrainstateCheckpointIO()
    plugin.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "n": 1}, tmp_path / "a.ckpt")
    meta = torch.empty(0, device="meta").untyped_storage()
    for where in ("meta", torch.device("meta"), {"cpu": "meta"}, lambda storage, loc: meta):
        assert plugin.load_checkpoint(tmp_path / "a.ckpt", map_location=where)["state_dict"]["w"].is_meta
    for where in (None, lambda storage, loc: None, lambda storage, loc: storage):
        assert plugin.load_checkpoint(tmp_path / "a.ckpt", map_location=where)["state_dict"]["w"].device.type == "cpu"
    with pytest.raises(InvalidArgumentError, match="map_location"):
        plugin.load_checkpoint(tmp_path / "a.ckpt", map_location=3)


class Opaque:
    """Something a user passes to their module (a tokenizer, a loss object): no arrays, no state_dict."""


def test_unstorable_values_are_named_with_the_fix(run, tmp_path):
    trainer = run.L.Trainer(
        max_steps=2,
        default_root_dir=tmp_path,
        plugins=[run.TrainstateCheckpointIO()],
        callbacks=[run.ModelCheckpoint(tmp_path, every_n_train_steps=1)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.raises(UnsupportedValueError, match=r"hyper_parameters\.tokenizer.*save_hyperparameters\(ignore="):
        trainer.fit(run.WithObjectHparam(tokenizer=Opaque()), run.loader())
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".ckpt") or p.name.startswith(".")]

    plugin = run.TrainstateCheckpointIO()
    with pytest.raises(UnsupportedValueError, match=r"callbacks\.Mine.*state_dict\(\)"):
        plugin.save_checkpoint({"callbacks": {"Mine": {"seen": {1, 2}}}}, tmp_path / "b.ckpt")
    with pytest.raises(UnsupportedValueError, match=r"extra.*on_save_checkpoint"):
        plugin.save_checkpoint({"extra": Opaque()}, tmp_path / "b.ckpt")


def test_what_other_tools_left_at_the_path(run, tmp_path):
    plugin = run.TrainstateCheckpointIO()
    checkpoint = {"state_dict": {"w": torch.arange(3.0)}, "global_step": 3}

    torch.save(checkpoint, tmp_path / "old.ckpt")  # Lightning's default plugin wrote it (a run switching over)
    with pytest.raises(InvalidArgumentError, match="read_torch_files=True"):
        plugin.load_checkpoint(tmp_path / "old.ckpt")
    assert_same(run.TrainstateCheckpointIO(read_torch_files=True).load_checkpoint(tmp_path / "old.ckpt"), checkpoint)
    with pytest.raises(UnsupportedValueError):  # a save that fails leaves the file as it was
        plugin.save_checkpoint({**checkpoint, "extra": Opaque()}, tmp_path / "old.ckpt")
    assert_same(torch.load(tmp_path / "old.ckpt"), checkpoint)
    plugin.save_checkpoint(checkpoint, tmp_path / "old.ckpt")  # saving over it replaces the file
    assert (tmp_path / "old.ckpt" / "manifest.json").exists()
    assert_same(plugin.load_checkpoint(tmp_path / "old.ckpt"), checkpoint)

    plugin.save_checkpoint(checkpoint, tmp_path / "epoch=0.ckpt")
    os.symlink("epoch=0.ckpt", tmp_path / "last.ckpt")  # ModelCheckpoint(save_last="link")
    assert_same(plugin.load_checkpoint(tmp_path / "last.ckpt"), checkpoint)
    plugin.save_checkpoint({**checkpoint, "global_step": 4}, tmp_path / "last.ckpt")  # replaces the link only
    assert not (tmp_path / "last.ckpt").is_symlink()
    assert plugin.load_checkpoint(tmp_path / "epoch=0.ckpt")["global_step"] == 3
    plugin.remove_checkpoint(tmp_path / "epoch=0.ckpt")
    plugin.remove_checkpoint(tmp_path / "epoch=0.ckpt")  # gone already: nothing to do, as Lightning's own
    assert plugin.load_checkpoint(tmp_path / "last.ckpt")["global_step"] == 4

    (tmp_path / "notes.ckpt").write_text("my notes")
    (tmp_path / "data.ckpt").mkdir()
    (tmp_path / "data.ckpt" / "keep.txt").write_text("another tool's folder")
    for name in ("notes.ckpt", "data.ckpt"):
        with pytest.raises(CheckpointExistsError, match="refusing to replace"):
            plugin.save_checkpoint(checkpoint, tmp_path / name)
    plugin.remove_checkpoint(tmp_path / "data.ckpt")  # not a checkpoint: left alone
    assert (tmp_path / "notes.ckpt").read_text() == "my notes" and (tmp_path / "data.ckpt" / "keep.txt").exists()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_background_save_failure_keeps_the_checkpoint_it_would_replace(run, tmp_path):
    plugin = run.TrainstateCheckpointIO(async_save=True)
    state = {"state_dict": {"w": torch.ones(4)}}
    plugin.save_checkpoint(state, tmp_path / "a.ckpt")
    (tmp_path / "b.ckpt").mkdir()
    (tmp_path / "b.ckpt" / "x").write_text("not a checkpoint")
    state["state_dict"]["w"].add_(1)  # the save copied the tensors: training may change them at once
    plugin.save_checkpoint(state, tmp_path / "b.ckpt")  # fails in the background
    with pytest.raises(CheckpointExistsError):  # raised by the next call: this one, or the end of fit
        plugin.remove_checkpoint(tmp_path / "a.ckpt")  # ModelCheckpoint drops the old top-k: never done
        plugin.teardown()
    assert plugin.load_checkpoint(tmp_path / "a.ckpt")["state_dict"]["w"].tolist() == [1.0] * 4
    plugin.save_checkpoint(state, tmp_path / "c.ckpt")  # the error was reported once; saving goes on
    plugin.teardown()
    assert plugin.load_checkpoint(tmp_path / "c.ckpt")["state_dict"]["w"].tolist() == [2.0] * 4


def test_compressed_encrypted_background_round_trip(run, tmp_path, monkeypatch):
    pytest.importorskip("zstandard")
    pytest.importorskip("cryptography")
    monkeypatch.setenv("LIGHTNING_TEST_KEY", trainstate.generate_key())
    plugin = run.TrainstateCheckpointIO(async_save=True, compression="zstd:1", key_env="LIGHTNING_TEST_KEY")
    checkpoint = _lightning_like_dict()
    plugin.save_checkpoint(checkpoint, tmp_path / "a.ckpt")
    got = plugin.load_checkpoint(tmp_path / "a.ckpt")  # waits for the background save
    assert_same(got["optimizer_states"], checkpoint["optimizer_states"])
    with pytest.raises(trainstate.KeyRequiredError):
        run.TrainstateCheckpointIO().load_checkpoint(tmp_path / "a.ckpt")
    plugin.teardown()


def test_wrong_arguments(run, tmp_path):
    for kwargs in ({"async_save": "yes"}, {"threads": 0}, {"compression": "gzip"}, {"fsync": None}):
        with pytest.raises(InvalidArgumentError):
            run.TrainstateCheckpointIO(**kwargs)
    plugin = run.TrainstateCheckpointIO()
    with pytest.raises(InvalidArgumentError, match="storage_options"):
        plugin.save_checkpoint({}, tmp_path / "a.ckpt", storage_options={"x": 1})
    with pytest.raises(InvalidArgumentError, match="path"):
        plugin.save_checkpoint({}, 3)
    with pytest.raises(InvalidArgumentError, match="dict"):
        plugin.save_checkpoint([1], tmp_path / "a.ckpt")
    copy = pickle.loads(pickle.dumps(run.TrainstateCheckpointIO(async_save=True)))  # ddp_spawn pickles plugins
    copy.save_checkpoint({"n": 1}, tmp_path / "p.ckpt")
    copy.teardown()
    assert copy.load_checkpoint(tmp_path / "p.ckpt") == {"n": 1}


def test_exact_resume_refuses_loaders_it_cannot_replay(run, tmp_path):
    def fit(loaders: Any) -> None:
        run.L.Trainer(
            max_steps=2,
            default_root_dir=tmp_path,
            plugins=[run.TrainstateCheckpointIO()],
            callbacks=[run.ExactResume()],
            enable_checkpointing=False,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        ).fit(run.Tiny(), loaders)

    with pytest.raises(InvalidArgumentError, match="persistent_workers"):
        fit(run.loader(1, persistent_workers=True))
    with pytest.raises(InvalidArgumentError, match="one training torch DataLoader"):
        fit([run.loader(), run.loader()])


def test_exact_resume_warns_of_a_checkpoint_amid_gradient_accumulation(run, tmp_path):
    trainer = run.L.Trainer(
        max_epochs=1,
        default_root_dir=tmp_path,
        plugins=[run.TrainstateCheckpointIO()],
        callbacks=[run.ExactResume(), run.ModelCheckpoint(tmp_path, monitor="val_loss")],
        accumulate_grad_batches=3,
        val_check_interval=0.5,  # validation, and a checkpoint, after batch 4: a step is 3 batches
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.warns(UserWarning, match="accumulating gradients over 3 batches"):
        trainer.fit(run.Validated(), run.loader(), run.DataLoader(run.Noisy(12), batch_size=4))


KINDS = {"stream": {"iterable": True}, "shuffled": {}, "validated": {"validate": True}}


@pytest.fixture(scope="module")
def uninterrupted(run: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, torch.Tensor]]:
    return {kind: run.fit(tmp_path_factory.mktemp("reference"), **kw).state_dict() for kind, kw in KINDS.items()}


@pytest.mark.parametrize(
    "kind, every, stop, lightning_io",
    [
        ("stream", 5, 11, False),  # checkpoint at step 10, mid-epoch (8-step epochs), with a batch fetched ahead
        ("shuffled", 8, 16, False),  # a shuffling map-style dataset: checkpoint at step 16, at an epoch's end
        ("shuffled", 5, 11, True),  # mid-epoch, with Lightning's own torch.save plugin (it loads weights_only=True)
        # validation twice an epoch, ModelCheckpoint saving after it: the checkpoint at step 8 is at an epoch's
        # end, and Lightning starts (and drops) an iterator for the finished epoch before the next one's
        ("validated", 0, 10, False),
    ],
)
def test_exact_resume_in_process(run, tmp_path, uninterrupted, kind, every, stop, lightning_io):
    """Augmentation drawn in this process (num_workers=0) is interleaved with the training's own draws: the
    batch Lightning had fetched ahead at the save is loaded again from the RNG it was loaded from."""
    kwargs = {**KINDS[kind], "every": every, "lightning_io": lightning_io}
    with pytest.raises(run.Interrupted):
        run.fit(tmp_path, callbacks=(run.Interrupt(stop),), **kwargs)
    resumed = run.fit(tmp_path, **kwargs)
    assert_same(resumed.state_dict(), uninterrupted[kind])
    plain = run.fit(_copy_checkpoints(tmp_path), exact=False, **kwargs)
    assert any(not torch.equal(plain.state_dict()[k], v) for k, v in uninterrupted[kind].items())


def _copy_checkpoints(root: pathlib.Path) -> pathlib.Path:
    import shutil

    other = root.parent / f"{root.name}-plain"
    shutil.copytree(root / "checkpoints", other / "checkpoints", symlinks=True)
    return other


def test_a_resume_amid_gradient_accumulation_does_not_save_its_step_again(run, tmp_path):
    """ModelCheckpoint does not keep the step it saved last: resumed at step 3 with two batches a step, it
    saved step 3 again after the first batch (amid accumulation) over the good checkpoint, and a second
    interruption then resumed inexactly. Two interruptions, and the run ends as one never interrupted."""
    import warnings

    class Saves(run.L.Callback):
        def __init__(self) -> None:
            self.saved: list[tuple[int, int]] = []

        def on_save_checkpoint(self, trainer: Any, module: Any, checkpoint: Any) -> None:
            self.saved.append((trainer.global_step, trainer.fit_loop.epoch_loop.batch_progress.current.processed))

    def fit(root: pathlib.Path, *callbacks: Any) -> Any:
        run.L.seed_everything(0, verbose=False)
        model = run.Tiny()
        trainer = run.L.Trainer(
            max_epochs=2,
            default_root_dir=root,
            plugins=[run.TrainstateCheckpointIO()],
            callbacks=[
                run.ExactResume(),
                run.ModelCheckpoint(root / "checkpoints", every_n_train_steps=3, save_last=True),
                *callbacks,
            ],
            accumulate_grad_batches=2,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(model, run.loader(), ckpt_path="last")
        return model

    reference = fit(tmp_path / "reference").state_dict()
    run_dir = tmp_path / "run"
    with pytest.raises(run.Interrupted):
        fit(run_dir, run.Interrupt(5))  # last.ckpt: step 3, 6 of the epoch's 8 batches in
    saves = Saves()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="ExactResume")  # no checkpoint amid accumulation
        with pytest.raises(run.Interrupted):
            fit(run_dir, saves, run.Interrupt(5))  # resumed at step 3, stopped again at step 5
    assert saves.saved == []  # step 3 was not saved again after the first batch, amid accumulation
    resumed = fit(run_dir).state_dict()
    assert_same(resumed, reference)


def test_slurm_auto_resume_is_not_misled_by_a_killed_saves_staging_directory(run, tmp_path, monkeypatch):
    """Lightning's SLURM auto-resume reads the number after ``hpc_ckpt_`` in every name of the run directory
    (and ``hpc_save_path`` after ``ckpt_``). A save of hpc_ckpt_2.ckpt killed before its commit, and a delete
    of hpc_ckpt_3.ckpt killed before it finished, left hidden siblings; their names held the target's name and
    random hex digits, so Lightning picked a checkpoint that does not exist and the restarted job failed."""
    plugin = run.TrainstateCheckpointIO()

    def trainer(steps: int) -> Any:
        return run.L.Trainer(
            max_steps=steps,
            default_root_dir=tmp_path,
            plugins=[plugin],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )

    run.L.seed_everything(0, verbose=False)
    first = trainer(2)
    first.fit(run.Tiny(), run.loader())
    for n in (1, 2, 3):
        first.save_checkpoint(tmp_path / f"hpc_ckpt_{n}.ckpt")
    storage = trainstate.LocalStorage()
    storage.hide(str(tmp_path / "hpc_ckpt_3.ckpt"))  # a delete killed between its rename and its removal
    storage.begin(str(tmp_path / "hpc_ckpt_2.ckpt"), overwrite=True)  # a save of it killed before its commit
    leftovers = [n for n in _names(tmp_path) if n.startswith(".")]
    assert len(leftovers) == 2
    assert not [n for n in leftovers if "ckpt_" in n]  # nothing a name scanner takes for a checkpoint

    second = trainer(4)
    assert second._checkpoint_connector._hpc_resume_path == str(tmp_path / "hpc_ckpt_2.ckpt")
    assert second._checkpoint_connector.hpc_save_path(tmp_path) == str(tmp_path / "hpc_ckpt_3.ckpt")
    monkeypatch.setenv("SLURM_NTASKS", "1")
    second.fit(run.Tiny(), run.loader(), ckpt_path="hpc")  # Lightning resolves "hpc" itself
    assert second.global_step == 4


def test_async_saves_in_flight_count_for_modelcheckpoints_version_names(run, tmp_path):
    """ModelCheckpoint with a fixed file name asks the filesystem whether ``fixed.ckpt`` exists to choose
    ``fixed-v1.ckpt``, ``fixed-v2.ckpt``...; a background save still in flight was not there yet, so the next
    save took the same name and replaced it: 2 of 4 checkpoints were lost without a word. The name is now
    reserved when the save is asked for, so the names are those of a run that saves in the foreground."""
    checkpoints = tmp_path / "checkpoints"

    def fit(async_save: bool) -> list[str]:
        run.L.seed_everything(0, verbose=False)
        shutil.rmtree(checkpoints, ignore_errors=True)
        run.L.Trainer(
            max_steps=4,
            default_root_dir=tmp_path,
            plugins=[run.TrainstateCheckpointIO(async_save=async_save)],
            callbacks=[
                run.ModelCheckpoint(checkpoints, filename="fixed", save_top_k=-1, every_n_train_steps=1, monitor="step")
            ],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        ).fit(run.Tiny(), run.loader())
        steps = []
        for name in _names(checkpoints):
            with trainstate.open(checkpoints / name) as ck:
                steps.append(f"{name}:{ck.metadata['step']}")
        return steps

    expected = ["fixed-v1.ckpt:2", "fixed-v2.ckpt:3", "fixed-v3.ckpt:4", "fixed.ckpt:1"]
    assert fit(async_save=False) == expected
    assert fit(async_save=True) == expected


def test_a_module_passed_as_a_hyperparameter_is_refused_by_name(run, tmp_path):
    """A loss module passed to __init__ is a hyperparameter to save_hyperparameters() (Lightning only warns);
    it was saved as its state_dict() and came back as ``{}``, not the loss, without a word."""

    class WithLoss(run.Tiny):
        def __init__(self, loss: Any = None) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.loss = loss

    trainer = run.L.Trainer(
        max_steps=1,
        default_root_dir=tmp_path,
        plugins=[run.TrainstateCheckpointIO()],
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(WithLoss(loss=torch.nn.SmoothL1Loss(beta=0.5)), run.loader())
    with pytest.raises(UnsupportedValueError, match=r"hyper_parameters\.loss.*SmoothL1Loss.*ignore=\['loss'\]") as e:
        trainer.save_checkpoint(tmp_path / "a.ckpt")
    assert str(e.value).count("save_hyperparameters(ignore=") == 1  # said once, not again in general terms
    plugin = run.TrainstateCheckpointIO()
    with pytest.raises(UnsupportedValueError, match=r"datamodule_hyper_parameters\.net.*ignore=\['net'\]"):
        plugin.save_checkpoint({"datamodule_hyper_parameters": {"net": torch.nn.Linear(2, 2)}}, tmp_path / "b.ckpt")
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".ckpt") or p.name.startswith(".")]


def test_omegaconf_hyperparameters_come_back_as_omegaconf(run, tmp_path):
    """A DictConfig among the hyperparameters came back as a plain dict (and one given whole to
    save_hyperparameters was refused for the class Lightning stores beside it)."""
    import omegaconf  # a test dependency: this test never skips

    cfg = omegaconf.OmegaConf.create({"lr": 0.1, "model": {"layers": [4, 8], "act": "relu"}, "ref": "${lr}"})
    plugin = run.TrainstateCheckpointIO()
    nested = {"hyper_parameters": {"cfg": cfg, "tags": omegaconf.OmegaConf.create(["a", "b"])}, "global_step": 1}
    plugin.save_checkpoint(nested, tmp_path / "nested.ckpt")
    got = plugin.load_checkpoint(tmp_path / "nested.ckpt")["hyper_parameters"]
    assert isinstance(got["cfg"], omegaconf.DictConfig) and isinstance(got["tags"], omegaconf.ListConfig)
    assert got["cfg"] == cfg and got["cfg"].ref == 0.1 and list(got["tags"]) == ["a", "b"]

    class FromConfig(run.Tiny):
        def __init__(self, cfg: Any) -> None:
            super().__init__()
            self.save_hyperparameters(cfg)

    trainer = run.L.Trainer(
        max_steps=1,
        default_root_dir=tmp_path,
        plugins=[plugin],
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(FromConfig(cfg), run.loader())
    trainer.save_checkpoint(tmp_path / "whole.ckpt")
    got = plugin.load_checkpoint(tmp_path / "whole.ckpt")
    assert got["hparams_type"] is omegaconf.DictConfig  # as Lightning's own checkpoint holds it
    assert isinstance(got["hyper_parameters"], omegaconf.DictConfig) and got["hyper_parameters"] == cfg
