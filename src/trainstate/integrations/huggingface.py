"""The Hugging Face ``Trainer``: trainstate checkpoints on its save events, and a resume that is exact.

Add one callback, and pass what it returns to ``train``::

    from trainstate.integrations.huggingface import TrainstateCallback

    cb = TrainstateCallback("runs/exp1", keep_last=3, async_save=True)
    trainer = Trainer(model=model, args=args, train_dataset=train, callbacks=[cb])
    trainer.train(resume_from_checkpoint=cb.resume_point(trainer))   # None on a fresh run

When: the Trainer's own ``save_strategy`` / ``save_steps`` decide, as they would for its own checkpoints. Its
``DefaultFlowCallback`` raises ``control.should_save`` at the end of a step or epoch; this callback takes that save
over (it lowers the flag, so the Trainer writes no ``checkpoint-N`` folder of pickles) and writes the trainstate
checkpoint once the step's logging and evaluation are done: at the next event of the loop, before anything
trains again. A save the Trainer decides on later than that (``save_strategy="best"``) it cannot take over: the
Trainer writes its own checkpoint then, and this callback saves beside it, on ``on_save``.

What: the model, the optimizer (keyed by parameter names), the LR scheduler, the GradScaler when there is
one, the process's random generators, the ``TrainerState`` (with its callbacks' exported states) and the data
position. A checkpoint is a trainstate checkpoint like any other: committed atomically, checksummed, no pickle,
kept or deleted by the manager's retention policies, readable with ``trainstate.load`` and the CLI.

Resume: the Trainer resumes its loop only through ``resume_from_checkpoint``, from a folder it can read.
:meth:`TrainstateCallback.resume_point` picks the newest checkpoint that verifies and writes a small stand-in
folder (``_hf_resume.py``): the saved ``trainer_state.json`` (from which the Trainer takes its global step,
epoch and the batches to skip) and an empty weights index. When training begins, the callback restores
everything from the checkpoint, checks that the data position still fits, and puts the generators back where the
loop was when the checkpoint was taken (after the resumed epoch's first batch is fetched, or before its iterator
starts at an epoch boundary). With ``seed_per_sample`` (the default) randomness in fetching batches is a function of
the sample (``_hf_data.py``), so a resume is bit-exact where the Trainer's own is not (transformers #39215).

DDP (several processes, ``torchrun``): every rank builds the callback and its manager, and every rank takes part
in each save and restore (the manager's collective saves: each rank writes its share of one checkpoint, the
replicated model and optimizer once between them, compressed / encrypted as in one process). The generators are
saved per rank; the ``TrainerState`` saved is rank 0's (each rank logs its own run times), as the Trainer writes
rank 0's ``trainer_state.json``. Rank 0 picks the checkpoint to resume from, and every rank resumes from it.

Another number of processes (2 -> 1, say): the Trainer's order of samples under accelerate does not depend on the
world size, and optimizer step ``s`` takes the samples ``[s * G, (s + 1) * G)`` of each epoch's order, ``G`` the
global batch (``per_device_train_batch_size * gradient_accumulation_steps * processes``). So a resume at another
number of processes is exact in its data when it keeps ``G`` (double the per-device batch or the accumulation when
halving the processes) and the updates per epoch, dataset, seed and seeding; anything else is refused by name
(``_hf_data.elastic_differences``). The epoch's last update is the exception when the dataset is not a multiple
of per-device batch x processes (accelerate's ``even_batches`` pads it; a warning says so). Each sample's
augmentation is seeded from ``(seed, epoch, index)``, the same at any world size. The generators saved per rank
cannot be any new rank's own: each is re-derived from ``(args.seed, the checkpoint's step, its rank)``
(``DeferredRNG.rederive``), so dropout continues on another stream than an uninterrupted run's. DeepSpeed and
FSDP are refused (:meth:`_check`).
"""

from __future__ import annotations

import inspect
import logging
import os
import weakref
from collections.abc import Sequence
from typing import Any

from trainstate._optional import optional

with optional("transformers", extra="huggingface", needed_for="trainstate.integrations.huggingface"):
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
    from transformers.trainer_callback import ExportableState

from trainstate._frameworks import load_takes_strict, unwrapped
from trainstate._manager import CheckpointManager
from trainstate._manager.newest import newest_restorable
from trainstate._manager.policies import CheckpointInfo, KeepBest
from trainstate._manager.ranks import ManagerRanks
from trainstate._restore.checkpoint import open_checkpoint
from trainstate.errors import (
    CheckpointError,
    InvalidArgumentError,
    StateMismatchError,
)
from trainstate.integrations import _hf_data as data
from trainstate.integrations import _hf_resume as stand_in
from trainstate.integrations._hf_state import DeferredRNG, Record, TrainerStateView, numbers, plain

__all__ = ["TrainstateCallback"]

log = logging.getLogger("trainstate")

_WHEN = ("every_steps", "every_seconds", "at_steps", "save_policies")
_OWN = {"capture_rng": "the callback saves the RNG itself", "read_only": "the callback saves"}
_MANAGER_OPTIONS = frozenset(inspect.signature(CheckpointManager.__init__).parameters) - {"self", "directory"}


class _OnTheTrainersEvents:
    """The manager's save policy under the callback: save the step the Trainer decided to save (``due``), with
    the Trainer's reason; nothing else (a preemption signal saves anyway, at the end of the step under way)."""

    def __init__(self) -> None:
        self.due: int | None = None
        self.reason = ""

    def reason_to_save(self, step: int, now: float, last_save_time: float) -> str | None:
        return self.reason if step == self.due else None

    def __repr__(self) -> str:
        return "the Trainer's save events"


class _TheTrainersBest:
    """A retention policy under the callback: keep the checkpoint of the step the Trainer records as best
    (``TrainerState.best_global_step``). The Trainer takes a new best only when it is strictly better, so on a
    tie its best is the first; ``keep_best`` keeps the newest of a tie, and would delete the Trainer's."""

    def __init__(self) -> None:
        self.step: int | None = None  # the Trainer's best_global_step, set before each save

    def votes(self, checkpoints: Sequence[CheckpointInfo]) -> dict[str, str | None]:
        return {c.name: "the Trainer's best (best_global_step)" for c in checkpoints if c.step == self.step}

    def __repr__(self) -> str:
        return "the Trainer's best"


class TrainstateCallback(TrainerCallback):  # type: ignore[misc]
    """Writes trainstate checkpoints on the Trainer's save events; :meth:`resume_point` resumes from them.

    Args:
        directory: the run directory the checkpoints go to (a local path or an fsspec URL), one
            ``step_NNNNNNNN`` per save, named by the Trainer's global step.
        seed_per_sample: make randomness in fetching batches (augmentation in the dataset, a masking collator)
            a function of the sample's ``(seed, epoch, index)``, so a resumed run fetches the very batches the
            interrupted one would have. It changes those draws from what the Trainer alone would make (not their
            distribution); with ``False`` they are the Trainer's, and a resume reproduces them only when fetching
            a batch draws no random number.
        **options: the :class:`~trainstate.CheckpointManager`'s options: retention (``keep_last``,
            ``keep_best=("eval_loss", "min", 2)``, ``keep_every_steps``, ...), ``async_save``, ``fsync``,
            ``storage``, ``compression``, ``key``, ``incremental``, ``metadata``... Not its save schedule
            (``every_steps`` and the like): the Trainer's ``save_strategy`` and ``save_steps`` decide when.

    The Trainer's own checkpoint folders are not written (``save_total_limit`` has nothing to delete; retention is
    the manager's). A preemption signal (SIGTERM, SIGINT, SIGUSR1) saves at the end of the current step and stops
    training; :attr:`preempted` says so after ``train()`` returns.

    Under DDP (``torchrun``) build the callback on every rank with the same options: the ranks save each checkpoint
    together (``compression`` and ``key`` included), and a signal that reaches one rank stops and saves them all.

    Attributes:
        resumed_from: the step of the checkpoint :meth:`resume_point` picked, or None (a fresh run).

    Raises:
        InvalidArgumentError: a save schedule or an unknown option (at once); ``save_strategy="no"``,
            DeepSpeed, FSDP, several processes without a collective manager (``collective=False``), a second
            TrainstateCallback on the Trainer,
            ``load_best_model_at_end`` without a ``keep_best`` on its metric in the Trainer's direction
            (``greater_is_better``), or a fresh start in a directory that holds checkpoints without :meth:`resume_point` having
            looked at them (when training begins).

    Example:
        >>> cb = TrainstateCallback("runs/exp1", keep_last=3, keep_best=("eval_loss", "min", 1), async_save=True)
        >>> trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=val, callbacks=[cb])
        >>> trainer.train(resume_from_checkpoint=cb.resume_point(trainer))
        >>> cb.manager.best().step
        400
    """

    def __init__(self, directory: str | os.PathLike[str], *, seed_per_sample: bool = True, **options: Any) -> None:
        schedule = [k for k in options if k in _WHEN]
        if schedule:
            raise InvalidArgumentError(
                f"TrainstateCallback saves on the Trainer's save events, so it takes no save schedule ({', '.join(schedule)}): "
                "set TrainingArguments(save_strategy='steps', save_steps=N) (or 'epoch') instead"
            )
        for name, why in _OWN.items():
            if name in options:
                raise InvalidArgumentError(f"TrainstateCallback takes no {name}= ({why})")
        unknown = sorted(k for k in options if k not in _MANAGER_OPTIONS)
        if unknown:
            raise InvalidArgumentError(
                f"TrainstateCallback got unknown option(s) {', '.join(unknown)}: it takes CheckpointManager's "
                f"options, {', '.join(sorted(_MANAGER_OPTIONS - set(_WHEN) - set(_OWN)))}"
            )
        if not isinstance(seed_per_sample, bool):
            raise InvalidArgumentError(f"seed_per_sample must be True or False, got {seed_per_sample!r:.40}")
        self.seed_per_sample = seed_per_sample
        self._directory = directory
        self._options = options
        self._policy = _OnTheTrainersEvents()
        self._best = _TheTrainersBest()
        # checks the options and the directory now; the manager that saves (and locks the directory) opens when
        # training begins (or at resume_point), so building the callback again in a notebook finds no lock held
        self._manager = self._new_manager(read_only=True)
        self._closed = True
        self._trainer: weakref.ReferenceType[Any] | None = None
        self._state: Any = None  # the Trainer's live TrainerState and TrainerControl, as the events pass them
        self._control: Any = None
        self._live: dict[str, Any] | None = None  # what is saved: references to the live objects
        self._began: Any = None  # the TrainerState of the train() call set up
        self._rng = DeferredRNG()
        self._trainer_state = TrainerStateView(lambda: self._state, self._exported, self._flos)
        self._position = Record(lambda: data.position(self._args, self._state, self._loader, self._seeding is not None))
        self._args: Any = None
        self._loader: Any = None
        self._epoch = data.Epoch(0)
        self._seeding: data.Installed | None = None
        self._pending: int | None = None  # a step whose save the callback took over and will write
        self._saved: int | None = None  # the step saved last
        self._metrics_step = -1
        self._metrics: dict[str, float] = {}
        self._resume: tuple[int, str] | None = None  # (step, stand-in folder) that resume_point prepared
        self.resumed_from: int | None = None  # the step of the checkpoint resume_point picked
        self._rng_at: str | None = None  # where the restored generators go back: "epoch" or "step" begin
        self._stand_in_cleanup: weakref.finalize[Any, Any] | None = None

    # -- public ---------------------------------------------------------------------------------------

    @property
    def manager(self) -> CheckpointManager:
        """The :class:`~trainstate.CheckpointManager` that writes and keeps the checkpoints (``list()``,
        ``best()``, ``history()``, ``pin()``); a read-only one until training (or :meth:`resume_point`) opens it.

        Example:
            >>> trainer.train(resume_from_checkpoint=cb.resume_point(trainer))
            >>> [info.step for info in cb.manager.list()]
            [40, 50]
        """
        return self._manager

    @property
    def preempted(self) -> bool:
        """True once a preemption signal arrived, its checkpoint was saved and training was stopped: exit.

        Example:
            >>> trainer.train(resume_from_checkpoint=cb.resume_point(trainer))
            >>> if cb.preempted:
            ...     sys.exit(0)     # the scheduler restarts the job, which resumes from that checkpoint
        """
        return self._manager.preempted

    def resume_point(self, trainer: Any) -> str | None:
        """Get ``trainer`` ready to resume from the newest good checkpoint; pass the result to ``train()``.

        Returns None when the directory has no checkpoint (a fresh run: ``train(resume_from_checkpoint=None)``
        starts from scratch), else the path of a stand-in folder for ``resume_from_checkpoint``: the Trainer
        sets its loop from it, and this callback restores the state when training begins. The newest checkpoint
        is verified (every checksum) first; a damaged one is skipped, with a warning, for the one before it, by the
        same rule as :meth:`CheckpointManager.restore_latest` (one deleted meanwhile by a running job's retention is
        not damage: the directory is listed again).
        Call it in every run of the script, fresh or resumed: it also lets the callback save the states of the
        Trainer's ``ExportableState`` callbacks (``EarlyStoppingCallback``).

        Raises:
            InvalidArgumentError: this callback is not among ``trainer``'s callbacks (the Trainer would train
                from the stand-in's empty weights index without it), or another TrainstateCallback is.
            CorruptCheckpointError: there are checkpoints, but none verifies.
            EncryptionKeyError, FormatVersionError: not damage, raised at once (as restore_latest does).

        Example:
            >>> trainer.train(resume_from_checkpoint=cb.resume_point(trainer))
        """
        callbacks = list(getattr(getattr(trainer, "callback_handler", None), "callbacks", None) or [])
        if not any(cb is self for cb in callbacks):
            raise InvalidArgumentError(
                "resume_point(trainer) takes the Trainer this callback was added to (Trainer(..., callbacks=[cb]) "
                "or trainer.add_callback(cb)); without the callback the Trainer would resume from the stand-in's "
                "empty weights"
            )
        others = [cb for cb in callbacks if isinstance(cb, TrainstateCallback) and cb is not self]
        if others:
            raise InvalidArgumentError(
                f"the Trainer has {len(others) + 1} TrainstateCallbacks: keep one (the first would take every save "
                "over and the others would never save)"
            )
        self._trainer = weakref.ref(trainer)
        self._discard_stand_in()
        self._resume = self.resumed_from = None
        manager = self._open()
        try:
            return self._pick(manager, trainer)
        except BaseException:  # nothing to train from: let go of the directory (a notebook cell is run again)
            self._closed = True
            manager.close()
            raise

    def _pick(self, manager: CheckpointManager, trainer: Any) -> str | None:
        """The stand-in folder of the newest checkpoint that verifies (resume_point)."""
        key, key_env = self._options.get("key"), self._options.get("key_env")

        def trainer_state(name: str) -> Any:
            path = manager.catalog.path(name)
            with open_checkpoint(path, manager.storage, key=key, key_env=key_env) as ck:
                ck.verify()
                try:
                    return ck.load(include=["trainer_state.*"])["trainer_state"]
                except InvalidArgumentError:  # the pattern matched nothing
                    raise InvalidArgumentError(
                        f"{path} holds no trainer_state: it was not written by TrainstateCallback; give the "
                        "callback a run directory of its own"
                    ) from None

        # the same choice, and the same fatal errors, as the restore_latest that train() runs (newest.py); under a
        # process group rank 0 verifies and chooses (once, not once per rank) and every rank resumes from its choice
        ranks = manager._ranks
        found, failed = None, None
        if ranks.leader:
            try:
                found = newest_restorable(manager.list, manager.catalog, trainer_state, doing="resumed from")
            except Exception as e:  # noqa: BLE001 - raised on every rank by agree()
                failed = e
        ranks.agree(failed, "TrainstateCallback.resume_point()")
        found = ranks.from_leader(found, "TrainstateCallback.resume_point()")
        if found is not None:
            weights = list(trainer.model.state_dict().keys())
            folder = stand_in.write(plain(found.value), weights, manager.catalog.path(found.name))
            self._resume, self.resumed_from = (found.step, folder), found.step
            self._stand_in_cleanup = weakref.finalize(self, stand_in.remove, folder)
            return folder
        theirs = _trainer_checkpoints(getattr(getattr(trainer, "args", None), "output_dir", None))
        if theirs:
            log.warning(
                "TrainstateCallback: %s holds the Trainer's own checkpoints (%s), which TrainstateCallback does not "
                "read: this run starts from step 0",
                trainer.args.output_dir,
                ", ".join(theirs[-3:]),
            )
        return None

    # -- the Trainer's events -----------------------------------------------------------------------

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        """The Trainer's event hook (training starts: what resume_point chose is restored, the manager opened, the
        loader seeded). The Trainer calls it; nothing to call yourself.

        Example:
            >>> trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[cb])   # called from train()
        """
        self._seen(state, control)
        if self._live is not None:
            if self._began is state:  # the callback was added twice: this train() is set up already
                return
            self._end()  # an earlier train() stopped by an exception never reached on_train_end
        self._began = state  # each train() makes a new TrainerState
        try:
            self._begin(args, state, kw)
        except BaseException:
            self._end()
            raise

    def _begin(self, args: Any, state: Any, kw: dict[str, Any]) -> None:
        self._check(args)
        self._check_ranks(args, self._open())
        self._pending = self._saved = None
        self._args, self._loader = args, kw.get("train_dataloader")
        optimizer = kw.get("optimizer")
        self._live = {
            "model": kw["model"],
            "optimizer": getattr(optimizer, "optimizer", optimizer),  # accelerate's AcceleratedOptimizer wraps it
            "lr_scheduler": kw.get("lr_scheduler"),
            "trainer_state": self._trainer_state,
            "rng": self._rng,
            "data": self._position,
        }
        scaler = getattr(optimizer, "scaler", None)
        if scaler is not None:
            self._live["scaler"] = scaler
        self._epoch = data.Epoch(int(args.data_seed if args.data_seed is not None else args.seed))
        self._rng.seed, self._rng.rederived = int(args.seed), None
        if self.seed_per_sample and self._loader is not None:
            self._seeding = data.install(self._loader, self._epoch)
        if self._resume is not None:
            self._restore(args, state)
        elif state.global_step == 0 and self._trainer is None:
            ranks = self._manager._ranks
            newest = ranks.from_leader(self._manager.latest() if ranks.leader else None, "TrainstateCallback")
            if newest is not None:  # resume_point never looked: most likely forgotten
                raise InvalidArgumentError(
                    f"{self._manager.directory} already holds checkpoints (the newest: step {newest.step}) and this "
                    "run starts from step 0, so its checkpoints would become the newest and retention would delete "
                    "those: resume with trainer.train(resume_from_checkpoint=cb.resume_point(trainer)), or give "
                    "the new run a directory of its own"
                )

    def on_epoch_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        """The Trainer's event hook (an epoch starts: a save taken over at the last step is written now). The
        Trainer calls it; nothing to call yourself.

        Example:
            >>> trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[cb])   # called from train()
        """
        self._seen(state, control)
        self._flush()
        if self._live is None:
            return
        per_epoch = data.updates_per_epoch(data.length(self._loader), args.gradient_accumulation_steps, state.max_steps)
        self._epoch.epoch = state.global_step // per_epoch
        if self._rng_at == "epoch":
            self._rng_at = None
            self._rng.apply()

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        """The Trainer's event hook (a step starts: a save taken over at the last step is written now; after a
        resume, the loop's random generators are put back here). The Trainer calls it; nothing to call yourself.

        Example:
            >>> trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[cb])   # called from train()
        """
        self._seen(state, control)
        self._flush()
        if self._rng_at == "step":  # the resumed epoch's first batches are fetched: the loop's draws come next
            self._rng_at = None
            self._rng.apply()

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> Any:
        """The Trainer's event hook (a step ends: a save the Trainer is about to make is taken over (written once
        logging is done)). The Trainer calls it; nothing to call yourself.

        Example:
            >>> trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[cb])   # called from train()
        """
        self._seen(state, control)
        if self._live is None:
            return control
        if self._preempting():
            # saved once this step's logs and evaluation are in the Trainer's state, as a save it decided is:
            # the resumed run starts after this step and would never log it again
            self._pending = state.global_step
            control.should_training_stop = True
            control.should_save = False
            log.warning("TrainstateCallback: preempted; saving step %d and stopping training", state.global_step)
            return control
        return self._take_over(state, control)

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> Any:
        """The Trainer's event hook (an epoch ends: a save the Trainer is about to make is taken over). The Trainer
        calls it; nothing to call yourself.

        Example:
            >>> trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[cb])   # called from train()
        """
        self._seen(state, control)
        return self._take_over(state, control)

    def on_log(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, logs: Any = None, **kw: Any
    ) -> None:
        """The Trainer's event hook (the Trainer logs: a taken-over save is written after the step's logs, with its
        metrics). The Trainer calls it; nothing to call yourself.

        Example:
            >>> trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[cb])   # called from train()
        """
        self._seen(state, control)
        if isinstance(logs, dict) and "train_runtime" in logs:
            # the summary Trainer.train logs once training is over: the last checkpoint is of the state before it,
            # as the Trainer's own last checkpoint is (its metrics are of the whole call, not of the step)
            self._trainer_state.leave_out_last_log = True
            try:
                self._flush()
            finally:
                self._trainer_state.leave_out_last_log = False
            return
        self._note(state, logs)

    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, metrics: Any = None, **kw: Any
    ) -> None:
        """The Trainer's event hook (the Trainer evaluated: the metrics go with the step's checkpoint
        (``keep_best``)). The Trainer calls it; nothing to call yourself.

        Example:
            >>> trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[cb])   # called from train()
        """
        self._seen(state, control)
        self._note(state, metrics)

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        """The Trainer's event hook (the Trainer saved a checkpoint of its own (``save_strategy="best"``):
        trainstate saves beside it). The Trainer calls it; nothing to call yourself.

        Example:
            >>> trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[cb])   # called from train()
        """
        # The Trainer saved a checkpoint of its own: a save decided after the callback's last chance to take it
        # over (save_strategy="best", or another callback raising should_save). Save beside it.
        self._seen(state, control)
        if self._live is not None and self._saved != state.global_step:
            self._pending = state.global_step
            self._flush()

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        """The Trainer's event hook (training ends: a save taken over at the last step is written, the best model
        loaded (load_best_model_at_end), the loader's seeding and the directory lock let go). The Trainer calls
        it; nothing to call yourself.

        Example:
            >>> trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[cb])   # called from train()
        """
        self._seen(state, control)
        if self._live is None:
            return
        try:
            self._flush()
            if args.load_best_model_at_end:
                self._load_best(args, state)
        finally:
            self._end()

    def _end(self) -> None:
        """Let go of what training held: the seeding hooks, the stand-in, the manager (after its saves commit)."""
        data.uninstall(self._seeding)
        self._seeding, self._live, self._rng_at, self._began = None, None, None, None
        self._discard_stand_in()
        if not self._closed:
            self._closed = True
            self._manager.close()

    # -- saving -------------------------------------------------------------------------------------

    def _seen(self, state: Any, control: Any) -> None:
        owner = getattr(control, "_trainstate_callback", None)
        if owner is None or owner() is None:
            control._trainstate_callback = weakref.ref(self)  # the Trainer's one TrainerControl, shared by all
        elif owner() is not self:
            other = owner()
            if other is not None and other._live is not None:
                other._end()  # it began this train(), which stops here: let go of its directory
            raise InvalidArgumentError(
                "the Trainer has two TrainstateCallbacks: keep one (the first takes every save over, so the other "
                "would never save)"
            )
        self._state, self._control = state, control

    def _preempting(self) -> bool:
        """Whether a preemption signal is pending: on any rank, under a process group, so that every rank stops
        after this step and saves it (one all-reduce of a flag per step; the Trainer's DDP step makes several)."""
        pending = self._manager._preemption_pending()
        ranks = self._manager._ranks
        if isinstance(ranks, ManagerRanks):
            return bool(ranks.control.max([int(pending)], "TrainstateCallback (preemption)")[0])
        return pending

    def _take_over(self, state: Any, control: Any) -> Any:
        """The Trainer is about to save: write the checkpoint instead, after this step's logging and evaluation."""
        if self._live is not None and control.should_save:
            control.should_save = False
            if self._saved != state.global_step:
                self._pending = state.global_step
        return control

    def _note(self, state: Any, values: Any) -> None:
        if state.global_step != self._metrics_step:
            self._metrics_step, self._metrics = state.global_step, {}
        if isinstance(values, dict):
            self._metrics.update(numbers(values))

    def _flush(self) -> None:
        step, self._pending = self._pending, None
        if step is None or self._live is None or step == self._saved:
            return
        metrics = self._metrics if self._metrics_step == step else {}
        epoch = int(self._position.state_dict()["epoch"])
        args = self._args
        strategy = str(getattr(args.save_strategy, "value", args.save_strategy))
        self._policy.due = step
        self._best.step = getattr(self._state, "best_global_step", None)  # this step's evaluation included
        self._policy.reason = f"Trainer save_strategy={strategy!r}" + (
            f", save_steps={args.save_steps}" if strategy == "steps" else ""
        )
        self._trainer_state.shared = self._agreed_trainer_state()
        try:
            self._manager.save(step, self._live, metrics=metrics, epoch=epoch)
        finally:
            self._policy.due = None
            self._trainer_state.shared = None
        self._saved = step

    def _agreed_trainer_state(self) -> dict[str, Any] | None:
        """Under a process group: the ``TrainerState`` every rank saves, rank 0's (each rank logs its own run
        times), with the flos every rank counted since the Trainer last summed them (as ``Trainer.store_flos``
        does). None in one process, where the state is read as the save encodes it."""
        ranks = self._manager._ranks
        if not isinstance(ranks, ManagerRanks):
            return None
        flos = self._flos()
        mine = self._trainer_state.snapshot(0.0) if ranks.leader else None
        got = ranks.control.all_gather((mine, flos), "TrainstateCallback (the TrainerState)")
        agreed: dict[str, Any] = got[0][0]
        agreed["total_flos"] = agreed["total_flos"] + sum(f for _, f in got)
        return agreed

    def _flos(self) -> float:
        """The Trainer's floating-point operations not yet in ``total_flos`` (``Trainer.store_flos`` adds them)."""
        trainer = self._trainer() if self._trainer is not None else None
        return float(getattr(trainer, "current_flos", 0.0) or 0.0)

    def _exported(self) -> list[Any]:
        """The Trainer's ExportableState callbacks and its TrainerControl, as Trainer._save_checkpoint saves them."""
        trainer = self._trainer() if self._trainer is not None else None
        callbacks = list(trainer.callback_handler.callbacks) if trainer is not None else []
        found = [cb for cb in callbacks if isinstance(cb, ExportableState)]
        return found + ([self._control] if isinstance(self._control, ExportableState) else [])

    # -- resuming -----------------------------------------------------------------------------------

    def _restore(self, args: Any, state: Any) -> None:
        assert self._resume is not None and self._live is not None
        step, folder = self._resume
        self._resume = None
        if state.global_step != step:
            raise InvalidArgumentError(
                f"resume_point() prepared step {step}, but the Trainer resumed at step {state.global_step}: pass "
                "what resume_point returned to trainer.train(resume_from_checkpoint=...)"
            )
        self._reshape_model(step)
        resumed = self._manager.restore_latest(self._live)
        if resumed != step + 1:
            raise CheckpointError(
                f"resume_point() prepared step {step}, but the newest checkpoint that restores now is "
                f"{None if resumed is None else resumed - 1}: something changed {self._manager.directory} meanwhile; "
                "run again"
            )
        saved = self._position.saved or {}
        now = data.position(args, state, self._loader, self._seeding is not None)
        wrong = data.elastic_differences(saved, now, self._loader)
        if wrong:
            raise StateMismatchError(
                [],
                [],
                wrong,
                hint="the Trainer would resume at another place in the data than the run that saved it: resume with "
                "the same dataset, global batch size (per_device_train_batch_size x gradient_accumulation_steps x "
                "processes: double per_device_train_batch_size or gradient_accumulation_steps when halving the "
                "processes), seed / data_seed and seed_per_sample, or start a new run in another directory",
            )
        if saved.get("world_size") != now["world_size"]:
            self._resumed_elastic(saved, now, step)
        if args.ignore_data_skip:
            log.warning("TrainstateCallback: ignore_data_skip=True, so the resumed run does not continue the data")
        self._saved = step
        # where the loop was when the checkpoint was taken: right before the next step's training (its batches
        # fetched), or, at an epoch boundary, before the next epoch's iterator drew its seed
        self._rng_at = "step" if saved.get("batches_into_epoch", 0) else "epoch"
        self._discard_stand_in(folder)

    def _resumed_elastic(self, saved: dict[str, Any], now: dict[str, Any], step: int) -> None:
        """Say what a resume at another number of processes changes (the data position itself is exact)."""
        log.info(
            "TrainstateCallback: resumed step %d, saved by %d process(es), on %d: the same global batch of %d "
            "samples; this process's generators were %s",
            step,
            saved["world_size"],
            now["world_size"],
            data.global_batch(now),
            f"re-derived from (seed {self._rng.seed}, step, rank)" if self._rng.rederived else "restored",
        )
        if data.uneven_tail(saved, now):
            log.warning(
                "TrainstateCallback: the dataset (%d samples) is not a multiple of per-device batch x processes "
                "(%d x %d saved, %d x %d now): the last update of each epoch takes other samples than at %d "
                "processes (accelerate's even_batches pads it with the epoch's first samples)",
                now["samples"],
                saved["train_batch_size"],
                saved["world_size"],
                now["train_batch_size"],
                now["world_size"],
                saved["world_size"],
            )

    def _reshape_model(self, step: int) -> None:
        """Hand the saved tensors whose shape differs from the model's to the model's own ``load_state_dict``
        (``strict=False``), as the Trainer's resume does: a model whose ``_load_from_state_dict`` resizes a buffer
        (one that grows as it trains) takes the saved shape, and the restore after it fills every tensor in
        place. A model that does not resize raises nothing here; the restore then names the mismatch."""
        assert self._live is not None
        model = unwrapped(self._live["model"])
        if not load_takes_strict(model):
            return
        own = model.state_dict()
        with open_checkpoint(
            self._manager.path_for(step),
            self._manager.storage,
            key=self._options.get("key"),
            key_env=self._options.get("key_env"),
        ) as ck:
            differing = [
                name
                for name, value in own.items()
                if f"model.{name}" in ck and tuple(ck.info(f"model.{name}").shape) != tuple(getattr(value, "shape", ()))
            ]
            if not differing:
                return
            saved = {name: ck.read(f"model.{name}", framework="torch") for name in differing}
        try:
            model.load_state_dict(saved, strict=False)
        except RuntimeError as e:  # it does not take the saved shape: the restore reports the mismatch
            log.debug("TrainstateCallback: %s.load_state_dict kept its shapes: %s", type(model).__name__, e)

    def _discard_stand_in(self, folder: str | None = None) -> None:
        if self._stand_in_cleanup is not None:
            self._stand_in_cleanup()
            self._stand_in_cleanup = None
        stand_in.remove(folder)

    # -- helpers ------------------------------------------------------------------------------------

    def _new_manager(self, read_only: bool = False) -> CheckpointManager:
        options = dict(self._options)
        options["retention_policies"] = [*(options.get("retention_policies") or []), self._best]
        return CheckpointManager(
            self._directory, save_policies=[self._policy], capture_rng=False, read_only=read_only, **options
        )

    def _open(self) -> CheckpointManager:
        """The manager that saves: opened at the first resume_point or train(), and again after train() closed it."""
        if self._closed:
            self._manager, self._closed = self._new_manager(), False
        return self._manager

    def _check(self, args: Any) -> None:
        if str(getattr(args.save_strategy, "value", args.save_strategy)) == "no":
            raise InvalidArgumentError(
                "save_strategy='no': the Trainer has no save events, so TrainstateCallback would never save; set "
                "TrainingArguments(save_strategy='steps', save_steps=N) (or 'epoch')"
            )
        if getattr(args, "deepspeed", None) or getattr(args, "fsdp", None):
            raise InvalidArgumentError(
                "TrainstateCallback does not support DeepSpeed or FSDP yet: their model and optimizer are sharded "
                "across processes (DeepSpeed's ZeRO partitions, FSDP's flat parameters), which the callback would "
                "have to save through their own sharded state dicts, and that is neither built nor tested; train "
                "with DDP (several processes, torchrun) or in one process, or keep the Trainer's own checkpoints"
            )
        if args.load_best_model_at_end:
            metric = _eval_name(args.metric_for_best_model or "loss")
            mode = "max" if args.greater_is_better else "min"
            kept = [p for p in self._manager.retention if isinstance(p, KeepBest) and p.metric == metric]
            if not any(p.mode == mode for p in kept):
                found = (
                    f" (keep_best has {metric!r} {kept[0].mode!r}, so retention would delete the best one)"
                    if kept
                    else ""
                )
                raise InvalidArgumentError(
                    f"load_best_model_at_end=True loads the best checkpoint by {metric!r}, the "
                    f"{'highest' if mode == 'max' else 'lowest'} (greater_is_better={bool(args.greater_is_better)}), "
                    f"which retention must keep{found}: pass keep_best=({metric!r}, {mode!r}, 1) to TrainstateCallback"
                )

    def _check_ranks(self, args: Any, manager: CheckpointManager) -> None:
        """Under DDP every rank's manager saves its part of one checkpoint together (a collective save)."""
        world = int(args.world_size)
        if world > 1 and manager._ranks.world != world:
            why = (
                "collective=False would have each rank write the same checkpoints over the others'"
                if self._options.get("collective") is False
                else f"its manager sees {manager._ranks.world} (no torch.distributed process group)"
            )
            raise InvalidArgumentError(
                f"the Trainer runs in {world} processes, and TrainstateCallback saves collectively with all of them, "
                f"but {why}: launch with torchrun (the Trainer then starts the process group), and leave "
                "collective= unset"
            )

    def _load_best(self, args: Any, state: Any) -> None:
        """Load the model of the checkpoint the Trainer records as best (``best_global_step``: on a tie, the
        first), else the best by the metric; ``state.best_model_checkpoint`` then names it. Set here, after the
        Trainer's own end-of-training load (which reads only its ``checkpoint-N`` folders) and not while
        training, where that load would warn that it found no weights there."""
        assert self._live is not None
        metric = _eval_name(args.metric_for_best_model or "loss")
        kept = {c.step: c for c in self._manager.list()}
        best = kept.get(getattr(state, "best_global_step", None) or -1)
        if best is None:
            best = self._manager.best(metric, "max" if args.greater_is_better else "min")
        ranks = self._manager._ranks  # under a process group every rank restores rank 0's choice (collectively)
        best = ranks.from_leader(best, "TrainstateCallback (load_best_model_at_end)")
        if best is None:
            log.warning("TrainstateCallback: no checkpoint has the metric %r; keeping the last model", metric)
            return
        self._reshape_model(best.step)
        self._manager.restore(best.step, {"model": self._live["model"]}, include="model.*")
        state.best_model_checkpoint = self._manager.path_for(best.step)
        log.info("TrainstateCallback: loaded the best model, step %d (%s=%s)", best.step, metric, best.metrics[metric])


def _trainer_checkpoints(output_dir: Any) -> list[str]:
    """The Trainer's own ``checkpoint-N`` folders in ``output_dir``, oldest first."""
    if not isinstance(output_dir, (str, os.PathLike)) or not os.path.isdir(output_dir):
        return []
    found = [n for n in os.listdir(output_dir) if n.startswith("checkpoint-") and n[len("checkpoint-") :].isdigit()]
    return sorted(found, key=lambda n: int(n[len("checkpoint-") :]))


def _eval_name(metric: str) -> str:
    return metric if metric.startswith("eval_") else f"eval_{metric}"
