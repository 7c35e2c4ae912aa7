"""PyTorch Lightning: Lightning's checkpoints written by trainstate, and resumed exactly.

``TrainstateCheckpointIO`` is a Lightning ``CheckpointIO`` plugin: every checkpoint Lightning writes
(``ModelCheckpoint``'s ``epoch=0-step=10.ckpt`` and ``last.ckpt``, ``trainer.save_checkpoint``) becomes a
trainstate checkpoint directory at that path — pickle-free, checksummed, committed atomically, optionally
written in the background — and ``ckpt_path="last"`` / ``"best"`` / a path load it back. ``ExactResume`` is a
callback that also saves what Lightning leaves out (the random number generators and the data loader's place
in its epoch), so a run killed mid-epoch and resumed ends bit-identical to one never interrupted.

Under DDP Lightning hands the checkpoint to rank 0 alone, which saves it as one process does (compression and
encryption included); ``ExactResume`` gathers every rank's generators and data position into it, and each rank
gets its own back. FSDP, ``ModelParallelStrategy`` and DeepSpeed write their checkpoints with their own code, not
through a ``CheckpointIO``: the plugin does not reach them.

Works with ``lightning`` (``import lightning as L``) and ``pytorch_lightning``; ``pip install
"trainstate[lightning]"``. docs/lightning.md has the details.

Example:
    >>> import lightning as L
    >>> from trainstate.integrations.lightning import ExactResume, TrainstateCheckpointIO
    >>> trainer = L.Trainer(plugins=[TrainstateCheckpointIO()], callbacks=[ExactResume()])
    >>> trainer.fit(model, train_loader, ckpt_path="last")
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from trainstate import _keys
from trainstate._cores import DEFAULT_THREADS
from trainstate._format.manifest import MANIFEST_NAME
from trainstate._format.run_dir import staged_target, staging_name
from trainstate._optional import optional
from trainstate._restore import ABSENT, restore
from trainstate._restore.checkpoint import open_checkpoint
from trainstate._rng import RNGState
from trainstate._save.background import BackgroundSaver
from trainstate._save.options import save_options
from trainstate._saving import save_alone
from trainstate._storage import LocalStorage, resolve
from trainstate.errors import (
    CheckpointExistsError,
    InvalidArgumentError,
    StateMismatchError,
    UnsupportedValueError,
)
from trainstate.integrations import _lightning_dict as lightning_dict


def _import_lightning() -> tuple[Any, Any]:
    """``lightning.pytorch`` and its ``CheckpointIO`` base, or ``pytorch_lightning``'s where that is the
    Lightning the program uses (each package has its own classes; both are installed with ``lightning``)."""
    import importlib

    standalone = ("pytorch_lightning", "lightning_fabric")
    unified = ("lightning.pytorch", "lightning.fabric")
    order = (
        [standalone, unified]
        if "pytorch_lightning" in sys.modules and "lightning" not in sys.modules
        else [unified, standalone]
    )
    for i, (trainer_pkg, fabric_pkg) in enumerate(order):
        try:
            module = importlib.import_module(trainer_pkg)
            base = importlib.import_module(f"{fabric_pkg}.plugins.io.checkpoint_io").CheckpointIO
        except ImportError:
            if i == len(order) - 1:
                raise
            continue
        return module, base
    raise AssertionError  # unreachable: the last failure raised


with optional("lightning", extra="lightning", needed_for="trainstate.integrations.lightning"):
    import torch
    from torch.utils.data import DataLoader

    from trainstate._replay import EpochReplay
    from trainstate.integrations import _lightning_stream as stream
    from trainstate.integrations._lightning_stream import Stream

    _lightning: tuple[Any, Any] = _import_lightning()
    pl: Any = _lightning[0]
    CheckpointIO: Any = _lightning[1]  # the base class Lightning's Trainer checks plugins against

__all__ = ["ExactResume", "TrainstateCheckpointIO"]

log = logging.getLogger("trainstate")

_TORCH_MAGIC = (b"PK\x03\x04", b"\x80")  # a torch.save file: a zip archive, or a legacy pickle


class TrainstateCheckpointIO(CheckpointIO):  # type: ignore[misc]  # Lightning's base class, found at import
    """A Lightning ``CheckpointIO`` that saves and loads checkpoints with trainstate.

    Pass it to the Trainer; ``ModelCheckpoint``, ``ckpt_path="last"`` / ``"best"`` and your callbacks work as
    before. Each checkpoint path Lightning names (``epoch=0-step=10.ckpt``, ``last.ckpt``) becomes a
    checkpoint directory (data files and a manifest, written last as the commit), replaced atomically when
    Lightning saves over it. ``trainstate inspect`` / ``verify`` / ``export`` read it like any other.

    Args:
        async_save: write in the background. The save copies the tensors into a reused host buffer and
            returns; deletions Lightning asks for (``ModelCheckpoint``'s top-k) wait until the saves asked
            for before them have committed, and are skipped if one failed. A failed background save raises on
            the next save, load, removal or at the end of ``fit``.
        fsync: flush the files to stable storage before the commit.
        compression: ``"zstd"`` or ``"zstd:LEVEL"`` (``pip install "trainstate[zstd]"``).
        key: encrypt with this key (``trainstate.generate_key()``); ``key_env``: the name of an environment
            variable holding it. Loading uses the same key.
        threads: writer threads.
        read_torch_files: also load ``.ckpt`` files that Lightning's default plugin wrote with
            ``torch.save`` (to switch a run that is under way to trainstate); they are read with Lightning's
            own ``torch.load``. Off by default: such a file is refused by name.

    Example:
        >>> trainer = L.Trainer(plugins=[TrainstateCheckpointIO(async_save=True)],
        ...                     callbacks=[ModelCheckpoint(every_n_train_steps=100, save_last=True)])
        >>> trainer.fit(model, loader, ckpt_path="last")
    """

    def __init__(
        self,
        *,
        async_save: bool = False,
        fsync: bool = True,
        compression: str | None = None,
        key: _keys.KeyLike | None = None,
        key_env: str | None = None,
        threads: int = DEFAULT_THREADS,
        read_torch_files: bool = False,
    ) -> None:
        super().__init__()
        for name, value in (("async_save", async_save), ("read_torch_files", read_torch_files)):
            if not isinstance(value, bool):
                raise InvalidArgumentError(f"TrainstateCheckpointIO: {name} must be True or False, got {value!r:.40}")
        # every save replaces what is at its path (Lightning saves last.ckpt again and again)
        self._options = save_options(
            overwrite=True, fsync=fsync, threads=threads, compression=compression, key=key, key_env=key_env
        )
        self.async_save = async_save
        self.fsync = self._options.fsync
        self.compression = compression
        self.threads = self._options.threads
        self.read_torch_files = read_torch_files
        self._saver: BackgroundSaver | None = BackgroundSaver() if async_save else None
        self._reserved: set[str] = set()  # names an async save in flight holds (empty directories)
        _register_with_lightning()

    # -- CheckpointIO ------------------------------------------------------------------------------

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Save Lightning's checkpoint dict as a trainstate checkpoint at ``path`` (replacing one there).

        Lightning calls it (``trainer.save_checkpoint``, ``ModelCheckpoint``); so may you.

        Example:
            >>> io = TrainstateCheckpointIO()
            >>> io.save_checkpoint({"state_dict": model.state_dict(), "epoch": 3}, "ckpts/manual.ckpt")
        """
        if storage_options is not None:
            raise InvalidArgumentError(
                "TrainstateCheckpointIO takes no storage_options in save_checkpoint: set compression, "
                "encryption and fsync on TrainstateCheckpointIO(...) instead"
            )
        target = _path(path)
        try:
            state, conversions = lightning_dict.to_state(checkpoint)
            metadata = _metadata(checkpoint, conversions)
            if self._saver is None:
                # under DDP only rank 0 saves Lightning's checkpoint: never a collective
                write = partial(save_alone, target, state, metadata=metadata, options=self._options)
                _replacing(target, write)
                return
            local = _local(target)
            reserved = local is not None and _reserve(local)
            if reserved:
                self._reserved.add(target)

            def around(write: Callable[[], Any]) -> Any:
                try:
                    return _replacing(target, write)
                finally:
                    self._release(target)

            try:
                self._saver.save(target, state, metadata=metadata, options=self._options, around=around)
            except BaseException:
                self._release(target)
                raise
        except UnsupportedValueError as e:
            raise lightning_dict.explain(e) from None

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load the checkpoint at ``path`` as the dict Lightning saved: torch tensors (on ``map_location``;
        CPU by default), the same nesting and values. ``weights_only`` is accepted and needs nothing:
        trainstate never unpickles.

        Example:
            >>> ckpt = TrainstateCheckpointIO().load_checkpoint("ckpts/last.ckpt")
            >>> ckpt["epoch"], sorted(ckpt["state_dict"])[:1]
        """
        if self._saver is not None:
            self._saver.wait()  # the checkpoint asked for may still be in flight
        target = _path(path)
        if _is_torch_file(target):
            if self.read_torch_files:
                torch_io = sys.modules[CheckpointIO.__module__.replace("checkpoint_io", "torch_io")]
                kwargs = {} if map_location is None else {"map_location": map_location}
                loaded: dict[str, Any] = torch_io.TorchCheckpointIO().load_checkpoint(
                    target, weights_only=weights_only, **kwargs
                )
                return loaded
            raise InvalidArgumentError(
                f"{target} is a torch.save file (Lightning's default TorchCheckpointIO writes them), not a trainstate "
                "checkpoint; to resume from it once, pass TrainstateCheckpointIO(read_torch_files=True): it is read "
                "with torch.load and the checkpoints after it are trainstate's"
            )
        with open_checkpoint(target, key=self._options.key) as ck:
            metadata = ck.metadata if isinstance(ck.metadata, Mapping) else {}
            state = restore(ck, ABSENT, framework=None)  # each array as it was saved: torch or NumPy
        facts = metadata.get(lightning_dict.META_KEY)
        facts = facts if isinstance(facts, Mapping) else {}
        if not isinstance(state, dict):
            raise InvalidArgumentError(f"{target} holds a {type(state).__name__}, not a Lightning checkpoint dict")
        device = _target_device(map_location, list(facts.get("devices") or []))
        state = lightning_dict.from_state(
            state, list(facts.get("conversions") or []), (lambda t: t.to(device)) if device is not None else _same
        )
        if "state_dict" in state and facts.get("ordered_state_dict"):
            state["state_dict"] = lightning_dict.with_module_metadata(
                state["state_dict"], facts.get("state_dict_metadata")
            )
        return state

    def remove_checkpoint(self, path: Any) -> None:
        """Delete the checkpoint at ``path`` (a link to one: the link only); with ``async_save``, once every
        save asked for before has committed. ``ModelCheckpoint`` calls it for checkpoints out of its top k.

        Example:
            >>> TrainstateCheckpointIO().remove_checkpoint("ckpts/epoch=0-step=10.ckpt")
        """
        target = _path(path)
        if self._saver is not None:
            self._saver.then(lambda: _remove(target), f"the removal of {target}")
        else:
            _remove(target)

    def teardown(self) -> None:
        """Wait for background saves (Lightning calls this at the end of ``fit``); raise if one failed.

        Example:
            >>> io = TrainstateCheckpointIO(async_save=True)
            >>> io.teardown()   # as Lightning does after fit: every background save committed
        """
        if self._saver is not None:
            try:
                self._saver.close()
            finally:
                for target in list(self._reserved):  # saves skipped after one failed: no empty name stays
                    self._release(target)

    # -- beyond CheckpointIO -----------------------------------------------------------------------

    def wait(self) -> None:
        """Block until every background save has committed; raise if one failed.

        Example:
            >>> io = TrainstateCheckpointIO(async_save=True)
            >>> trainer = L.Trainer(plugins=[io])
            >>> trainer.save_checkpoint("ckpts/now.ckpt")
            >>> io.wait()       # the checkpoint is committed from here on
        """
        if self._saver is not None:
            self._saver.wait()

    def _release(self, target: str) -> None:
        """Drop the reservation of ``target``: the empty directory goes unless a checkpoint committed there."""
        if target in self._reserved:
            self._reserved.discard(target)
            with contextlib.suppress(OSError):  # not empty: the save committed
                os.rmdir(target)

    def __getstate__(self) -> dict[str, Any]:  # ddp_spawn pickles the Trainer's plugins: the thread stays here
        state = dict(self.__dict__)
        state["_saver"] = None
        state["_reserved"] = set()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._saver = BackgroundSaver() if self.async_save else None


def _same(t: Any) -> Any:
    return t


def _register_with_lightning() -> None:
    """Make the plugin a ``CheckpointIO`` for both Lightning packages that are loaded (``lightning`` and
    ``pytorch_lightning`` each have their own base class, and a Trainer checks against its own)."""
    for name in ("lightning.fabric.plugins.io.checkpoint_io", "lightning_fabric.plugins.io.checkpoint_io"):
        module = sys.modules.get(name)
        base = getattr(module, "CheckpointIO", None)
        if base is not None and not issubclass(TrainstateCheckpointIO, base):
            base.register(TrainstateCheckpointIO)


def _path(path: Any) -> str:
    if isinstance(path, bytes) or not isinstance(path, (str, os.PathLike)):
        raise InvalidArgumentError(f"a checkpoint path must be a str or os.PathLike, got {type(path).__qualname__}")
    return os.fspath(path)


def _local(path: str) -> Path | None:
    backend, root = resolve(path, None)
    return Path(root) if isinstance(backend, LocalStorage) else None


def _is_torch_file(path: str) -> bool:
    local = _local(path)
    if local is None or not local.is_file():
        return False
    with open(local, "rb") as f:
        head = f.read(4)
    return any(head.startswith(m) for m in _TORCH_MAGIC)


def _reserve(local: Path) -> bool:
    """Make ``local`` an empty directory now, for a save that commits there later; False if something is there.

    ``ModelCheckpoint`` asks the filesystem whether a name is taken to choose ``-v1``, ``-v2``: a background
    save still in flight must count, or the next save takes its name and replaces it. The commit renames the
    checkpoint onto the empty directory. A process killed before it leaves the empty directory, which the next
    save of that name fills and which no reader takes for a checkpoint (no manifest).
    """
    local.parent.mkdir(parents=True, exist_ok=True)  # at once, as a save in the foreground would
    try:
        local.mkdir()
    except FileExistsError:
        return False
    return True


def _replacing(path: str, write: Callable[[], Any]) -> Any:
    """Run ``write`` (a save to ``path``) once the path is ready for it (:func:`_make_room`); a file moved
    aside for it is deleted once the save committed, and put back if the save failed."""
    aside = _make_room(path)
    try:
        result = write()
    except BaseException:
        if aside is not None and not os.path.lexists(path):
            aside.rename(path)
        raise
    if aside is not None:
        aside.unlink(missing_ok=True)
    return result


def _make_room(path: str) -> Path | None:
    """Before a save to ``path``: clear what a crashed save of the same name left, drop a link Lightning
    made there (``save_last="link"``; what it points to stays), and move a ``torch.save`` file there aside
    (returned; a non-checkpoint file or directory is refused by the save)."""
    local = _local(path)
    if local is None:
        return None
    backend = LocalStorage()
    backend.recover(str(local))  # a checkpoint a crash left mid-replace goes back first
    prefix = f".{local.name}."  # how earlier versions named them (a scanner of "hpc_ckpt_" names read them)
    names = backend.list(str(local.parent))
    aside = [n for n in names if staged_target(n) == (local.name, "old") and (local.parent / n).is_file()]
    aside += [n for n in names if n.startswith(f"{prefix}replaced-")]
    if aside and not local.exists() and not local.is_symlink():  # a crash after moving a file aside: put it back
        (local.parent / aside[0]).rename(local)
    for name in backend.list(str(local.parent)):
        staged = staged_target(name)
        if (staged is not None and staged[0] == local.name) or (
            name.startswith(prefix) and name[len(prefix) :].split("-", 1)[0] == "replaced"
        ):
            backend.delete(str(local.parent / name))
    if local.is_symlink():
        local.unlink()
    elif local.is_file():
        if not _is_torch_file(str(local)) and local.stat().st_size:
            raise CheckpointExistsError(f"{local} exists and is not a checkpoint; refusing to replace it")
        moved = local.parent / staging_name(local.name, "old")  # a file: recover() leaves it to us
        local.rename(moved)
        return moved
    return None


def _remove(path: str) -> None:
    local = _local(path)
    if local is not None and local.is_dir() and not local.is_symlink() and not (local / MANIFEST_NAME).exists():
        log.warning("not removing %s: a directory without a trainstate manifest (not a checkpoint this wrote)", local)
        return
    backend, root = resolve(path, None)
    backend.delete(root)


def _metadata(checkpoint: Mapping[str, Any], conversions: list[list[Any]]) -> dict[str, Any]:
    devices = sorted({str(t.device) for t in _tensors(checkpoint)})
    facts: dict[str, Any] = {"conversions": conversions, "devices": devices}
    state_dict = checkpoint.get("state_dict")
    facts["ordered_state_dict"] = isinstance(state_dict, OrderedDict)  # what a module's state_dict() returns
    meta = lightning_dict.module_metadata(state_dict)
    if meta is not None:
        facts["state_dict_metadata"] = meta
    version = checkpoint.get("pytorch-lightning_version")
    if isinstance(version, str):
        facts["version"] = version
    out: dict[str, Any] = {lightning_dict.META_KEY: facts}
    for name in ("epoch", "global_step"):
        value = checkpoint.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            out["step" if name == "global_step" else name] = value
    return out


def _tensors(value: Any, depth: int = 0) -> list[Any]:
    if isinstance(value, torch.Tensor):
        return [value]
    if depth > 100:
        return []
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in _tensors(v, depth + 1)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v, depth + 1)]
    return []


def _target_device(map_location: Any, saved: list[str]) -> Any:
    """Where ``map_location`` puts the tensors (None: stay on the CPU they are loaded to), as
    ``torch.load`` would for tensors saved on ``saved`` devices."""
    if map_location is None:
        return None
    if isinstance(map_location, (str, torch.device)):
        return torch.device(map_location)
    source = saved[0] if len(saved) == 1 else None
    if isinstance(map_location, Mapping):
        if source is None:
            if not saved:
                return None
            raise InvalidArgumentError(
                f"map_location as a dict needs a checkpoint saved from one device; this one holds tensors from {saved}: "
                "pass a device instead"
            )
        return torch.device(map_location.get(source, source))
    if callable(map_location):
        moved = map_location(torch.empty(1, dtype=torch.uint8).untyped_storage(), source or "cpu")
        if moved is None:  # torch's "default": the device it was saved from
            return torch.device(source) if source is not None else None
        device = getattr(moved, "device", None)
        if device is None:
            raise InvalidArgumentError(
                f"map_location returned a {type(moved).__qualname__}; expected a storage (or None)"
            )
        return torch.device(device)
    raise InvalidArgumentError(
        f"map_location must be a device, a string, a dict or a function, got {type(map_location).__qualname__}"
    )


class ExactResume(pl.Callback):  # type: ignore[misc]  # Lightning's base class, found at import
    """A callback that makes a resumed Lightning run continue exactly where the interrupted one was.

    Lightning's checkpoint holds the weights, optimizer, schedulers and loop counters, but not the random
    number generators, and a run resumed mid-epoch starts a new shuffle of the data (Lightning #17543). With
    this callback each checkpoint also holds torch's, NumPy's and Python's generators, and where the training
    DataLoader stands in its epoch; on resume the interrupted epoch is replayed: the same shuffle and worker
    seeds, the batches already trained on loaded again and dropped, the random state put back as it was at
    the save. The run then ends bit-identical to one never interrupted (same data, same dropout masks).

    It needs one training ``torch.utils.data.DataLoader`` (any sampler, any ``num_workers``; not
    ``persistent_workers=True``). Replaying costs loading the batches the epoch had already trained on.
    It changes nothing in a run that is not resumed.

    A loader whose batch sampler is a ``trainstate.ResumableSampler(global_batch_size=...)`` (built with the
    Trainer's ``world_size`` and ``global_rank``, ``use_distributed_sampler=False``) is not replayed: the
    checkpoint holds the global stream's position, and the run resumes exactly on any number of processes
    (docs/lightning.md, "Resuming on another number of processes").

    Example:
        >>> trainer = L.Trainer(plugins=[TrainstateCheckpointIO()],
        ...                     callbacks=[ExactResume(), ModelCheckpoint(every_n_train_steps=100, save_last=True)])
        >>> trainer.fit(model, loader, ckpt_path="last")
    """

    def __init__(self) -> None:
        super().__init__()
        self._trainer: Any = None
        self._replay: Any = None  # trainstate._replay.EpochReplay of the training loader
        self._loader: weakref.ref[Any] | None = None
        self._pending: Mapping[str, Any] | None = None  # a loaded state not yet applied to a loader
        self._strategy: Any = None
        self._resumed = False  # this fit loaded a checkpoint
        self._stream: Stream | None = None  # the loader's global-stream sampler (no replay needed), watched

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Lightning's hook before fitting: catch the training DataLoader before its first batch.

        Example:
            >>> trainer = L.Trainer(callbacks=[ExactResume()])   # Lightning calls setup(trainer, module, "fit")
        """
        self._trainer = trainer
        self._resumed = False  # Lightning loads a checkpoint after setup, if it is given one
        if stage == "fit":
            self._wrap_process_dataloader(trainer.strategy)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Lightning's hook after fitting: give the strategy and the DataLoader back as they were.

        Example:
            >>> trainer.fit(model)   # Lightning calls teardown(trainer, model, "fit") at the end
        """
        if stage == "fit":
            self._unwrap_process_dataloader()
            self._detach()

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """Lightning's hook as training starts: check there is one training DataLoader to replay.

        Example:
            >>> trainer.fit(model, train_dataloaders=DataLoader(data, shuffle=True))   # one DataLoader: fine
        """
        loader = trainer.train_dataloader
        if not isinstance(loader, DataLoader) or self._loader is None or self._loader() is not loader:
            raise InvalidArgumentError(
                "ExactResume replays one training torch DataLoader; train_dataloader() gave "
                f"{type(loader).__qualname__}: return a single torch.utils.data.DataLoader, or drop ExactResume"
            )
        if self._stream is not None:
            stream.check(self._stream.sampler, trainer)
        if self._resumed:
            # The step resumed from is saved: it was just loaded. ModelCheckpoint does not keep which step it
            # saved last, so with accumulate_grad_batches > 1 it would save that step again after the first
            # batch (the step has not advanced yet), over the good checkpoint, amid accumulation.
            for callback in trainer.checkpoint_callbacks:
                if hasattr(callback, "_last_global_step_saved"):
                    callback._last_global_step_saved = trainer.global_step

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        """Lightning's hook after each training batch: one more batch of the loader's iterator trained on (the
        global stream's position counts these, not the batches Lightning fetched ahead).

        Example:
            >>> trainer.fit(model)   # Lightning calls on_train_batch_end(...) after each batch
        """
        if self._stream is not None:
            self._stream.batch_trained()

    def state_dict(self) -> dict[str, Any]:
        """What Lightning stores for this callback in each checkpoint: the random generators and the
        DataLoader's place in its epoch, as tensors. Under DDP (a torch.distributed process group) it also
        holds every rank's, under ``ranks`` (gathered from every rank: Lightning builds the checkpoint on each,
        then rank 0 writes it), and each rank gets its own back at the same number of ranks.

        Example:
            >>> sorted(ExactResume().state_dict())
            ['rng']
        """
        # tensors, not NumPy arrays: Lightning's default plugin loads with torch.load(weights_only=True) too
        loader = self._loader() if self._loader is not None else None
        rng = EpochReplay.rng(loader) if loader is not None and self._stream is None else RNGState().state_dict()
        state: dict[str, Any] = {"rng": _tensors_only(rng)}
        trainer = self._trainer
        if trainer is not None and self._stream is not None:  # the global stream: a position at any world size
            ranks = _every_rank(state)  # only the generators are each rank's own; the position is the job's
            state["stream"] = self._stream.position(int(trainer.accumulate_grad_batches))
            state["step"] = int(trainer.global_step)
            processed = int(trainer.fit_loop.epoch_loop.batch_progress.current.processed)
            state["mid_epoch"] = 0 < processed < trainer.num_training_batches  # Lightning goes on with its epoch
            if ranks is not None:
                state["ranks"] = ranks
            return state
        if trainer is not None and self._replay is not None:
            trained = int(trainer.fit_loop.epoch_loop.batch_progress.current.processed)
            if 0 < trained < trainer.num_training_batches:  # mid-epoch: the next run replays it
                if trained % trainer.accumulate_grad_batches:
                    warnings.warn(
                        f"ExactResume: this checkpoint is taken after batch {trained} of the epoch, in the middle of "
                        f"accumulating gradients over {trainer.accumulate_grad_batches} batches; the gradients "
                        "are not in a checkpoint, so a run resumed from it is not exact: save every multiple of "
                        "accumulate_grad_batches (val_check_interval too, when ModelCheckpoint saves after "
                        "validation)",
                        stacklevel=2,
                    )
                position = self._replay.position(trained)
                if position is not None:
                    state["loader"] = _tensors_only(position)
        ranks = _every_rank(state)
        if ranks is not None:  # DDP: rank 0 writes the checkpoint, but each rank's generators are its own
            state["ranks"] = ranks
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take a checkpoint's state back (Lightning calls it on ``fit(ckpt_path=...)``): the epoch is replayed
        up to the saved batch when training starts, and the random generators put back there.

        Example:
            >>> trainer.fit(model, ckpt_path="last")   # Lightning calls load_state_dict(saved) on resume
        """
        trainer = self._trainer
        if trainer is None or trainer.state.fn != "fit":
            return  # validate / test / predict from a checkpoint: nothing to resume
        self._resumed = True
        if "stream" in state_dict:  # saved over the global stream: restores at any number of processes
            state = _on_cpu(state_dict)
            rng = stream.generators(state, *_rank_and_world())
        else:
            state = _own_rank(_on_cpu(state_dict))
            rng = state["rng"]
        if rng is not None:
            RNGState().load_state_dict(rng)  # an epoch that ended at the save starts from it
        self._pending = state
        attached = self._replay is not None or self._stream is not None
        if attached and self._loader is not None and self._loader() is not None:
            self._apply_pending()

    # -- inside ------------------------------------------------------------------------------------

    def _wrap_process_dataloader(self, strategy: Any) -> None:
        """Lightning asks the strategy to process each DataLoader before its first iterator starts: the one
        place to watch the training loader in time (its first iterator starts before any training hook)."""
        original = strategy.process_dataloader
        if getattr(original, "_trainstate_exact_resume", None) is self:
            return
        callback = weakref.ref(self)

        def process_dataloader(dataloader: Any) -> Any:
            dataloader = original(dataloader)
            me = callback()
            if me is not None and me._trainer is not None and me._trainer.training:
                me._attach(dataloader)
            return dataloader

        process_dataloader._trainstate_exact_resume = self  # type: ignore[attr-defined]
        strategy.process_dataloader = process_dataloader
        self._strategy = strategy

    def _unwrap_process_dataloader(self) -> None:
        strategy, self._strategy = self._strategy, None
        if (
            strategy is not None
            and getattr(strategy.__dict__.get("process_dataloader"), "_trainstate_exact_resume", None) is self
        ):
            del strategy.process_dataloader

    def _attach(self, loader: Any) -> None:
        if not isinstance(loader, DataLoader):
            return  # on_train_start names what it got
        if self._loader is not None and self._loader() is loader:
            return
        self._detach()
        sampler = stream.global_sampler(loader)
        if sampler is not None:
            self._stream = Stream(sampler, loader)
        else:
            self._replay = EpochReplay(loader)
        self._loader = weakref.ref(loader)
        if self._pending is not None:
            self._apply_pending()

    def _apply_pending(self) -> None:
        state, self._pending = self._pending, None
        assert state is not None
        if ("stream" in state) != (self._stream is not None):
            saved, now = ("a", "no") if "stream" in state else ("no", "a")
            raise StateMismatchError(
                [],
                [],
                [("train loader", f"{now} ResumableSampler(global_batch_size=...)", f"{saved} global stream")],
                hint="ExactResume resumes a loader the way it was saved: over the global sample stream (a "
                "ResumableSampler with global_batch_size as the batch sampler) or by replaying a plain loader; "
                "train with the loader the checkpoint was saved with",
            )
        if self._stream is not None:
            stream.resume(self._stream.sampler, state["stream"], bool(state.get("mid_epoch", False)))
            return
        self._replay.resume(state.get("loader") or None, state["rng"])

    def _detach(self) -> None:
        loader = self._loader() if self._loader is not None else None
        if self._replay is not None and loader is not None:
            self._replay.close(loader)
        if self._stream is not None and loader is not None:
            self._stream.close(loader)
        self._replay, self._loader, self._stream = None, None, None


def _every_rank(state: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Under torch.distributed (Lightning's DDP), every rank's ``state``, by rank; None in one process.
    Lightning builds the checkpoint on every rank (then rank 0 alone writes it), so every rank is here."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    gathered: list[Any] = [None] * dist.get_world_size()
    # as NumPy arrays: torch's unpickling of a tensor's storage in all_gather_object fails on CPU
    dist.all_gather_object(gathered, _arrays({k: v for k, v in state.items() if k != "ranks"}))
    return [_tensors_only(one) for one in gathered]


def _arrays(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    if isinstance(value, Mapping):
        return {k: _arrays(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_arrays(v) for v in value]
    return value


def _rank_and_world() -> tuple[int, int]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _own_rank(state: Mapping[str, Any]) -> Mapping[str, Any]:
    """This rank's part of a saved ExactResume state: its own generators and data position when the
    checkpoint holds every rank's (saved under DDP) and the world size is the same; else the state saved
    (rank 0's), with a warning when the ranks' do not fit."""
    ranks = state.get("ranks")
    if not ranks:
        return state
    rank, world = _rank_and_world()
    if world != len(ranks):
        warnings.warn(
            f"ExactResume: this checkpoint holds the random generators of {len(ranks)} ranks and the run has "
            f"{world}: every rank takes rank 0's, so the resume is not exact; resume with {len(ranks)} ranks for that",
            stacklevel=3,
        )
        return state
    own: Mapping[str, Any] = ranks[rank]
    return own


def _tensors_only(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value.copy())
    if isinstance(value, Mapping):
        return {k: _tensors_only(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_tensors_only(v) for v in value]
    return value


def _on_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, Mapping):
        return {k: _on_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_on_cpu(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_on_cpu(v) for v in value)
    return value
