"""open(): a lazy, validated view of one checkpoint (the manifest step of manifest -> plan -> read).

Opening reads only the manifest, stats the data files and maps them; tensors are read when asked, each
one checked against its checksum by the read engine (``read.py``). Files are opened with ``O_NOFOLLOW``
and every name and byte range was validated by the manifest parser, so nothing outside the checkpoint is
ever touched. A mapped range is checked against the file's current size before it is touched (see
``files.DataFiles.mapped``), so a data file truncated while the checkpoint is open is a
CorruptCheckpointError, not a SIGBUS.
"""

from __future__ import annotations

import difflib
import errno
from collections.abc import Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from trainstate import _arguments as arguments
from trainstate import _checksum as checksum
from trainstate import _frameworks as frameworks
from trainstate import _keys
from trainstate import _tree as tree
from trainstate._cores import DEFAULT_THREADS
from trainstate._format import datafile, lazy_manifest, manifest, manifest_limits
from trainstate._frameworks import adapter_for
from trainstate._incremental import pool
from trainstate._restore import key_or_damage
from trainstate._restore import read as engine
from trainstate._restore.files import DataFiles
from trainstate._storage import Source, Storage, resolve_source
from trainstate._transforms import Decoders
from trainstate.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    InvalidArgumentError,
    StorageError,
    UnknownKeyError,
    WrongKeyError,
)

MAX_MANIFEST = manifest_limits.MAX_BYTES


@dataclass(frozen=True)
class TensorInfo:
    """What the manifest says about one tensor (``Checkpoint.info(name)``), read without touching its bytes.

    Attributes:
        name: the tensor's dotted name (``model.fc.weight``).
        dtype: its dtype as safetensors spells it (``F32``, ``BF16``, ``I64``, ...).
        shape: its (global) shape.
        nbytes: its size in bytes.
        kind: the array type it was saved from (``torch``, ``numpy``, ``jax``).
        chunks: the pieces it is stored in (1 unless saved by several ranks or compressed / encrypted).

    Example:
        >>> with trainstate.open("ckpt") as ck:
        ...     ck.info("model.w")
        TensorInfo(name='model.w', dtype='F32', shape=(2, 3), nbytes=24, kind='numpy', chunks=1)
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    kind: str
    chunks: int


class Checkpoint:
    """A committed checkpoint opened for reading. Use as a context manager.

    Made by :func:`trainstate.open`. Only the manifest is read when it opens; tensors are read when asked,
    each one checked against its checksum.

    Attributes:
        path: the checkpoint's path (or URL).
        storage: the storage backend it is read through.

    Example:
        >>> with trainstate.open("ckpt/step_1200") as ck:
        ...     w = ck.read("model.fc.weight")
    """

    def __init__(
        self,
        path: Source,
        storage: Storage | None = None,
        *,
        key: _keys.KeyLike | None = None,
        key_env: str | None = None,
    ) -> None:
        # The key is resolved before anything is opened; it is kept for reading encrypted chunks.
        self._key = _keys.resolve(key, key_env)
        self.storage, self.path = resolve_source(path, storage)
        self.files = DataFiles(self.storage, self.path)
        self.decoders = Decoders(self._key)  # undoes chunk transforms (decrypting with the resolved key)
        try:
            self.manifest = _read_manifest(self.storage, self.path, self._key, lazy=True)
            self.files.where = pool.locations(self.storage, self.path, self.manifest.files)
            self._check_files()
            for f in self.manifest.files:  # map now: a checkpoint deleted after this stays readable (POSIX)
                self.files.map(f.path)
        except StorageError as e:
            if e.errno == errno.ENOENT:  # retention (or a user) deleted it under our feet
                raise CheckpointNotFoundError(f"{self.path} was deleted while it was being opened") from e
            raise

    # -- what is in it -------------------------------------------------------------------------

    @property
    def metadata(self) -> Any:
        """The ``metadata`` given to ``save`` (a manager's checkpoints also hold its facts under ``_trainstate``).

        Example:
            >>> trainstate.save("ckpt", state, metadata={"run": "exp1"})
            >>> trainstate.open("ckpt").metadata
            {'run': 'exp1'}
        """
        return tree.decode(self.manifest.metadata)

    @property
    def created(self) -> float:
        """When it was saved: seconds since the epoch (the saving host's clock; for display only).

        Example:
            >>> datetime.datetime.fromtimestamp(trainstate.open("ckpt").created)
        """
        return self.manifest.created

    @property
    def encrypted(self) -> bool:
        """Whether its tensors are encrypted (it was opened with its key, and authenticated with it).

        Example:
            >>> trainstate.open("secret/step_1200", key_env="TRAINSTATE_KEY").encrypted
            True
        """
        return self.manifest.encrypted

    @property
    def world_size(self) -> int:
        """How many ranks saved it together (1: one process); ``trainstate.consolidate`` makes it 1.

        Example:
            >>> trainstate.open("ckpt/step_1200").world_size   # saved by 4 ranks under torchrun
            4
        """
        return self.manifest.world_size

    def keys(self) -> list[str]:
        """Tensor names, in the order they appear in the saved state.

        Example:
            >>> trainstate.open("ckpt").keys()
            ['model.fc.weight', 'model.fc.bias', 'optim.state.0.exp_avg', ...]
        """
        return list(dict.fromkeys(tree.tensor_names(self.manifest.tree)))

    def __contains__(self, name: object) -> bool:
        return name in self.manifest.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self.manifest.tensors)

    def info(self, name: str) -> TensorInfo:
        """What the manifest says about tensor ``name``: dtype, shape, size; no tensor byte is read.

        Raises:
            UnknownKeyError: no tensor of that name (the message suggests close names).

        Example:
            >>> trainstate.open("ckpt").info("model.fc.weight").shape
            (10, 784)
        """
        t = self._entry(name)
        return TensorInfo(name, t.dtype, t.shape, t.nbytes, t.kind, len(t.chunks))

    @property
    def nbytes(self) -> int:
        """The size of its data files, in bytes.

        Example:
            >>> print(f"{trainstate.open('ckpt').nbytes / 2**20:.1f} MiB")
        """
        return sum(f.size for f in self.manifest.files)

    # -- reading --------------------------------------------------------------------------------

    def read(self, name: str, *, framework: str = "numpy", verify: bool = True) -> Any:
        """One tensor, memory-mapped when it is stored in one piece; checked against its checksum.

        Args:
            name: a name from :meth:`keys`.
            framework: ``"numpy"`` (read-only, memory-mapped array), ``"torch"`` or ``"jax"`` (an array of its
                own).
                A memory-mapped array reads the file for as long as it lives; copy it (``np.array``) if the
                file may be truncated meanwhile.
            verify: check the checksum (touches every byte once).

        Example:
            >>> w = ck.read("model.fc.weight")                      # a read-only NumPy array
            >>> w = ck.read("model.fc.weight", framework="torch")   # a torch tensor of its own
        """
        self._entry(name)
        return engine.read_tensor(self, name, framework=frameworks.framework(framework), verify=verify)

    def read_into(self, name: str, out: Any, *, verify: bool = True) -> None:
        """Read tensor ``name`` into ``out``: a contiguous host array of the tensor's dtype and shape.

        Raises:
            InvalidArgumentError: ``out`` is not a writable, contiguous host array of that dtype and shape.

        Example:
            >>> out = np.empty((2, 3), np.float32)
            >>> ck.read_into("model.w", out)    # no allocation: reuse one buffer for many reads
        """
        t = self._entry(name)
        adapter = adapter_for(out)
        have = adapter.describe(out)[:2] if adapter is not None else None
        if have != (t.dtype, t.shape) or engine.flat_view(out) is None:
            raise InvalidArgumentError(
                f"read_into({name!r}) needs a writable, contiguous host array of dtype {t.dtype} and shape "
                f"{list(t.shape)}, got {type(out).__name__}"
                + (f" of dtype {have[0]} and shape {list(have[1])}" if have else "")
            )
        engine.read_into(self, name, out, verify=verify)

    def load(
        self,
        *,
        framework: str = "numpy",
        verify: bool = True,
        threads: int = DEFAULT_THREADS,
        include: str | list[str] | None = None,
        exclude: str | list[str] | None = None,
    ) -> Any:
        """The state as plain values and arrays (NumPy by default); tied tensors come back shared.

        ``include`` / ``exclude`` glob patterns keep only the matching parts.

        Example:
            >>> ck.load()
            {'model': {'w': array([[1., 1., 1.], [1., 1., 1.]], dtype=float32)}, 'step': 3}
            >>> ck.load(include="model.*", framework="torch")
        """
        from trainstate._restore.apply import ABSENT, restore  # restore builds on this module

        framework = frameworks.framework(framework)
        return restore(
            self, ABSENT, include=include, exclude=exclude, framework=framework, verify=verify, threads=threads
        )

    def read_many(self, jobs: list[tuple[str, Any]], *, verify: bool = True, threads: int = DEFAULT_THREADS) -> None:
        """``read_into`` for many ``(name, out)`` pairs, in file order, on ``threads`` threads.

        Example:
            >>> outs = {name: np.empty(ck.info(name).shape, np.float32) for name in ck.keys()}
            >>> ck.read_many(list(outs.items()), threads=4)
        """
        views = []
        for name, out in jobs:
            t = self._entry(name)
            view = engine.flat_view(out)
            if view is None or view.nbytes != t.nbytes:
                raise ValueError(f"read_many needs a contiguous host array of {t.nbytes} bytes for {name}")
            views.append((name, view, None))
        engine.read_views(self, views, verify=verify, threads=threads)

    def verify(self, threads: int = DEFAULT_THREADS) -> None:
        """Re-check every checksum (data-file headers, and every tensor's whole and per-piece checksums),
        on ``threads`` lanes (default: this process's share of its cores; README, "Threads").

        Raises:
            CorruptCheckpointError: a checksum does not match (the message names the tensor or file).

        Example:
            >>> with trainstate.open("ckpt/step_1200") as ck:
            ...     ck.verify()    # what ``trainstate verify ckpt/step_1200`` does
        """
        self.verify_headers()
        engine.verify_all(self, arguments.positive_int(threads, "threads"))

    # -- plumbing -------------------------------------------------------------------------------

    def _entry(self, name: str) -> manifest.TensorEntry:
        try:
            return self.manifest.tensors[name]
        except KeyError:
            close = difflib.get_close_matches(str(name), list(self.manifest.tensors), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else "; ck.keys() lists them"
            raise UnknownKeyError(f"no tensor {name!r:.80} in {self.path}{hint}") from None

    def _file(self, name: str) -> str:
        return self.files.location(name)

    def _check_files(self) -> None:
        for f in self.manifest.files:
            info = self.storage.stat(self._file(f.path))
            if info is None and self.storage.stat(self.storage.join(self.path, manifest.MANIFEST_NAME)) is None:
                raise CheckpointNotFoundError(f"{self.path} was deleted while it was being opened")
            if info is None and f.pool:
                raise pool.missing(self.storage, self.path, f.path)
            if info is None:
                raise CorruptCheckpointError(f"data file {f.path} of {self.path} is missing")
            if not info.regular or info.is_dir:
                raise CorruptCheckpointError(f"{self._file(f.path)} is not a regular file (symlinks are refused)")
            if info.size != f.size:
                raise CorruptCheckpointError(
                    f"data file {f.path} has {info.size} bytes, the manifest says {f.size}: truncated or altered"
                )

    def verify_headers(self) -> None:
        """Check every data file's safetensors header against the manifest (a few KB per file).

        Raises:
            CorruptCheckpointError: a header does not match its checksum.

        Example:
            >>> trainstate.open("ckpt/step_1200").verify_headers()   # quick; verify() reads every byte
        """
        for f in self.manifest.files:
            self._check_header(f)

    def _check_header(self, f: manifest.FileEntry) -> None:
        prefix = bytearray(8)
        self.files.pread(f.path, memoryview(prefix), 0)
        n = datafile.header_length(bytes(prefix))
        if n > f.size:
            raise CorruptCheckpointError(f"{f.path}: header length runs past the end of the file")
        blob = bytearray(n)
        self.files.pread(f.path, memoryview(blob), 0)
        checksum.check(memoryview(blob), f.header_checksum, f"the header of {f.path}")

    def close(self) -> None:
        """Unmap and close its data files (arrays read from it that are memory-mapped keep their mapping).

        Example:
            >>> ck = trainstate.open("ckpt")
            >>> w = np.array(ck.read("model.w"))
            >>> ck.close()     # or use ``with trainstate.open(...) as ck:``
        """
        self.files.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<trainstate.Checkpoint {str(self.path)!r}: {len(self.manifest.tensors)} tensors>"


def _no_tensor(name: str) -> Any:
    raise CorruptCheckpointError(f"metadata refers to tensor {name!r}")


def _read_manifest(storage: Storage, path: str, key: _keys.Key | None = None, lazy: bool = False) -> manifest.Manifest:
    """The checkpoint's manifest, checked; with ``lazy``, the parts a use needs when it needs them
    (``lazy_manifest.py``: a whole-manifest check then fails at that use, not here)."""
    # ``path`` itself may be a link the user made (``run/latest -> step_00000100``): followed. Every
    # name inside the checkpoint is checked with stat(), which sees links, so those are refused.
    info = storage.stat_followed(path)
    if info is None and storage.recover(path):
        info = storage.stat_followed(path)
    if info is None:
        raise CheckpointNotFoundError(f"no checkpoint at {path}")
    if not info.is_dir:
        raise CheckpointNotFoundError(f"{path} is not a checkpoint directory")
    mpath = storage.join(path, manifest.MANIFEST_NAME)
    minfo = storage.stat(mpath)
    if minfo is None and storage.stat_followed(path) is None:
        raise CheckpointNotFoundError(f"{path} was deleted while it was being opened")
    if minfo is None:
        from trainstate._format.run_dir import step_of  # not at the top: the manager imports this module

        steps = sorted(
            (n for n in storage.list(path) if step_of(n) is not None), key=lambda n: step_of(n) or 0, reverse=True
        )
        if steps:
            newest = next(
                (
                    storage.join(path, n)
                    for n in steps
                    if storage.stat(storage.join(path, n, manifest.MANIFEST_NAME)) is not None
                ),
                None,
            )
            raise CheckpointNotFoundError(
                f"{path} is a CheckpointManager's run directory, not one checkpoint: resume with "
                f"CheckpointManager({path!r}).restore_latest(state), or load one of its checkpoints"
                + (f", e.g. the newest, {newest}" if newest else " (none of them is committed yet)")
            )
        raise IncompleteCheckpointError(
            f"{path} has no {manifest.MANIFEST_NAME}: the save that wrote it never committed"
        )
    if not minfo.regular or minfo.is_dir:
        raise CorruptCheckpointError(f"{mpath} is not a regular file (symlinks are refused)")
    if minfo.size > MAX_MANIFEST:
        raise CorruptCheckpointError(
            f"{mpath} is {minfo.size} bytes, more than the {MAX_MANIFEST} a manifest may have: it is damaged or forged"
        )
    raw = bytearray(minfo.size)
    try:
        got = storage.read_into(mpath, 0, memoryview(raw))
    except StorageError as e:
        if e.errno == errno.ENOENT:
            raise CheckpointNotFoundError(f"{path} was deleted while it was being opened") from e
        raise
    if got != minfo.size:
        raise CorruptCheckpointError(f"{mpath} changed while it was read")
    try:
        # no copy: a refused manifest costs its size, once
        return (lazy_manifest.parse if lazy else manifest.parse)(raw, mpath, key)
    except WrongKeyError as e:  # or a damaged salt / key check: a chunk that decrypts with the key tells
        raise key_or_damage.diagnose(storage, path, mpath, raw, key, e) if key is not None else e from None


def open_checkpoint(
    path: Source,
    storage: Storage | None = None,
    *,
    key: _keys.KeyLike | None = None,
    key_env: str | None = None,
) -> Checkpoint:
    """Open a checkpoint lazily: reads the manifest now, tensors when asked.

    ``path`` is a checkpoint directory or URL, or a packed checkpoint (``trainstate.pack``): bytes, a buffer,
    a binary file open for reading, or a packed file's path. A buffer is read in place, not copied.

    An encrypted checkpoint opens only with its key: ``key`` (32 bytes, 64 hex digits or base64) or
    ``key_env``, the name of an environment variable holding it (docs/encryption.md). Its manifest is
    authenticated with the key before anything else is read.

    Example:
        >>> with trainstate.open("ckpt/step_1200") as ck:
        ...     print(ck.metadata, ck.keys()[:3], ck.info("model.fc.weight"))
        >>> ck = trainstate.open(trainstate.pack("ckpt/step_1200"))  # from bytes
        >>> ck = trainstate.open("secret/step_1200", key_env="TRAINSTATE_KEY")  # an encrypted one
    """
    return Checkpoint(path, storage, key=key, key_env=key_env)
