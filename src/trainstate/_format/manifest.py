"""The manifest: a checkpoint's table of contents and its commit marker.

It is written last; a checkpoint without one never committed. It is plain JSON with an explicit
``format_version`` (the format's, not the package's) and a checksum over its own bytes (the file begins
with it), so a flipped byte in it is caught like one in a data file. Parsing validates everything a hostile
file could lie about — file names, byte ranges, shapes, dtypes — before a single data byte is read, so a reader
never allocates more than the files hold. Before the JSON is parsed at all, its size and a cheap bound on
what parsing it costs (:func:`parse_cost`) are checked, so a small file cannot make the reader build gigabytes
of Python objects; the writer checks the same bound, so every manifest it writes can be read back.
Large chunks may also carry per-piece checksums (:class:`Pieces`, format 1.1): a reader can then check
and copy a chunk a cache-sized piece at a time, so damaged bytes never land and nothing is read twice.

docs/format.md is the normative description. Minor versions only add optional fields an older reader
of the same major version may ignore (it still finds every checksum it knows); a writer declares the
lowest version whose fields it uses, so a manifest without pieces stays a 1.0 manifest.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import numpy as np

from trainstate import _gc, _transforms, _tree
from trainstate._format import boxes, dtypes, manifest_lines, manifest_mac
from trainstate._format.chunk_table import ChunkTable
from trainstate._format.entries import Chunk as Chunk  # re-exported: a manifest's entries
from trainstate._format.entries import FileEntry as FileEntry
from trainstate._format.entries import Pieces as Pieces
from trainstate._format.entries import TensorEntry as TensorEntry
from trainstate._format.manifest_limits import check_limits, over_limits
from trainstate._keys import Key
from trainstate.errors import CorruptCheckpointError, FormatVersionError, UnsupportedValueError

FORMAT_NAME = "trainstate"
FORMAT_VERSION = "1.0"  # what a manifest without newer optional fields declares
"""The base manifest format version (``MAJOR.MINOR``; docs/format.md): what a checkpoint declares when it
uses no optional feature of a later minor version (those declare up to ``1.4``).

This trainstate reads every version of its major; a checkpoint of a newer major raises ``FormatVersionError``.

Example:
    >>> trainstate.FORMAT_VERSION
    '1.0'
    >>> json.load(open("ckpt/step_1200/manifest.json"))["format_version"]
    '1.0'
"""
PIECES_VERSION = "1.1"  # the minor version that added per-piece checksums (Chunk.pieces)
WORLD_SIZE_VERSION = "1.2"  # the minor version that added world_size (a collective save's number of ranks)
TRANSFORMS_VERSION = "1.3"  # the minor version that added chunk transforms (compression, encryption)
POOL_VERSION = "1.4"  # the minor version that added pool files (incremental checkpoints: FileEntry.pool)
MANIFEST_NAME = "manifest.json"
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,200}")  # in full: "$" would let a trailing newline in


@dataclass(frozen=True)
class Manifest:
    tree: _tree.Node  # the state (see _tree.py)
    tensors: Mapping[str, TensorEntry]
    files: tuple[FileEntry, ...]
    metadata: _tree.Node = _tree.NONE  # plain values, as nodes like the tree
    created: float = 0.0
    writer: str = ""
    format_version: str = FORMAT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)  # fields from a newer minor version, kept as-is
    world_size: int = 1  # ranks that wrote it together (format 1.2; written only when more than one)
    encrypted: bool = False  # read from an encrypted checkpoint (format 1.3); writing: to_json_bytes(key)

    def to_json_bytes(self, key: Key | None = None) -> bytes:
        """The manifest file's bytes; with ``key``, an encrypted checkpoint's, authenticated by a MAC
        (``_format/manifest_mac.py``).

        Raises:
            UnsupportedValueError: a reader would refuse them as too large or too costly to parse.
        """
        body = self._body()
        trees: dict[str, str | list[bytes | memoryview]] = {
            "metadata": _tree.to_json(self.metadata),
            "tree": _tree.to_json(self.tree),
        }
        trees["tensors"] = body.pop("tensors")  # rendered already, a line per tensor (manifest_lines.py)
        hasher = manifest_mac.seal(body, key)  # with a key: adds the "encryption" object, MACs instead
        text = manifest_lines.canonical_parts(body, trees)  # joined once, below: a merged manifest can be 100s of MB
        for part in text:
            hasher.update(part)
        # The checksum goes first, whatever other fields sort before it: a reader hashes the bytes after it
        # and never re-serializes (docs/format.md §5.1).
        raw = b"".join([b'{"checksum":', json.dumps(hasher.result()).encode(), b",", *text[1:], b"\n"])
        problem = over_limits(raw)
        if problem:
            raise UnsupportedValueError(
                f"this checkpoint's manifest {problem}, so no reader would open it; the state holds too many "
                "small Python values (lists, dicts, numbers, strings): store long lists of numbers as arrays"
            )
        return raw

    def _body(self) -> dict[str, Any]:
        tensors: Any = None
        if isinstance(self.tensors, ChunkTable):  # a million chunks of many ranks, rendered as columns
            tensors, pieced = self.tensors.canonical_json_parts(lines=True), bool(self.tensors.pieces)
            transformed = bool(self.tensors.transforms)
        if tensors is None:
            with _gc.paused():
                tensors = manifest_lines.tensor_lines({name: _tensor_json(t) for name, t in self.tensors.items()})
            pieced = any(c.pieces for t in self.tensors.values() for c in t.chunks)
            transformed = any(c.transforms for t in self.tensors.values() for c in t.chunks)
        version = self.format_version
        if _older(version, PIECES_VERSION) and pieced:
            version = PIECES_VERSION
        if any(f.pool for f in self.files) and _older(version, POOL_VERSION):
            version = POOL_VERSION
        sharded: dict[str, Any] = {}
        if self.world_size > 1:
            sharded["world_size"] = self.world_size
            version = WORLD_SIZE_VERSION if _older(version, WORLD_SIZE_VERSION) else version
        if transformed and _older(version, TRANSFORMS_VERSION):
            version = TRANSFORMS_VERSION
        return {
            **self.extra,
            **sharded,
            "format": FORMAT_NAME,
            "format_version": version,
            "created": self.created,
            "writer": self.writer,
            "files": [_file_json(f) for f in self.files],
            "tensors": tensors,
        }


def _file_json(f: FileEntry) -> dict[str, Any]:
    out: dict[str, Any] = {"path": f.path, "size": f.size, "header_checksum": f.header_checksum}
    if f.pool:
        out["pool"] = True
        if f.new:
            out["new"] = True
    return out


def _older(version: str, than: str) -> bool:
    return tuple(map(int, version.split("."))) < tuple(map(int, than.split(".")))


def _tensor_json(t: TensorEntry) -> dict[str, Any]:
    # json.dumps writes tuples as arrays, so shapes and ranges go in as they are
    return {"dtype": t.dtype, "shape": t.shape, "kind": t.kind, "chunks": [_chunk_json(c) for c in t.chunks]}


def _chunk_json(c: Chunk) -> dict[str, Any]:
    out: dict[str, Any] = {
        "file": c.file,
        "byte_range": c.byte_range,
        "offset": c.offset,
        "shape": c.shape,
        "checksum": c.checksum,
    }
    if c.transforms:
        out["transforms"] = list(c.transforms)
    if c.pieces is not None:
        out["pieces"] = {"bytes": c.pieces.size, "checksums": c.pieces.checksums}
    return out


_dumps = manifest_lines.dumps  # the canonical JSON of a value


def parse(raw: bytes | bytearray, what: str = MANIFEST_NAME, key: Key | None = None) -> Manifest:
    """Parse, checksum-check and validate manifest bytes; an encrypted checkpoint's are authenticated
    with ``key`` (``_format/manifest_mac.py``).

    Raises:
        FormatVersionError: written by a newer major format version.
        EncryptionKeyError: the key given, or its absence, does not fit the checkpoint.
        CorruptCheckpointError: anything else wrong with it.
    """
    check_limits(raw, what)  # before json.loads: a hostile file is refused before it costs anything
    body = loads(raw, what)
    check_seal(raw, body, key, what)
    return build(body, what)


def loads(raw: bytes | bytearray, what: str) -> dict[str, Any]:
    """Manifest bytes as a JSON object that says it is a trainstate manifest (nothing else checked yet)."""
    with _gc.paused():  # a manifest is hundreds of thousands of small containers and no cycle
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise CorruptCheckpointError(f"{what} is not valid JSON ({e})") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT_NAME:
        raise CorruptCheckpointError(f"{what} is not a trainstate manifest")
    return body


def check_seal(
    raw: bytes | bytearray, body: dict[str, Any], key: Key | None, what: str, reformatted: bool = True
) -> None:
    """Check the checksum (or MAC) of the manifest bytes ``raw``, then the version ``body`` (their JSON, or
    its header: ``manifest_lines.py``) declares; pops the checksum from ``body``. With ``reformatted``
    False, bytes not laid out as a writer lays them out are refused (the caller then parses them whole)."""
    # The version is believed only once the checksum says these are the bytes a writer wrote: a bit flip in
    # an old checkpoint's format_version is damage (skipped like any other), not a newer trainstate's work.
    version = body.get("format_version")
    try:
        _verify(raw, body, key, what, reformatted)
    except CorruptCheckpointError as e:
        if _claims_newer(version):
            raise CorruptCheckpointError(
                f"{e} (it claims format_version {version}, but a manifest that fails its checksum is damaged: "
                "a newer trainstate's manifest still passes its checksum)"
            ) from None
        raise
    _check_version(version, what)


def build(body: dict[str, Any], what: str) -> Manifest:
    """The manifest a checked JSON body holds, every whole-manifest check run (its entries checked lazily)."""
    with malformed(what), _gc.paused():
        return _build(body, what)


def _verify(raw: bytes | bytearray, body: dict[str, Any], key: Key | None, what: str, reformatted: bool = True) -> None:
    """Check the checksum (or an encrypted checkpoint's MAC) over the bytes it covers; pops it from ``body``."""
    expected = body.pop("checksum", None)
    if not isinstance(expected, str):
        raise CorruptCheckpointError(f"{what} has no checksum")
    check = manifest_mac.verifier(body, expected, key, what)  # xxh3, or an encrypted checkpoint's MAC
    prefix = b'{"checksum":' + json.dumps(expected).encode() + b","
    if raw.startswith(prefix):  # as every writer lays it out: the checksum covers the bytes after it
        check(b"{" + raw[len(prefix) :].rstrip(b"\n"))
    elif not reformatted:
        raise CorruptCheckpointError(f"{what} does not begin with its checksum")
    else:  # re-indented or re-ordered by hand or by a tool: Python's canonical form (docs/format.md §5.1, MAY)
        try:
            canonical = _dumps(body).encode()
        except ValueError as e:  # non-finite floats smuggled in
            raise CorruptCheckpointError(f"{what}: {e}") from None
        try:
            check(canonical)  # as trainstate wrote it before the line layout (and as one line)
        except CorruptCheckpointError:
            if type(body.get("tensors")) is not dict:
                raise
            check(manifest_lines.canonical_lines(body))  # as it writes it now (docs/format.md §3.1)


def _claims_newer(version: object) -> bool:
    return (
        isinstance(version, str)
        and re.fullmatch(r"\d{1,6}\.\d{1,6}", version) is not None
        and int(version.split(".")[0]) > int(FORMAT_VERSION.split(".")[0])
    )


_MALFORMED = (KeyError, TypeError, ValueError, AttributeError, OverflowError, IndexError)


class malformed:
    """Turn the errors a lying manifest provokes while being read into CorruptCheckpointError."""

    def __init__(self, what: str) -> None:
        self.what = what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: object) -> None:
        if kind is not None and issubclass(kind, _MALFORMED) and not isinstance(error, CorruptCheckpointError):
            raise CorruptCheckpointError(f"{self.what} is malformed: {kind.__name__}: {error}") from None


def _check_version(version: object, what: str) -> None:
    if not isinstance(version, str) or not re.fullmatch(r"\d{1,6}\.\d{1,6}", version):
        raise CorruptCheckpointError(f"{what}: bad format_version {version!r}")
    if int(version.split(".")[0]) != int(FORMAT_VERSION.split(".")[0]):
        raise FormatVersionError(
            f"{what} has format_version {version}; this trainstate reads {FORMAT_VERSION.split('.')[0]}.x — "
            "upgrade trainstate to read it"
        )


_KNOWN_FIELDS = {"format", "format_version", "created", "writer", "metadata", "files", "tensors", "tree", "world_size"}
_KNOWN_FIELDS.add(manifest_mac.FIELD)  # checked with the checksum, before _build


def _build(body: dict[str, Any], what: str = "manifest") -> Manifest:
    fields = head(body)
    raw_tensors = _typed(body["tensors"], dict, "tensors")
    _check_byte_ranges(raw_tensors)
    tensors = _LazyTensors(raw_tensors, sizes(fields["files"]), fields["encrypted"])
    return Manifest(
        tree=_tree.parse(body["tree"], raw_tensors, f"{what} tree"),
        tensors=tensors,
        metadata=_tree.parse(body["metadata"], None, f"{what} metadata"),
        **fields,
    )


def head(body: dict[str, Any]) -> dict[str, Any]:
    """The manifest's fields other than tree, tensors and metadata, checked: what it says about its files,
    its writer and its version (the header of ``manifest_lines.py``'s layout holds them all)."""
    files = tuple(_file_entry(f) for f in _typed(body["files"], list, "files"))
    if len(sizes(files)) != len(files):
        raise CorruptCheckpointError("manifest lists a data file twice")
    created = body["created"]
    if isinstance(created, bool) or not isinstance(created, (int, float)) or not math.isfinite(created):
        raise CorruptCheckpointError(f"manifest 'created' is not a finite number: {created!r:.40}")
    return {
        "files": files,
        "created": float(created),
        "writer": _typed(body["writer"], str, "writer"),
        "format_version": body["format_version"],
        "extra": {k: v for k, v in body.items() if k not in _KNOWN_FIELDS},
        "world_size": _world_size(body.get("world_size", 1)),
        "encrypted": manifest_mac.FIELD in body,
    }


def sizes(files: tuple[FileEntry, ...]) -> dict[str, int]:
    return {f.path: f.size for f in files}


def _world_size(value: Any) -> int:
    """The number of ranks that saved the checkpoint: a positive integer (absent: 1, one process)."""
    if type(value) is not int or not 1 <= value <= MAX_WORLD_SIZE:
        raise CorruptCheckpointError(f"manifest field world_size should be a positive integer, found {value!r:.40}")
    return value


class _LazyTensors(Mapping[str, TensorEntry]):
    """Tensor entries validated when first looked up, so open() costs the same for 10 or 10,000 tensors.

    Every read looks its entry up here first, so nothing is read from a file before its entry passed.
    """

    def __init__(self, raw: dict[str, Any], sizes: dict[str, int], encrypted: bool = False) -> None:
        self._raw = raw
        self._sizes = sizes
        self._encrypted = encrypted
        self._done: dict[str, TensorEntry] = {}

    def __getitem__(self, name: str) -> TensorEntry:
        entry = self._done.get(name)
        if entry is None:
            raw = self._raw[name]  # KeyError for a name that is not listed: the caller's mistake
            with malformed(f"tensor {name!r:.80} in the manifest"):
                entry = self._done[name] = tensor_entry(name, raw, self._sizes, self._encrypted)
        return entry

    def __iter__(self) -> Iterator[str]:
        return iter(self._raw)

    def __len__(self) -> int:
        return len(self._raw)

    def __contains__(self, name: object) -> bool:
        return name in self._raw


def _typed(value: Any, kind: type, what: str) -> Any:
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise CorruptCheckpointError(f"manifest field {what} should be {kind.__name__}, found {value!r:.80}")
    return value


_JUST_INT = frozenset({int})


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if type(value) is list and _JUST_INT.issuperset(map(type, value)) and min(value, default=0) >= 0:
        return tuple(value)  # the common case, checked at C speed: thousands of these per manifest
    items = tuple(_typed(v, int, what) for v in _typed(value, list, what))
    if any(v < 0 for v in items):
        raise CorruptCheckpointError(f"manifest field {what} has a negative entry: {list(items)}")
    return items


MAX_RANK = 32
MAX_WORLD_SIZE = 1 << 24
MAX_DIM = 1 << 48


def shape_refused(shape: tuple[int, ...]) -> str | None:
    """Why a reader refuses a tensor of ``shape`` (one NumPy and torch cannot allocate), or None: writers
    refuse the same shapes, so that nothing is saved that cannot load."""
    if len(shape) > MAX_RANK:
        return f"{len(shape)} dimensions (a manifest holds at most {MAX_RANK})"
    if max(shape, default=0) >= MAX_DIM:
        return "a dimension of 2**48 or more"
    if math.prod(filter(None, shape)) >= MAX_DIM:
        return "too many elements (2**48 or more)"
    return None


def _shape(value: Any, what: str) -> tuple[int, ...]:
    """A shape NumPy and torch can allocate: bounded rank, dimensions and element count."""
    shape = _ints(value, what)
    refused = shape_refused(shape)
    if refused is not None:
        raise CorruptCheckpointError(f"manifest field {what} is not a plausible shape ({refused}): {list(shape)[:8]}")
    return shape


def _check_byte_ranges(raw_tensors: dict[str, Any]) -> None:
    """No two stored chunks may share bytes, so the tensors can never add up to more than the files hold.

    A cheap pass over the raw entries (the full per-tensor checks run when a tensor is first used): the
    ranges are gathered with comprehensions and compared, sorted by file and offset, with NumPy.
    """
    lists = [t.get("chunks") if type(t) is dict else None for t in raw_tensors.values()]
    chunks = [c for cs in lists if type(cs) is list for c in cs if type(c) is dict]
    found = [(c.get("file"), c.get("byte_range")) for c in chunks]
    spans = [
        (f if type(f) is str else str(f), r[0], r[1])
        for f, r in found
        if type(r) is list and len(r) == 2 and type(r[0]) is int and type(r[1]) is int and r[0] < r[1]
    ]
    if len(spans) < 2:
        return
    ids: dict[str, int] = {}
    file = np.array([ids.setdefault(f, len(ids)) for f, _, _ in spans], dtype=np.int64)
    try:
        begin = np.array([b for _, b, _ in spans], dtype=np.int64)
        end = np.array([e for _, _, e in spans], dtype=np.int64)
    except OverflowError:  # offsets past int64: no file is that large (the full check says which)
        return
    order = np.lexsort((begin, file))
    file, begin, end = file[order], begin[order], end[order]
    shared = np.flatnonzero((file[1:] == file[:-1]) & (begin[1:] < end[:-1]))
    if len(shared):
        names = list(ids)
        raise CorruptCheckpointError(
            f"manifest: two chunks share bytes of {names[int(file[shared[0] + 1])]} (at byte {begin[shared[0] + 1]})"
        )


def check_file_name(name: Any) -> str:
    """A data file name must be a plain name inside the checkpoint: no separators, no '..', no hidden files."""
    if not isinstance(name, str) or not _FILE_NAME.fullmatch(name) or name == MANIFEST_NAME:
        raise CorruptCheckpointError(f"manifest names an illegal data file {name!r:.80}")
    return name


def _file_entry(f: Any) -> FileEntry:
    f = _typed(f, dict, "files[]")
    return FileEntry(
        path=check_file_name(f["path"]),
        size=_ints([f["size"]], "size")[0],
        header_checksum=_typed(f["header_checksum"], str, "header_checksum"),
        pool=_typed(f.get("pool", False), bool, "files[].pool"),
        new=_typed(f.get("new", False), bool, "files[].new"),
    )


_KINDS = frozenset({"torch", "numpy", "numpy-scalar"})


def tensor_entry(name: str, t: Any, sizes: dict[str, int], encrypted: bool = False) -> TensorEntry:
    """Tensor ``name``'s entry, checked; ``encrypted``: the manifest is an encrypted checkpoint's, whose
    writer encrypts every chunk last, so a chunk stored otherwise is refused."""
    entry = None
    if type(t) is dict:
        chunks = t.get("chunks")
        entry = _sharded_entry(t, sizes) if type(chunks) is list and len(chunks) > 1 else _plain_entry(t, sizes)
    if entry is None:
        entry = _checked_entry(name, t, sizes)
    if encrypted and any(
        not c.transforms or c.transforms[-1].get("name") != manifest_mac.ALGORITHM for c in entry.chunks
    ):
        raise CorruptCheckpointError(
            f"tensor {name}: a chunk of this encrypted checkpoint is not encrypted ({manifest_mac.ALGORITHM} is "
            "not its last transform), though its manifest is authenticated with the key: a writer that broke "
            "the rule that every chunk is encrypted saved it (a collective save whose ranks held different keys, "
            "before trainstate compared them). Restore another checkpoint"
        )
    return entry


def _checked_entry(name: str, t: Any, sizes: dict[str, int]) -> TensorEntry:
    t = _typed(t, dict, f"tensors[{name}]")
    dtype = dtypes.from_code(t["dtype"])
    shape = _shape(t["shape"], f"{name}.shape")
    kind = t["kind"]
    if type(kind) is not str or kind not in _KINDS:
        raise CorruptCheckpointError(f"tensor {name}: unknown kind {kind!r:.40}")
    chunks = tuple(_chunk(name, c, dtype, shape, sizes) for c in _typed(t["chunks"], list, f"{name}.chunks"))
    covered = 0
    for c in chunks:
        covered += math.prod(c.shape)
    if covered != math.prod(shape):
        raise CorruptCheckpointError(f"tensor {name}: its chunks do not cover shape {list(shape)}")
    _check_disjoint(name, chunks)
    return TensorEntry(dtype=dtype.code, shape=shape, kind=kind, chunks=chunks)


_PLAIN_CHUNK = frozenset({"file", "byte_range", "offset", "shape", "checksum"})
_PIECED_CHUNK = _PLAIN_CHUNK | {"pieces"}


def _plain_entry(t: dict[str, Any], sizes: dict[str, int]) -> TensorEntry | None:
    """The common entry (one chunk covering a non-empty tensor, no transforms) checked in a few C-speed
    steps, or None for the general path, which gives the precise error for anything wrong.

    Checks exactly what the general path does for such an entry: a known dtype and kind, a plausible shape,
    a chunk at offset 0 of the same shape, in a listed file, holding exactly the tensor's bytes.
    """
    chunks = t.get("chunks")
    if type(chunks) is not list or len(chunks) != 1 or len(t) != 4:
        return None
    c = chunks[0]
    if type(c) is not dict or (c.keys() != _PLAIN_CHUNK and c.keys() != _PIECED_CHUNK):
        return None
    dtype, kind, shape = dtypes.BY_CODE.get(t.get("dtype")), t.get("kind"), t.get("shape")  # type: ignore[arg-type]
    file, byte_range, offset, checksum_ = c["file"], c["byte_range"], c["offset"], c["checksum"]
    if (
        dtype is None
        or type(kind) is not str
        or kind not in _KINDS
        or type(shape) is not list
        or c["shape"] != shape
        or type(byte_range) is not list
        or type(offset) is not list
        or type(checksum_) is not str
        or type(file) is not str
    ):
        return None
    size = sizes.get(file)
    if (
        size is None
        or not _JUST_INT.issuperset(map(type, shape + c["shape"] + offset + byte_range))
        or len(shape) > MAX_RANK
        or len(byte_range) != 2
        or offset != [0] * len(shape)
        or min(shape, default=1) <= 0
        or max(shape, default=0) >= MAX_DIM
    ):
        return None
    count = math.prod(shape)
    begin, end = byte_range
    if count >= MAX_DIM or not 0 <= begin <= end <= size or end - begin != count * dtype.itemsize:
        return None
    pieces = None
    if "pieces" in c:
        raw = c["pieces"]
        size, sums = (raw.get("bytes"), raw.get("checksums")) if type(raw) is dict and len(raw) == 2 else (0, None)
        if type(size) is not int or size <= 0 or type(sums) is not list or len(sums) != -(-(end - begin) // size):
            return None
        if not {str}.issuperset(map(type, sums)):
            return None
        pieces = Pieces(size, tuple(sums))
    dims = tuple(shape)
    return TensorEntry(dtype.code, dims, kind, (Chunk(file, (begin, end), tuple(offset), dims, checksum_, (), pieces),))


def _sharded_entry(t: dict[str, Any], sizes: dict[str, int]) -> TensorEntry | None:
    """An entry of many chunks (a tensor sharded over ranks: one per rank) checked a column at a time, or
    None for the general path, which gives the precise error for anything wrong.

    Checks exactly what the general path does: a known dtype and kind, a plausible shape, and chunks with
    the plain members (pieces allowed), in listed files, each box inside the tensor holding exactly its
    bytes, the boxes covering the tensor without overlap. Per chunk only comprehensions run in Python
    (about a microsecond each, not the general path's tens): a manifest of 1,024 ranks' shards has a
    million chunks.
    """
    dtype, kind, shape, chunks = dtypes.BY_CODE.get(t.get("dtype")), t.get("kind"), t.get("shape"), t.get("chunks")  # type: ignore[arg-type]
    if dtype is None or type(kind) is not str or kind not in _KINDS or type(shape) is not list or len(t) != 4:
        return None
    if type(chunks) is not list or not {dict}.issuperset(map(type, chunks)):
        return None
    d = len(shape)
    try:
        lengths = set(map(len, chunks))
        files = [c["file"] for c in chunks]
        ranges = [c["byte_range"] for c in chunks]
        offsets = [c["offset"] for c in chunks]
        shapes = [c["shape"] for c in chunks]
        sums = [c["checksum"] for c in chunks]
    except KeyError:
        return None
    pieced = [i for i, c in enumerate(chunks) if len(c) != 5] if lengths != {5} else []
    if not lengths <= {5, 6} or not all("pieces" in chunks[i] for i in pieced):
        return None
    if not ({str}.issuperset(map(type, files)) and {str}.issuperset(map(type, sums))):
        return None
    lists = [*ranges, *offsets, *shapes, shape]
    if not {list}.issuperset(map(type, lists)) or set(map(len, ranges)) != {2}:
        return None
    if set(map(len, offsets)) | set(map(len, shapes)) != {d} or d > MAX_RANK:
        return None
    flat = list(chain.from_iterable(lists))
    if not _JUST_INT.issuperset(map(type, flat)) or min(flat, default=0) < 0 or max(flat, default=0) >= MAX_DIM:
        return None  # (also keeps every number inside int64)
    whole = math.prod(shape)
    sized = list(map(sizes.get, files))
    if math.prod(filter(None, shape)) >= MAX_DIM or None in sized:
        return None
    n = len(chunks)
    rng = np.array(ranges, dtype=np.int64).reshape(n, 2)
    off = np.array(offsets, dtype=np.int64).reshape(n, d)
    ext = np.array(shapes, dtype=np.int64).reshape(n, d)
    bound = np.array(shape, dtype=np.int64)
    volume = np.prod(ext, axis=1, dtype=np.int64)
    if (
        (rng[:, 0] > rng[:, 1]).any()
        or (rng[:, 1] > np.array(sized, dtype=np.int64)).any()
        or (off + ext > bound).any()
        or (rng[:, 1] - rng[:, 0] != volume * dtype.itemsize).any()
        or int(volume.sum()) != whole
        or (d and _boxes_overlap(off, ext))
    ):
        return None
    pieces: dict[int, Pieces] = {}
    for i in pieced:
        raw = chunks[i]["pieces"]
        size, sums_ = (raw.get("bytes"), raw.get("checksums")) if type(raw) is dict and len(raw) == 2 else (0, None)
        stored = ranges[i][1] - ranges[i][0]
        if type(size) is not int or size <= 0 or type(sums_) is not list or len(sums_) != -(-stored // size):
            return None
        if not {str}.issuperset(map(type, sums_)):
            return None
        pieces[i] = Pieces(size, tuple(sums_))
    get = pieces.get
    out = tuple(
        _checked_chunk(f, (r[0], r[1]), tuple(o), tuple(e), c, get(i))
        for i, (f, r, o, e, c) in enumerate(zip(files, ranges, offsets, shapes, sums))
    )
    return TensorEntry(dtype.code, tuple(shape), kind, out)


_new = object.__new__


def _checked_chunk(
    file: str, byte_range: tuple[int, int], offset: tuple[int, ...], shape: tuple[int, ...], sum_: str, pieces: Any
) -> Chunk:
    """A Chunk without transforms whose fields were checked: built without the frozen dataclass's
    ``__init__`` (an ``object.__setattr__`` per field), a third of the cost, for a million of them."""
    chunk = _new(Chunk)
    chunk.__dict__.update(
        file=file, byte_range=byte_range, offset=offset, shape=shape, checksum=sum_, transforms=(), pieces=pieces
    )
    return chunk


def _boxes_overlap(off: np.ndarray, ext: np.ndarray) -> bool:
    """Whether two non-empty boxes share an element: sorted neighbours for slabs (boxes that differ along
    one dimension: every FSDP, row or column shard), the sweep of :func:`_check_disjoint` otherwise."""
    keep = (ext > 0).all(axis=1)
    off, ext = off[keep], ext[keep]
    if len(off) < 2:
        return False
    varying = np.flatnonzero((off != off[0]).any(axis=0) | (ext != ext[0]).any(axis=0))
    if len(varying) > 1:
        boxes = tuple(Chunk("", (0, 0), tuple(o), tuple(e), "") for o, e in zip(off.tolist(), ext.tolist()))
        try:
            _check_disjoint("", boxes)
        except CorruptCheckpointError:
            return True
        return False
    a = int(varying[0]) if len(varying) else 0
    order = np.argsort(off[:, a], kind="stable")
    return bool((off[order[1:], a] < off[order[:-1], a] + ext[order[:-1], a]).any())


def _chunk(name: str, c: Any, dtype: dtypes.DType, shape: tuple[int, ...], sizes: dict[str, int]) -> Chunk:
    c = _typed(c, dict, f"{name}.chunks[]")
    file = c["file"]
    if type(file) is not str or file not in sizes:  # listed names were checked when the files were read
        check_file_name(file)
        raise CorruptCheckpointError(f"tensor {name}: chunk in {file!r}, which the manifest does not list")
    byte_range = _ints(c["byte_range"], f"{name}.byte_range")
    if len(byte_range) != 2 or not byte_range[0] <= byte_range[1] <= sizes[file]:
        raise CorruptCheckpointError(
            f"tensor {name}: byte range {list(byte_range)} lies outside {file} ({sizes[file]} bytes)"
        )
    begin, end = byte_range
    offset = _ints(c["offset"], f"{name}.offset")
    cshape = _shape(c["shape"], f"{name}.chunk.shape")
    if len(offset) != len(shape) or len(cshape) != len(shape):
        raise CorruptCheckpointError(f"tensor {name}: chunk rank does not match the tensor's rank {len(shape)}")
    if any(o + s > n for o, s, n in zip(offset, cshape, shape)):
        raise CorruptCheckpointError(f"tensor {name}: chunk at {list(offset)} of {list(cshape)} exceeds {list(shape)}")
    transforms: tuple[dict[str, Any], ...] = ()
    if "transforms" in c:
        listed = _typed(c["transforms"], list, f"{name}.transforms")
        transforms = tuple(_typed(x, dict, f"{name}.transforms[]") for x in listed)
    for x in transforms:
        if not _transforms.known(x.get("name")):
            raise FormatVersionError(
                f"tensor {name} uses byte transform {x.get('name')!r:.40}, which this trainstate does not know: "
                "upgrade trainstate to read it"
            )
    raw = math.prod(cshape) * dtype.itemsize
    if transforms and raw > (end - begin) * _transforms.MAX_EXPANSION:  # no transform expands bytes that far
        raise CorruptCheckpointError(
            f"tensor {name}: a transformed chunk of {end - begin} stored bytes claims {raw} raw bytes, more than "
            f"{_transforms.MAX_EXPANSION} per stored byte"
        )
    if not transforms and end - begin != raw:
        raise CorruptCheckpointError(
            f"tensor {name}: {end - begin} stored bytes do not hold {list(cshape)} × {dtype.code} "
            f"({math.prod(cshape) * dtype.itemsize} bytes)"
        )
    pieces = _pieces(name, c["pieces"], end - begin) if "pieces" in c else None
    checksum_ = c["checksum"]
    if type(checksum_) is not str:
        _typed(checksum_, str, "checksum")
    return Chunk(file, (begin, end), offset, cshape, checksum_, transforms, pieces)


def _pieces(name: str, raw: Any, stored: int) -> Pieces:
    """Per-piece checksums: ``bytes`` a positive piece size, one checksum per piece of the stored bytes."""
    raw = _typed(raw, dict, f"{name}.pieces")
    size = _typed(raw["bytes"], int, f"{name}.pieces.bytes")
    sums = _typed(raw["checksums"], list, f"{name}.pieces.checksums")
    if size <= 0 or len(sums) != -(-stored // size):
        raise CorruptCheckpointError(
            f"tensor {name}: {len(sums)} piece checksums of {size} bytes do not cover its {stored} stored bytes"
        )
    if not {str}.issuperset(map(type, sums)):
        raise CorruptCheckpointError(f"tensor {name}: a piece checksum is not a string")
    return Pieces(size, tuple(sums))


def _check_disjoint(name: str, chunks: tuple[Chunk, ...]) -> None:
    """Boxes must not overlap (their volumes already add up to the tensor's, so disjoint boxes tile it)."""
    found = boxes.overlap([(c.offset, c.shape) for c in chunks], DISJOINT_COMPARISONS)
    if found == "overlap":
        raise CorruptCheckpointError(f"tensor {name}: chunks overlap")
    if found == "irregular":
        raise CorruptCheckpointError(
            f"tensor {name}: its {len(chunks)} chunks are laid out too irregularly to check that they do not "
            "overlap (no writer lays out chunks so)"
        )


DISJOINT_COMPARISONS = boxes.COMPARISONS  # what _check_disjoint compares of a layout that is no grid
