"""How a checkpoint is written, resolved and checked once: :class:`SaveOptions`, built by :func:`save_options`.

Every front door that writes (``save()``, ``CheckpointManager``, consolidate, average, import, pack, the
Lightning plugin) hands its write arguments to :func:`save_options`, which runs every check on them and the
rules for which features combine, and passes the frozen result to the writers (``write.py``, ``chunked.py``,
the incremental and collective savers, the background saver). A new write option is one field and one check
here.

Where a checkpoint goes (its path and :class:`~trainstate._storage.Storage`) is not an option: it is resolved
per checkpoint, together, by ``trainstate._storage.resolve``. Whether a save is collective is decided above
this layer (``trainstate._distributed``): the caller passes the process group's size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainstate import _arguments as arguments
from trainstate import _keys, _transforms
from trainstate._cores import DEFAULT_THREADS
from trainstate._storage import Storage


@dataclass(frozen=True)
class SaveOptions:
    """A save's write options, resolved and checked (build it with :func:`save_options`).

    Attributes:
        overwrite: replace a checkpoint at the path (atomically).
        fsync: flush files and directories to stable storage before the commit.
        threads: writer threads; tensors are spread over this many data files.
        workers: data files written at once (None: ``threads`` or the storage's ``write_parallelism``,
            whichever is more); a writer that makes each tensor's bytes as it goes sets it.
        pipeline: the chunk transforms asked for (compression); encryption is added from ``key``
            (:attr:`encoding`).
        key: encrypt the chunks and authenticate the manifest (its repr shows no bytes).
        collective: every rank of a process group writes its share of one checkpoint.
        incremental: unchanged tensors refer to the run's shared pool (a manager's saves).
        read_only: a manager that never writes (no save takes these options).

    Example:
        >>> options = save_options(threads=4, compression="zstd")
        >>> write_checkpoint("ckpt", snapshot, storage=LocalStorage(), options=options)
    """

    overwrite: bool = False
    fsync: bool = True
    threads: int = DEFAULT_THREADS
    workers: int | None = None
    pipeline: _transforms.Pipeline | None = None
    key: _keys.Key | None = None
    collective: bool = False
    incremental: bool = False
    read_only: bool = False

    @property
    def encoding(self) -> _transforms.Pipeline | None:
        """The chunk transforms every chunk goes through: :attr:`pipeline`, ending with encryption under
        :attr:`key` when there is one (an authenticated manifest never names plaintext chunks)."""
        return _transforms.encrypting(self.pipeline, self.key)

    def writers(self, storage: Storage) -> int:
        """Data files written at once on ``storage``."""
        return self.workers if self.workers is not None else max(self.threads, storage.capabilities.write_parallelism)


def save_options(
    *,
    overwrite: Any = False,
    fsync: Any = True,
    threads: Any = DEFAULT_THREADS,
    workers: Any = None,
    compression: Any = None,
    key: _keys.KeyLike | None = None,
    key_env: str | None = None,
    collective: Any = None,
    group_size: int = 1,
    incremental: Any = False,
    read_only: Any = False,
) -> SaveOptions:
    """The write arguments a user passed, checked and resolved, with the rules for which features combine.

    ``collective`` is the user's ``collective=`` (None: the default); the save is collective when it is not
    False, the process group has several ranks (``group_size``, from ``trainstate._distributed``) and the
    caller writes at all (not ``read_only``).

    Raises:
        InvalidArgumentError: a value of the wrong kind (``threads=0``, ``fsync="yes"``, a malformed key or
            compression spec).
        MissingDependencyError: compression needs zstandard.
    """
    flags = {
        name: arguments.flag(value, name)
        for name, value in (
            ("overwrite", overwrite),
            ("fsync", fsync),
            ("incremental", incremental),
            ("read_only", read_only),
        )
    }
    if collective is not None:
        arguments.flag(collective, "collective")
    threads = arguments.positive_int(threads, "threads")
    if workers is not None:
        workers = arguments.positive_int(workers, "workers")
    together = collective is not False and group_size > 1 and not flags["read_only"]
    # The feature-combination matrix. Every feature combines with every other, in one process and under a
    # process group (compression, encryption and incremental in a collective save: each rank transforms its
    # own chunks and shares its own unchanged boxes); a combination refused some day is refused here only.
    resolved = _keys.resolve(key, key_env)
    pipeline = _transforms.pipeline(_transforms.compression(compression))
    return SaveOptions(
        overwrite=flags["overwrite"],
        fsync=flags["fsync"],
        threads=threads,
        workers=workers,
        pipeline=pipeline,
        key=resolved,
        collective=together,
        incremental=flags["incremental"],
        read_only=flags["read_only"],
    )
