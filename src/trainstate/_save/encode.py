"""state -> tree + tensor table: flatten the state without copying an array; tied arrays are stored once."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from trainstate import _state, _tree
from trainstate._format import dtypes, manifest
from trainstate._format.added_keys import LOCAL_VIEW, check_declaration
from trainstate._frameworks import Adapter, adapter_for, bind
from trainstate.errors import UnsupportedValueError


@dataclass
class Entry:
    """One array to store: ``value`` is what this process holds (for a DTensor, its local shard), ``shape``
    that part's shape, and ``offset`` / ``global_shape`` place it in the whole tensor."""

    name: str
    value: Any
    adapter: Adapter
    dtype: str
    shape: tuple[int, ...]
    kind: str
    nbytes: int
    offset: tuple[int, ...] = ()
    global_shape: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.global_shape:
            self.global_shape = self.shape
        if len(self.offset) != len(self.shape):
            self.offset = (0,) * len(self.shape)
        refused = manifest.shape_refused(self.global_shape)
        if refused is not None:  # refused here, by every writer, not by the first reader of the checkpoint
            raise UnsupportedValueError(f"{self.name}: a tensor of {refused} cannot be stored")


class TensorTable:
    """Collects the arrays met while encoding; an array met twice (tied weights) is stored once."""

    def __init__(self, collective: bool = False, local_view: bool = False) -> None:
        self.collective = collective  # a part of an array (a DTensor's shard) is stored only in a collective save
        # this process's own view (a local tier's checkpoint): a part stored whole, where it lies kept in boxes
        self.local_view = local_view
        self.boxes: dict[str, tuple[list[int], list[int]]] = {}
        self.entries: list[Entry] = []
        self._by_identity: dict[tuple[object, ...], str] = {}
        self._names: set[str] = set()
        self._adapters: dict[type, Adapter] = {}  # the array's type decides its adapter: look it up once

    def add(self, path: tuple[str, ...], value: Any) -> str:
        adapter = self._adapters.get(type(value))
        if adapter is None:
            adapter = adapter_for(value)
            assert adapter is not None
            self._adapters[type(value)] = adapter
        dtype, shape, kind = adapter.describe(value)  # also refuses what cannot be stored
        if not adapter.has_values(value):
            raise UnsupportedValueError(
                f"a {type(value).__name__} has a shape and dtype but no values to save (it can be a restore target)"
            )
        global_shape, offset = shape, (0,) * len(shape)
        part = adapter.local_part(value)
        box = None
        if part is not None and self.local_view:  # stored as a whole tensor of its own; where it lies, beside
            value, box = part[0], (list(part[1]), list(global_shape))
            global_shape = shape = tuple(value.shape)
        elif part is not None:  # sharded over ranks: this process stores its own part
            value, offset = part
            shape = tuple(value.shape)
            if not self.collective and shape != global_shape:
                raise UnsupportedValueError(
                    f"this process holds only part of it (shape {list(shape)} at {list(offset)} of "
                    f"{list(global_shape)}): save it collectively, on every process (the default under "
                    "a job of several processes), not with collective=False"
                )
        ident = adapter.identity(value)
        if ident is not None and ident in self._by_identity:
            return self._by_identity[ident]
        name = tensor_name(path, self._names)
        if box is not None:
            self.boxes[name] = box
        nbytes = dtypes.BY_CODE[dtype].itemsize * math.prod(shape)
        self.entries.append(Entry(name, value, adapter, dtype, shape, kind, nbytes, offset, global_shape))
        if ident is not None:
            self._by_identity[ident] = name
        return name


def tensor_name(path: tuple[str, ...], taken: set[str]) -> str:
    """A tensor's name in the table (docs/format.md §4): its dotted path, ``~2``, ``~3``... when taken; added
    to ``taken``."""
    name = _tree.join(path) or "_"
    base, n = name, 1
    while name in taken:  # e.g. {"a.b": x, "a": {"b": y}}
        n += 1
        name = f"{base}~{n}"
    taken.add(name)
    return name


@dataclass
class Snapshot:
    """A state flattened for writing: the encoded tree, its metadata, and the arrays to store."""

    tree: _tree.Node
    metadata: _tree.Node
    entries: list[Entry]

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)


def encode_state(
    state: Any, metadata: Any = None, rank: int | None = None, local_view: tuple[int, int] | None = None
) -> Snapshot:
    """Flatten ``state`` (calling ``state_dict()`` on statefuls) without copying any array.

    ``rank``: this process's rank in a collective save (per-rank parts go under their rank's key). An
    optimizer whose modules are in the state is saved keyed by parameter name (``_frameworks/torch_optim.py``).
    ``local_view``: (rank, world size) of a process saving its own view alone (a local tier's checkpoint): each
    part of a sharded array (a DTensor's shard) is stored as a whole tensor, and where it lies in its array is
    recorded in the metadata (``LOCAL_VIEW``), for a restore by the same rank at the same world size.
    """
    check_declaration(metadata)
    table = TensorTable(collective=rank is not None, local_view=local_view is not None)
    tree_node = _state.encode(state, table.add, rank=rank, bound=bind(_state.stateful_objects(state)))
    if local_view is not None:
        view = {"rank": local_view[0], "world_size": local_view[1], "boxes": dict(table.boxes)}
        metadata = {**(metadata or {}), LOCAL_VIEW: view}
    return Snapshot(tree_node, _state.encode_plain(metadata), table.entries)
