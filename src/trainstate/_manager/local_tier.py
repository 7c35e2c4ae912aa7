"""The local tier: frequent checkpoints on a node-local path (tmpfs, a local NVMe) behind the durable ones.

A manager with ``local=LocalTier(path, every_steps=K)`` writes, besides its durable checkpoints, one every K
steps to ``path``: the same format, checksums and atomic commit, always in the background, never compressed
(it is there to be fast), encrypted with the run's key when it has one. The recovery point becomes the newest
local step: ``restore_latest`` takes the newest checkpoint of either tier that restores, past damaged ones.

Each process keeps its checkpoints in ``path/w{world size}/rank{rank:05d}`` (one process: ``path/w1/rank00000``),
a run directory like any other: ``trainstate ls`` and ``load`` read it. Under a process group each checkpoint is
the process's own view (a DTensor's local shard stored whole), restored by the same rank at the same world size;
its copies on the peers' nodes sit in the same layout there (tier_peers.py). Another world size finds none of them
and resumes from the durable tier. ``path/_tier.json`` names the durable directory the tier belongs to, so
two runs never share one path unknowingly.

The two tiers never wait for each other: each writes on its own background thread. A local save waits for the
previous local one to commit (so a kill loses at most ``every_steps`` steps), and is skipped at a step the
durable tier saves. A local save is not flushed to stable storage by default: it survives the process (SIGKILL,
an out-of-memory kill), not the machine.
"""

from __future__ import annotations

import builtins
import json
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from trainstate import _arguments as arguments
from trainstate._keys import Key
from trainstate._manager.newest import FATAL
from trainstate._manager.policies import saved_order
from trainstate._storage.local import make_directories
from trainstate.errors import CheckpointError, InvalidArgumentError, StateMismatchError, StorageError

if TYPE_CHECKING:
    from trainstate._history.log import SaveRecord
    from trainstate._manager.async_writer import AsyncWriter
    from trainstate._manager.policies import CheckpointInfo
    from trainstate._manager.ranks import ManagerRanks
    from trainstate._manager.tier_peers import Peers

log = logging.getLogger("trainstate")

MARKER = "_tier.json"


@dataclass(frozen=True)
class LocalTier:
    """A fast local tier of checkpoints behind a manager's durable ones (docs/tiers.md).

    Args:
        path: a node-local directory for this run's local checkpoints (``/dev/shm/run1`` on tmpfs, or a
            local NVMe), one per run.
        every_steps: write a local checkpoint every this many steps (1: every step).
        replicas: under a process group, copies of each node's local checkpoints kept on this many other
            nodes (0: none; in one process, or on one node, there is nowhere to copy to).
        keep: local checkpoints kept (per process).
        budget_bytes: the most the tier may hold (``keep`` checkpoints, the one being written, and the peers'
            copies kept here); a state that does not fit raises StorageError at the first local save, or at a
            later one whose checkpoint came out larger. Default: the filesystem's free space.
        fsync: flush each local checkpoint to stable storage (a local NVMe that should survive a reboot).
        copy_behind: copy what the optimizers change only in their step (parameters, optimizer state) while
            training goes on, the next ``optimizer.step()`` waiting for it, instead of before ``save()``
            returns (docs/tiers.md, "Copying behind training"). Parameters must then change only in the
            optimizer's step between saves.

    Example:
        >>> mgr = trainstate.CheckpointManager("s3://bucket/run1", every_steps=500,
        ...                                    local=trainstate.LocalTier("/dev/shm/run1", every_steps=10))
    """

    path: str | os.PathLike[str]
    every_steps: int = 1
    replicas: int = 1
    keep: int = 2
    budget_bytes: int | None = None
    fsync: bool = False
    copy_behind: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.path, (str, os.PathLike)) or "://" in os.fspath(self.path):
            raise InvalidArgumentError(
                f"LocalTier(path=...) takes a local directory (tmpfs or a local disk), got {self.path!r:.80}"
            )
        arguments.positive_int(self.every_steps, "LocalTier every_steps")
        arguments.positive_int(self.keep, "LocalTier keep")
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or self.replicas < 0:
            raise InvalidArgumentError(f"LocalTier replicas must be a non-negative int, got {self.replicas!r}")
        if self.budget_bytes is not None:
            arguments.positive_int(self.budget_bytes, "LocalTier budget_bytes")
        arguments.flag(self.fsync, "LocalTier fsync")
        arguments.flag(self.copy_behind, "LocalTier copy_behind")


def claim(tier: LocalTier, durable: str, read_only: bool = False) -> Path:
    """The tier's directory, made and marked as ``durable``'s; refuses a path another run's tier holds.
    ``read_only``: nothing is made or written (a marker is only checked)."""
    root = Path(os.path.realpath(os.fspath(tier.path)))
    if "://" not in durable:
        mine = Path(os.path.realpath(durable))
        if root == mine or mine in root.parents or root in mine.parents:
            raise InvalidArgumentError(
                f"LocalTier path {root} and the checkpoint directory {mine} are inside one another: give the "
                "local tier a directory of its own (tmpfs or a local disk)"
            )
        durable = str(mine)
    if root.exists() and not root.is_dir():
        raise InvalidArgumentError(f"LocalTier path {root} is a file: give the local tier a directory")
    if not read_only:
        make_directories(root)
    marker = root / MARKER
    try:
        raw = marker.read_bytes()
        owner = json.loads(raw)["durable"] if raw.strip() else None  # empty: a crash before trainstate fsynced it
    except FileNotFoundError:
        owner = None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InvalidArgumentError(
            f"{marker} is not a local tier's marker ({e}): give the local tier an empty path"
        ) from None
    if owner is None and not read_only:  # several ranks of a node may write it at once: each whole, by a rename
        staged = marker.with_name(f".{MARKER}.{os.getpid()}")
        fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, (json.dumps({"durable": durable}) + "\n").encode())
            os.fsync(fd)  # whole or absent after a crash: never an empty marker that refuses the restart
        finally:
            os.close(fd)
        os.replace(staged, marker)
        _fsync_dir(root)
    elif owner is not None and owner != durable:
        raise InvalidArgumentError(
            f"LocalTier path {root} holds the local checkpoints of the run in {owner!r:.200}, not {durable!r:.200}: "
            "give each run its own local path (or delete that one)"
        )
    return root


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class LocalEvery:
    """The local tier's save policy: every ``steps`` steps, said so in each save's reason (the history)."""

    steps: int

    def reason_to_save(self, step: int, now: float, last_save_time: float) -> str | None:
        return f"local tier: every {self.steps} steps" if step % self.steps == 0 else None


class Inner(Protocol):
    """What the tier asks of its own manager (a CheckpointManager of this process's folder)."""

    @property
    def directory(self) -> str: ...

    def save(
        self, step: int, state: Any, *, metrics: dict[str, float] | None = None, metadata: dict[str, Any] | None = None
    ) -> bool: ...

    def restore(self, step: int, state: Any, **load_kwargs: Any) -> Any: ...

    def list(self) -> builtins.list[CheckpointInfo]: ...

    def wait(self) -> None: ...

    def close(self) -> None: ...

    def history(self) -> builtins.list[SaveRecord]: ...


class Tier:
    """A manager's local tier at work: when to write a local checkpoint, and the checkpoints to resume from.

    ``inner`` is a manager of this process's folder of the tier (asynchronous, uncompressed, one process, saving
    its own view: ``local_view``). Under a process group, ``peers`` copies each local checkpoint to the next
    nodes and finds, on restore, the newest step every rank can restore (tier_peers.py)."""

    def __init__(
        self,
        config: LocalTier,
        inner: Inner,
        writer: AsyncWriter,
        nbytes: Callable[[Any], int],
        view: tuple[int, int],
        peers: Peers | None = None,
        key: Key | None = None,
        durable: str = "",
    ) -> None:
        self.config = config
        self.inner = inner
        self.writer = writer  # the inner manager's: its background saves (a copy to the peers waits for one)
        self.nbytes = nbytes  # the bytes a local checkpoint of a state takes (nothing copied)
        self.view = view  # (rank, world size): each local checkpoint is this process's own view
        self.peers = peers
        self.key = key  # the run's key: the local checkpoints' manifests are authenticated with it
        self.durable = durable  # the durable directory, for messages
        self._checked = False  # the first save checked that the state fits
        self._fits = 0  # the checkpoint size the last check allowed for

    def maybe_save(
        self, step: int, state: Any, durable_saved: bool, metrics: dict[str, float], durable_seq: int
    ) -> bool:
        """Write ``step`` locally if due, unless the durable tier just saved it; whether a local save started.

        The previous local save is committed first (waited for, when still being written), and under a process
        group its copies to the peers made: so a kill loses at most the steps since the newest local save,
        ``every_steps``, never an unbounded number. A local disk (or a network to the peers) slower than
        ``every_steps`` training steps makes the loop wait: the history's blocking time shows it."""
        if durable_saved or step % self.config.every_steps:  # the inner manager's own policy says the same
            return False
        if self.peers is not None:
            self.peers.wait()  # raises the previous copies' error
            # a rank whose previous local save failed raises it; the others must not wait for its copies
            self.peers.agree_on(self.writer.take_error(), "LocalTier (the previous local save)")
        grown = self.writer.history[-1].nbytes if self.writer.history else 0
        if not self._checked:
            error: StorageError | None = None
            try:
                self._check_fits(state, grown)
            except StorageError as e:
                error = e
            if self.peers is not None:  # every rank raises if one's node has no room, none waits for it
                self.peers.control.agree(error, "LocalTier (room for the state)")
            elif error is not None:
                raise error
        elif grown > self._fits:  # a checkpoint came out larger than checked (optimizer moments appeared)
            try:
                self._check_fits(state, grown)
            except StorageError as e:
                if self.peers is None:
                    raise
                # a rank raising alone would leave its peers waiting for its copies: said, and the run goes on
                log.warning("local tier: %s", e)
                self._fits = grown
        # which durable checkpoint it comes after: what orders it against the durable tier's (restore_newest)
        saved = self.inner.save(step, state, metrics=metrics, metadata={LOCAL_KEY: {"durable_seq": durable_seq}})
        if saved and self.peers is not None:
            self.peers.replicate(step, _save_job(self.writer, step))
        return saved

    def _check_fits(self, state: Any, written: int = 0) -> None:
        nbytes = max(self.nbytes(state), written)  # a checkpoint written may be larger (optimizer moments)
        copies = self.config.keep + 1 + (len(self.peers.sources) * self.config.keep if self.peers else 0)
        need = nbytes * copies  # those kept, the next one being written, and the peers' copies held here
        held = f"{self.config.keep} checkpoints kept and one being written" + (
            f", and {self.config.keep} of each of {len(self.peers.sources)} peers" if self.peers else ""
        )
        budget = self.config.budget_bytes
        sharing = self.peers.on_my_node if self.peers is not None else 1  # ranks whose tiers share this disk
        free = (shutil.disk_usage(self.inner.directory).free + self.used() * sharing) // sharing
        if budget is not None and need > budget:
            raise StorageError(
                f"the local tier needs {need:,} bytes ({held}, {nbytes:,} bytes each), over its budget_bytes of "
                f"{budget:,}: raise the budget or lower keep"
            )
        if need > free:
            raise StorageError(
                f"the local tier needs {need:,} bytes ({held}, {nbytes:,} bytes each), but {self.inner.directory} "
                f"has {free:,} bytes free: give it more room (a larger tmpfs) or lower keep"
            )
        self._checked, self._fits = True, nbytes

    def used(self) -> int:
        """Bytes this process's folder of the tier holds."""
        total = 0
        for dirpath, _, files in os.walk(self.inner.directory):
            for f in files:
                try:
                    total += os.path.getsize(os.path.join(dirpath, f))
                except OSError:
                    pass
        return total

    def after(self, base: int | None, below: int | None = None) -> list[CheckpointInfo]:
        """The tier's committed checkpoints that come after the durable checkpoint of commit number ``base``
        (written once it was the durable tier's newest; ``base=None``: the durable tier has none) and before
        ``below``'s, newest first (in the order the tier committed them)."""
        found = []
        for info in self.inner.list():
            seq = durable_seq_of(Path(self.inner.directory) / info.name, self.key)
            if seq is not None and follows(seq, base) and (below is None or seq < below):
                found.append(info)
        return sorted(found, key=saved_order, reverse=True)

    def restore_newest(
        self, state: Any, base: int | None, load_kwargs: dict[str, Any], below: int | None = None
    ) -> int | None:
        """Restore the newest local checkpoint written after the durable tier's newest (commit number
        ``base``; and before ``below``'s, when given) that restores; its step, or None (then the durable tier
        resumes). A local checkpoint written before the durable tier's newest belongs to a timeline that was
        left (a rollback, a run on another number of ranks that saved durably since): never restored. A damaged
        one is skipped with a warning; a state that does not fit, or a wrong key, raises as from the durable
        tier. Under a process group every rank calls it and all restore the same step."""
        if self.peers is not None:
            usable = partial(_usable, key=self.key, base=base, below=below)
            return self.peers.restore_newest(lambda step: self._restore(step, state, load_kwargs), usable)
        if base is None and below is None:
            stale = [c.step for c in self.inner.list() if (durable_seq_of(Path(c.path), self.key) or 0) > 0]
            if stale:
                log.warning(
                    "local tier: %s holds checkpoints (steps %s) written beside durable checkpoints that %s no "
                    "longer holds: left alone, and not restored (delete them to free the space)",
                    self.inner.directory,
                    stale,
                    self.durable,
                )
        for info in self.after(base, below):
            try:
                self._restore(info.step, state, load_kwargs)
            except StateMismatchError as e:  # the job is laid out otherwise now: the durable tier reshards
                log.warning("local tier: step %d does not fit this job (%s); the durable tier resumes", info.step, e)
                return None
            except FATAL:
                raise
            except CheckpointError as e:
                why = str(e).splitlines()[0]
                log.warning("local tier: step %d does not restore (%s); trying the one before it", info.step, why)
                continue
            log.info("resumed from the local tier: step %d in %s", info.step, self.inner.directory)
            return info.step
        return None

    def _restore(self, step: int, state: Any, load_kwargs: dict[str, Any]) -> None:
        self.inner.restore(step, state, local_view=self.view, **load_kwargs)

    def wait(self) -> None:
        """Block until the local save in flight committed and its copies to the peers are made."""
        self.inner.wait()
        if self.peers is not None:
            self.peers.wait()

    def close(self) -> None:
        """Wait for the local save in flight (and its copies to the peers) and let go of the tier's folder."""
        try:
            self.inner.wait()
            if self.peers is not None:
                self.peers.close()
        finally:
            self.inner.close()


def _save_job(writer: AsyncWriter, step: int) -> Any:
    """The future of ``writer``'s background save of ``step`` (just submitted)."""
    for job in reversed(writer.queue.jobs):
        if getattr(job.info, "step", None) == step:
            return job.future
    return None  # written synchronously (over the staging budget): committed already


def tier_peers(ranks: ManagerRanks, config: LocalTier, world_root: Path) -> Peers:
    """The peers of a local tier under a torch.distributed process group (two gloo channels of its own)."""
    from trainstate._distributed import coordinator
    from trainstate._manager.tier_peers import Nodes, Peers

    if not ranks.control.sends_bytes:
        raise InvalidArgumentError(
            "LocalTier under jax.distributed is not built: its coordination moves no checkpoint bytes between "
            "processes; use it under torch.distributed, or in one process"
        )
    channel, timeout = ranks.channel, ranks.control.timeout
    control = coordinator(timeout=timeout, channel=f"{channel}-tier")
    copies = coordinator(timeout=timeout, channel=f"{channel}-tier-copies")
    assert control is not None and copies is not None  # the manager's group has several ranks
    nodes = Nodes(control)
    return Peers(world_root, nodes, control, copies, config.replicas, config.keep, config.fsync, config.every_steps)


LOCAL_KEY = "trainstate_local"  # a local checkpoint's metadata: {"durable_seq": the durable tier's commit number}


def follows(durable_seq: int, base: int | None) -> bool:
    """Whether a local checkpoint written when the durable tier's newest commit was ``durable_seq`` comes after
    the durable checkpoint of commit number ``base`` (None: the durable tier holds none, so only local
    checkpoints written before any durable one count)."""
    return durable_seq == 0 if base is None else durable_seq >= base


def durable_seq_of(checkpoint: Path, key: Key | None) -> int | None:
    """The durable commit number a local checkpoint was written after (its metadata), or None when its manifest
    does not read (damaged, deleted meanwhile, another key) or does not say."""
    from trainstate._restore.checkpoint import open_checkpoint
    from trainstate._storage import LocalStorage

    try:
        with open_checkpoint(str(checkpoint), LocalStorage(), key=key) as ck:
            meta = ck.metadata
    except CheckpointError:
        return None
    local = meta.get(LOCAL_KEY) if isinstance(meta, dict) else None
    seq = local.get("durable_seq") if isinstance(local, dict) else None
    return seq if type(seq) is int and seq >= 0 else None


def _usable(folder: Path, *, key: Key | None, base: int | None, below: int | None) -> dict[int, int]:
    """A rank folder's local checkpoints that may be restored (each comes after the durable tier's newest, and
    before ``below``): step -> the tier's own commit number, from one listing of the folder."""
    from trainstate._manager.catalog import Catalog
    from trainstate._storage import LocalStorage

    usable = {}
    for info in Catalog(LocalStorage(), str(folder), key).list():
        seq = durable_seq_of(folder / info.name, key)
        if seq is not None and follows(seq, base) and (below is None or seq < below):
            usable[info.step] = info.seq if info.seq is not None else 0
    return usable
