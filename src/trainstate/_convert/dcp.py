"""torch.distributed.checkpoint directories, read a tensor at a time without unpickling code.

DCP keeps its metadata (``.metadata``) as a plain pickle, which ``FileSystemReader.read_metadata`` loads
with ``pickle.load``: a hostile directory would run code. ``dcp_metadata`` unpickles it with a restricted
unpickler and checks what it declares (chunks that tile each tensor, files inside the folder, sizes its
bytes can hold) before anything is allocated. Non-tensor values are loaded with
``torch.load(weights_only=True)`` instead of DCP's ``weights_only=False``. Tensors are loaded through DCP's
own ``dcp.load`` (no process group: ``no_dist=True``), one tensor per call, into a fresh tensor of its saved
shape and dtype, so the importer holds one tensor at a time. The nesting DCP flattened away
(``model.layer.weight`` from ``{"model": {"layer.weight": ...}}``) comes back from the metadata's
``planner_data``.
"""

from __future__ import annotations

import functools
import io
import pickle
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from trainstate._convert.dcp_metadata import METADATA, Checked
from trainstate._convert.dcp_metadata import read as read_metadata
from trainstate._convert.source import SourceTensor
from trainstate._tree import MAX_DEPTH
from trainstate.errors import CorruptCheckpointError, UnsupportedValueError

__all__ = ["METADATA", "read"]

BATCH_BYTES = 16 << 20  # small tensors loaded together, up to this many bytes


def read(path: Path) -> Any:
    """The state a DCP directory holds: nested dicts / lists of :class:`SourceTensor` s (each loaded when
    the writer reaches it) and plain values (loaded now, with ``weights_only=True``)."""
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
    planner = planner_class()
    try:
        load(state, storage_reader=reader_class(path, checked), planner=planner, no_dist=True)
    except Exception as e:  # noqa: BLE001 - DCP's own errors: a damaged or truncated directory
        if planner.refused is None:
            raise CorruptCheckpointError(f"reading {path} (a DCP directory) failed: {e!s:.200}") from None
    if planner.refused is not None:  # raised here: DCP wraps what a planner raises in its own error
        raise UnsupportedValueError(
            f"{path}: {planner.refused} holds a pickled object other than tensors and plain values; trainstate "
            "never unpickles code"
        )
    loaded: dict[str, Any] = planner.loaded
    return loaded


@functools.cache
def _classes() -> tuple[Any, Any]:
    """DCP's reader and planner with the two changes the module docstring describes (made on first use:
    defining them imports torch)."""
    import torch
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    class Reader(FileSystemReader):
        def __init__(self, path: Path, checked: Checked) -> None:
            super().__init__(path)
            self.checked = checked

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return self.checked.md

    class Planner(DefaultLoadPlanner):
        def __init__(self) -> None:
            super().__init__(flatten_state_dict=False)
            self.loaded: dict[str, Any] = {}
            self.refused: str | None = None

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            try:
                self.loaded[fqn] = torch.load(value, weights_only=True)
            except pickle.UnpicklingError:
                self.refused = self.refused or fqn

    return Reader, Planner


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
    return items
