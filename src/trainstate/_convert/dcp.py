"""torch.distributed.checkpoint directories, read a tensor at a time without unpickling code.

DCP keeps its metadata (``.metadata``) as a plain pickle, which ``FileSystemReader.read_metadata`` loads
with ``pickle.load``: a hostile directory would run code. ``dcp_metadata`` unpickles it with a restricted
unpickler and checks what it declares (chunks that tile each tensor, files inside the folder, sizes its
bytes can hold) before anything is allocated. Tensors are then loaded through DCP's own planner (``dcp.load``
without a process group: ``no_dist=True``) with a reader of ours that opens only the files the check
resolved, reads only the byte ranges it checked, decompresses a zstd entry no further than its declared
size, and reads each chunk and non-tensor value with trainstate's own torch.save reader (``torch_file``,
a restricted unpickler; DCP's own reader uses ``torch.load(weights_only=False)`` for values). One tensor per
call, into a fresh tensor of its saved shape and dtype, so the importer holds one tensor at a time. The nesting DCP flattened away (``model.layer.weight``
from ``{"model": {"layer.weight": ...}}``) comes back from the metadata's ``planner_data``.

Every failure of a read is a CheckpointError naming the file: DCP wraps what a reader raises in its
``CheckpointException``, a BaseException, so the reader keeps its own error and it is raised here instead.
"""

from __future__ import annotations

import functools
import io
import warnings
import zipfile
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import numpy as np

from trainstate._convert import torch_file
from trainstate._convert.dcp_metadata import METADATA, Checked, Stored
from trainstate._convert.dcp_metadata import read as read_metadata
from trainstate._convert.source import SourceTensor, real_size
from trainstate._optional import optional
from trainstate._tree import MAX_DEPTH
from trainstate.errors import CheckpointError, CorruptCheckpointError, UnsupportedValueError

__all__ = ["METADATA", "read"]

BATCH_BYTES = 16 << 20  # small tensors loaded together, up to this many bytes


def read(path: Path) -> Any:
    """The state a DCP directory holds: nested dicts / lists of :class:`SourceTensor` s (each loaded when
    the writer reaches it) and plain values (read now, by torch_file's restricted unpickler)."""
    checked = read_metadata(path)
    root: dict[Any, Any] = {}
    batches = _Batches(path, checked)
    for fqn, where in checked.where.items():
        if not 0 < len(where) <= MAX_DEPTH:
            raise CorruptCheckpointError(f"{path / METADATA}: {fqn!r:.80} is nested {len(where)} levels deep")
        tensor = checked.tensors.get(fqn)
        if tensor is not None:
            value: Any = SourceTensor(tensor.dtype, tensor.shape, tensor.nbytes, partial(batches.get, fqn))
            batches.tensors[fqn] = value
        else:
            value = _Plain(fqn)
        _put(path, root, fqn, where, value)
    values = _load(path, checked, {fqn: None for fqn in checked.plain})
    fqn_of = {id(t): fqn for fqn, t in batches.tensors.items()}
    batches.set_order([fqn_of[id(t)] for t in _leaves(root)])
    return _lists(root, values)


class _Plain(NamedTuple):
    """Where a non-tensor value goes, until it is loaded."""

    fqn: str


class _Batches:
    """Tensors loaded a few at a time, in the order the writer asks for them (tree order).

    Each ``dcp.load`` call plans, reads the plan and copies: a few milliseconds whatever its size, so
    small tensors are loaded together, up to :data:`BATCH_BYTES` at once; a tensor the writer has not
    reached yet waits in ``ready``. A large tensor is loaded alone.
    """

    def __init__(self, path: Path, checked: Checked) -> None:
        self.path, self.checked = path, checked
        self.tensors: dict[str, SourceTensor] = {}
        self.order: list[str] = []
        self.position: dict[str, int] = {}
        self.ready: dict[str, np.ndarray] = {}

    def set_order(self, order: list[str]) -> None:
        self.order, self.position = order, {fqn: i for i, fqn in enumerate(order)}

    def get(self, fqn: str) -> np.ndarray:
        found = self.ready.pop(fqn, None)
        if found is not None:
            return found
        from trainstate._frameworks import torch as adapter

        group, total = [fqn], self.tensors[fqn].nbytes
        at = self.position.get(fqn, len(self.order)) + 1
        for later in self.order[at:]:
            n = self.tensors[later].nbytes
            if total + n > BATCH_BYTES or later in self.ready:
                break
            group.append(later)
            total += n
        outs = {f: adapter.empty(self.tensors[f].dtype, self.tensors[f].shape) for f in group}
        _load(self.path, self.checked, dict(outs))
        for f in group[1:]:
            self.ready[f] = np.frombuffer(adapter.byte_view(outs[f]), np.uint8)
        return np.frombuffer(adapter.byte_view(outs[fqn]), np.uint8)


def _leaves(node: Any) -> list[SourceTensor]:
    """The tensors of a nested dict built by :func:`_put`, in order."""
    if isinstance(node, SourceTensor):
        return [node]
    if isinstance(node, dict):
        return [leaf for child in node.values() for leaf in _leaves(child)]
    return []


def _load(path: Path, checked: Checked, state: dict[str, Any]) -> dict[str, Any]:
    """``dcp.load`` of the keys of ``state`` (tensors filled in place); returns the non-tensor values."""
    from torch.distributed.checkpoint.state_dict_loader import load

    reader_class, planner_class = _classes()
    reader, planner = reader_class(path, checked), planner_class()
    try:
        with warnings.catch_warnings():  # "torch.distributed is disabled": no_dist=True is what is meant
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            load(state, storage_reader=reader, planner=planner, no_dist=True)
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        cause = _cause(e)
        if isinstance(cause, (KeyboardInterrupt, SystemExit)):  # DCP wraps a Ctrl-C too
            raise cause from None
        if reader.failed is not None:
            raise reader.failed from None
        if planner.refused is None:
            text = str(cause).strip()
            raise CorruptCheckpointError(
                f"reading {path} (a DCP directory) failed: {type(cause).__name__}: "
                f"{text.splitlines()[0][:200] if text else ''}"
            ) from None
    if planner.refused is not None:  # raised here: DCP wraps what a planner raises in its own error
        raise UnsupportedValueError(
            f"{path}: {planner.refused} holds a pickled object other than tensors and plain values; trainstate "
            "never unpickles code"
        )
    loaded: dict[str, Any] = planner.loaded
    return loaded


def _cause(e: BaseException) -> BaseException:
    """The first failure a CheckpointException wraps (DCP keeps each as an (exception, traceback) pair),
    else the error itself."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        found = first[0] if isinstance(first, tuple) and first else first
        if isinstance(found, BaseException):
            return found
    return e


class _Window(io.RawIOBase):
    """Bytes ``start`` to ``start + length`` of an open file, as a seekable file of its own."""

    def __init__(self, f: Any, start: int, length: int) -> None:
        super().__init__()
        self.f, self.start, self.length, self.pos = f, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = (0, self.pos, self.length)[whence]
        self.pos = max(base + offset, 0)
        return self.pos

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), self.length - self.pos)
        if n <= 0:
            return 0
        self.f.seek(self.start + self.pos)
        got: int = self.f.readinto(memoryview(buffer).cast("B")[:n])
        self.pos += got
        return got


def _entry(f: BinaryIO, where: Stored, what: str) -> BinaryIO:
    """The bytes of one storage entry (a torch.save file), decompressed no further than its limit: a zip from
    its first byte. Python's zipfile finds a zip at the end of its bytes, whatever precedes it; torch.load
    reads bytes that do not start as a zip as its legacy format, whose unnamed storages it leaves
    uninitialized: an entry torch.load would read otherwise than it was checked is refused."""
    window: BinaryIO = _Window(f, where.offset, where.length)  # type: ignore[assignment]
    if where.compressed:
        with optional("zstandard", extra="zstd", needed_for="importing a zstd-compressed DCP directory"):
            import zstandard
        out = bytearray()
        with zstandard.ZstdDecompressor().stream_reader(window) as stream:
            while len(out) <= where.limit:
                piece = stream.read(min(1 << 20, where.limit + 1 - len(out)))
                if not piece:
                    break
                out += piece
        if len(out) > where.limit:
            raise CorruptCheckpointError(
                f"{where.file}: the compressed entry of {what} decompresses past the {where.limit} bytes its "
                "metadata declares"
            )
        window = io.BytesIO(out)
    if window.read(4) != b"PK\x03\x04":  # torch.load reads anything else as its legacy format, unchecked
        raise CorruptCheckpointError(
            f"{where.file}: the entry of {what} does not start as a zip, as torch.save writes it"
        )
    window.seek(0)
    with zipfile.ZipFile(window) as z:  # torch.load would inflate a deflated record to the size it claims
        records = z.infolist()
        if min((i.header_offset for i in records), default=-1) != 0:  # bytes before the zip zipfile read
            raise CorruptCheckpointError(
                f"{where.file}: the entry of {what} has bytes before its zip, which torch.save never writes"
            )
        if any(i.compress_type != zipfile.ZIP_STORED or i.file_size > where.limit for i in records):
            raise CorruptCheckpointError(
                f"{where.file}: the entry of {what} holds compressed or oversized records; torch.save writes neither"
            )
    window.seek(0)
    return window


@functools.cache
def _classes() -> tuple[Any, Any]:
    """DCP's reader and planner with the changes the module docstring describes (made on first use:
    defining them imports torch)."""
    import torch
    from torch.distributed._shard._utils import narrow_tensor_by_index
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.planner import LoadItemType
    from torch.futures import Future

    class Reader(FileSystemReader):
        def __init__(self, path: Path, checked: Checked) -> None:
            super().__init__(path)
            self.checked = checked
            self.failed: CheckpointError | None = None
            self.values_left = 2 * _folder_bytes(path) + VALUES_SLACK  # what the non-tensor values may take

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return self.checked.md

        def read_data(self, plan: Any, planner: Any) -> Any:
            by_file: dict[Path, list[Any]] = {}
            for item in plan.items:
                by_file.setdefault(self.checked.stored[item.storage_index].file, []).append(item)
            for file, items in by_file.items():
                what = "?"
                try:
                    with open(file, "rb") as f:
                        for item in items:
                            what = repr(item.storage_index.fqn)[:80]
                            self._read(f, item, what, planner)
                except CheckpointError as e:
                    self.failed = e
                    raise
                except Exception as e:  # noqa: BLE001 - torch.load / zip / zstd on damaged bytes
                    text = str(e).strip()
                    self.failed = CorruptCheckpointError(
                        f"{file}: the bytes of {what} are not what DCP writes ({type(e).__name__}: "
                        f"{text.splitlines()[0][:160] if text else ''})"
                    )
                    raise
            done: Future[None] = Future()
            done.set_result(None)
            return done

        def _over(self, where: Stored) -> UnsupportedValueError:
            return UnsupportedValueError(
                f"{where.file}: the non-tensor values of this DCP directory decompress to more than twice its bytes "
                "plus 16 MiB; trainstate imports no more from a source"
            )

        def _read(self, f: BinaryIO, item: Any, what: str, planner: Any) -> None:
            where = self.checked.stored[item.storage_index]
            value = item.type == LoadItemType.BYTE_IO
            if value and where.compressed and where.limit > self.values_left:
                where = where._replace(limit=self.values_left)  # decompressed no further than the values' budget
            try:
                data = _entry(f, where, what)
            except CorruptCheckpointError:
                if value and where.limit == self.values_left:
                    raise self._over(where) from None
                raise
            if value:  # a plain value, read here: the planner never sees the file
                raw = data.read()
                self.values_left -= len(raw)
                if self.values_left < 0:  # each may decompress to BYTES_LIMIT: together, no more than the source
                    raise self._over(where)
                try:
                    planner.loaded[item.dest_index.fqn] = torch_file.read_bytes(raw, where.file)
                except UnsupportedValueError:
                    planner.refused = planner.refused or item.dest_index.fqn
                return
            tensor = torch_file.read_bytes(data.read(), where.file)
            target = planner.resolve_tensor(item).detach()
            if not isinstance(tensor, torch.Tensor) or tensor.dtype != target.dtype:
                raise CorruptCheckpointError(f"{where.file}: the entry of {what} is not a {target.dtype} tensor")
            tensor = narrow_tensor_by_index(tensor, item.storage_offsets, item.lengths)
            if target.size() != tensor.size():
                raise CorruptCheckpointError(
                    f"{where.file}: the entry of {what} holds {list(tensor.size())} where its metadata declares "
                    f"{list(target.size())}"
                )
            target.copy_(tensor)
            planner.commit_tensor(item, target)

    class Planner(DefaultLoadPlanner):
        def __init__(self) -> None:
            super().__init__(flatten_state_dict=False)
            self.loaded: dict[str, Any] = {}
            self.refused: str | None = None

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            raise AssertionError("the reader reads plain values itself (Reader._read)")

    return Reader, Planner


VALUES_SLACK = 16 << 20  # bytes the non-tensor values may decompress to beyond twice the directory's


def _folder_bytes(path: Path) -> int:
    """The bytes of the directory's files, each file counted once however many names (links) reach it, and
    only the bytes really there (:func:`~trainstate._convert.source.real_size`)."""
    files = {(s.st_dev, s.st_ino): real_size(s) for p in path.iterdir() if p.is_file() for s in [p.stat()]}
    return sum(files.values())


def _put(path: Path, root: dict[Any, Any], fqn: str, where: tuple[Any, ...], value: Any) -> None:
    node = root
    for key in where[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise CorruptCheckpointError(f"{path / METADATA}: {fqn!r:.80} nests a value under another value")
    if where[-1] in node:
        raise CorruptCheckpointError(
            f"{path / METADATA}: {fqn!r:.80} is placed at {'.'.join(map(str, where))!r:.80}, where another value is"
        )
    node[where[-1]] = value


def _lists(node: Any, values: dict[str, Any]) -> Any:
    """Dicts keyed 0..n-1 by ints back into lists (DCP flattens list items by index); plain values in."""
    if isinstance(node, _Plain):
        return values.get(node.fqn)
    if not isinstance(node, dict):
        return node
    items = {k: _lists(v, values) for k, v in node.items()}
    if items and all(type(k) is int for k in items) and sorted(items) == list(range(len(items))):
        return [items[i] for i in range(len(items))]
    return _optimizer_positions(items)


def _optimizer_positions(node: dict[Any, Any]) -> dict[Any, Any]:
    """A torch optimizer's state_dict with its ``state`` keyed by position again: DCP writes every dict key
    as a string (``"0"``), and an optimizer's ``load_state_dict`` would keep state keyed ``"0"`` beside the
    parameter at position 0 without giving it to it. A key is turned back into an int only where it is the
    decimal string of a position the ``param_groups`` list."""
    state, groups = node.get("state"), node.get("param_groups")
    if not isinstance(state, dict) or not isinstance(groups, list):
        return node
    positions = {p for g in groups if isinstance(g, dict) and isinstance(g.get("params"), list) for p in g["params"]}
    if not positions or not all(type(p) is int for p in positions):
        return node
    node["state"] = {
        int(k) if type(k) is str and k.isdecimal() and str(int(k)) == k and int(k) in positions else k: v
        for k, v in state.items()
    }
    return node
