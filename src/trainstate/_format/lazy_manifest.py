"""Opening a manifest for what is asked of it: one tensor's entry without parsing the others.

``open(path).read(name)`` needs the manifest's header (its files, version and checksum) and one entry. For
a model of hundreds of tensors, decoding the whole manifest and checking all of it costs several times
reading the tensor (issue 27: 2.3 ms against safetensors' 0.6 ms for 600 tensors). A manifest in the
writer's line layout (``manifest_lines.py``, docs/format.md §3.1) gives both cheaply, so :func:`parse`
checks the limits and the checksum (or MAC) over all of its bytes as :func:`manifest.parse` does, parses
the header, and returns a :class:`LazyManifest`. Its ``tensors`` finds a name's line by binary search and
checks that entry as every entry is checked (``tensor_entry``: its dtype, shape, chunks, byte ranges
inside the files); the read then checks the bytes against their checksums.

Nothing a whole-manifest use relies on is skipped: the first time anything but one name's entry is asked
for (the tree, the metadata, the list of tensors, their number), the manifest completes itself with exactly
:func:`manifest.parse`'s parse and checks of the same bytes (no two chunks sharing bytes, the tree and its
cross-check against the entries, ...), and checks that they agree with what it already handed out. So
``load``, ``restore``, ``keys``, ``verify`` and ``inspect`` run every check they ran before, and a manifest
whose lines were forged to say one thing to a lookup and another to the full parse is refused there.
A name that has no line is looked up in the full parse too (a not-found is never decided by the lines).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from typing import Any

from trainstate._format import manifest, manifest_limits, manifest_lines
from trainstate._format.manifest import Manifest, TensorEntry
from trainstate._keys import Key
from trainstate.errors import CorruptCheckpointError


def parse(raw: bytes | bytearray, what: str = manifest.MANIFEST_NAME, key: Key | None = None) -> Manifest:
    """:func:`manifest.parse`, lazily where the bytes are in the line layout (same checks of the bytes and
    the header now, the rest when first needed); raises what it raises."""
    manifest_limits.check_limits(raw, what)
    lines = manifest_lines.split(raw)
    if lines is None:
        return manifest.parse(raw, what, key)
    try:
        body = manifest.loads(lines.header, what)
        if body.get("tensors") != {} or body.get("metadata", 0) is not None or body.get("tree", 0) is not None:
            return manifest.parse(raw, what, key)  # its header holds more than the layout puts there
        manifest.check_seal(raw, body, key, what, reformatted=False)
        with manifest.malformed(what):
            fields = manifest.head(body)
    except CorruptCheckpointError:  # reported as the full parse reports it
        return manifest.parse(raw, what, key)
    return LazyManifest(raw, lines, fields, what)


class LazyManifest(Manifest):
    """A manifest whose tensor entries are found by line; it completes itself (a :class:`Manifest` parsed
    whole) the first time its tree, metadata or whole tensor table is used."""

    _raw: bytes | bytearray  # checked already (limits and checksum); b"" once parsed whole
    _what: str
    _whole: Manifest | None
    _table: _LineTensors
    _lock: threading.Lock  # a lookup and the completion, one at a time

    def __init__(self, raw: bytes | bytearray, lines: manifest_lines.Lines, fields: dict[str, Any], what: str) -> None:
        # Not the dataclass's __init__: tree and metadata are properties here.
        for name, value in fields.items():
            object.__setattr__(self, name, value)
        table = _LineTensors(self, lines, manifest.sizes(fields["files"]))
        object.__setattr__(self, "tensors", table)
        object.__setattr__(self, "_table", table)
        object.__setattr__(self, "_raw", raw)
        object.__setattr__(self, "_what", what)
        object.__setattr__(self, "_whole", None)
        object.__setattr__(self, "_lock", threading.Lock())

    @property
    def tree(self) -> Any:
        return self.whole().tree

    @property
    def metadata(self) -> Any:
        return self.whole().metadata

    def whole(self) -> Manifest:
        """The manifest parsed and checked whole (once), as :func:`manifest.parse` does.

        Raises:
            CorruptCheckpointError: a check of the whole manifest fails, or it disagrees with what its lines
                gave before (a forged layout).
        """
        whole = self._whole
        if whole is not None:
            return whole
        with self._lock:
            whole = self._whole
            if whole is None:
                body = manifest.loads(self._raw, self._what)
                body.pop("checksum", None)  # checked when it was opened, over these bytes
                whole = manifest.build(body, self._what)
                problem = self._table.lines.disagrees() if self._table.lines is not None else None
                if problem is not None:
                    raise CorruptCheckpointError(
                        f"{self._what}: {problem}: it was altered after it was written (its lines and its JSON "
                        "could be read as two different manifests); restore another checkpoint"
                    )
                self._agrees(whole)
                object.__setattr__(self, "_whole", whole)
                object.__setattr__(self, "tensors", whole.tensors)  # each lookup from now on as a parsed one's
                object.__setattr__(self, "_raw", b"")  # parsed now: a merged manifest's bytes can be 100s of MB
                self._table.lines = None
        return whole

    def _agrees(self, whole: Manifest) -> None:
        fields = ("files", "created", "writer", "format_version", "extra", "world_size", "encrypted")
        differs = [f for f in fields if getattr(whole, f) != getattr(self, f)]
        differs += [name for name, entry in self._table.found.items() if whole.tensors.get(name) != entry]
        if differs:
            raise CorruptCheckpointError(
                f"{self._what}: its lines and its JSON say different things about {differs[0]!r:.80} (a member "
                "listed twice, or lines not laid out as a writer lays them out): it was altered after it was "
                "written; restore another checkpoint"
            )


class _LineTensors(Mapping[str, TensorEntry]):
    """Tensor entries found by line and checked when first looked up; anything that needs the whole table
    (iteration, its length, a name with no line) asks the whole manifest."""

    def __init__(self, owner: LazyManifest, lines: manifest_lines.Lines, sizes: dict[str, int]) -> None:
        self._owner, self._sizes = owner, sizes
        self.lines: manifest_lines.Lines | None = lines  # None once the whole manifest is parsed
        self.found: dict[str, TensorEntry] = {}  # what lookups gave: the whole parse must agree

    def __getitem__(self, name: str) -> TensorEntry:
        entry = self.found.get(name)
        if entry is not None:
            return entry
        with self._owner._lock:  # not while the whole parse checks what was found
            lines = self.lines
            raw = lines.find(name) if lines is not None and type(name) is str else manifest_lines.MISSING
            if raw is not manifest_lines.MISSING:
                with manifest.malformed(f"tensor {name!r:.80} in the manifest"):
                    entry = self.found[name] = manifest.tensor_entry(name, raw, self._sizes, self._owner.encrypted)
                return entry
        return self._owner.whole().tensors[name]  # KeyError for a name it does not list

    def __contains__(self, name: object) -> bool:
        lines = self.lines
        if name in self.found or (
            lines is not None and type(name) is str and lines.find(name) is not manifest_lines.MISSING
        ):
            return True
        return name in self._owner.whole().tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self._owner.whole().tensors)

    def __len__(self) -> int:
        return len(self._owner.whole().tensors)
