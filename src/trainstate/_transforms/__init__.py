"""Chunk transforms: reversible byte-to-byte functions (compression, encryption) applied to a chunk's bytes.

A chunk's manifest entry may list ``transforms`` (docs/format.md §5b): the objects that say how its raw bytes
(the box's elements, C order, little-endian) became its stored bytes. Both sides live here so they agree:

- write side, a :class:`Pipeline`: the ordered transforms of one save (compression first, then encryption).
  It turns each chunk's raw bytes into stored bytes plus the manifest objects, and computes the raw bytes'
  checksum on the way (:class:`Encoded`), which incremental saves use to find unchanged tensors;
- read side, :class:`Decoders`: undoes a chunk's transforms in reverse order, finding each by the name the
  manifest gives in :data:`REGISTRY` (name -> factory, imported only when a checkpoint uses the name, so an
  optional dependency is needed only to read what needs it). It carries the reader's key material as one
  opaque value, handed to every factory.

A name the registry lacks is a :class:`FormatVersionError` naming it (the manifest parser refuses it when
the tensor is first used), never damage: a newer trainstate wrote it.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from trainstate import _checksum as checksum
from trainstate._transforms.base import Place as Place  # re-exported: the transforms' vocabulary
from trainstate._transforms.base import Transform as Transform
from trainstate.errors import CheckpointError, CorruptCheckpointError, FormatVersionError

TRANSFORM_CHUNK_BYTES = 4 << 20  # a tensor is cut into chunks of at most this many raw bytes when transformed
MAX_GROWTH = 4096  # the most bytes a pipeline may add to one chunk (encryption: a nonce and a tag)
MAX_EXPANSION = 1 << 15  # raw bytes a transformed chunk may claim per stored byte (zstd's most: RLE blocks)

# name -> "module:factory". A factory takes the reader's key material (opaque; None when none was given)
# and returns the Transform that decodes chunks of that name; it is imported at the first chunk that needs it.
REGISTRY: dict[str, str] = {
    "zstd": "trainstate._transforms.zstd:decoder",
    "aes-256-gcm": "trainstate._transforms.aes_gcm:AesGcm",
}


def known(name: object) -> bool:
    """Whether this trainstate can decode chunks transformed by ``name``."""
    return isinstance(name, str) and name in REGISTRY


class Encoded(NamedTuple):
    """One chunk through a :class:`Pipeline`: its stored bytes, the manifest objects of the transforms
    applied (empty: stored as raw), and the checksum of its raw bytes."""

    stored: bytes | memoryview
    transforms: tuple[dict[str, Any], ...]
    raw_checksum: str


class Pipeline:
    """The transforms of one save, applied in order to each chunk (compression first, then encryption).

    A transform may decline a chunk (its ``encode`` returns None); the chunk then goes on unchanged. The
    checksum of the raw bytes is recorded in the params of the one transform applied when that transform
    asks for it (``records_raw_checksum``, zstd: a reader then checks what it decompressed) and no other
    transform was applied: never beside encryption, where it would reveal the plaintext.

    Example:
        >>> Pipeline([compression("zstd:3")]).encode(memoryview(raw), Place("w", "F32", (0,), (1024,)))
    """

    def __init__(self, transforms: Sequence[Transform], chunk_bytes: int | None = None) -> None:
        self.transforms = tuple(transforms)
        self.chunk_bytes = TRANSFORM_CHUNK_BYTES if chunk_bytes is None else chunk_bytes

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.transforms)

    def stored_bound(self, raw_nbytes: int) -> int:
        """The most stored bytes a chunk of ``raw_nbytes`` raw bytes may become (writers reserve by it)."""
        return raw_nbytes + MAX_GROWTH

    def encode(self, raw: memoryview, place: Place) -> Encoded:
        raw_sum = checksum.digest(raw)
        data: bytes | memoryview = raw
        applied: list[tuple[Transform, dict[str, Any]]] = []
        for t in self.transforms:
            out = t.encode(data if isinstance(data, memoryview) else memoryview(data), place)
            if out is not None:
                data, params = out
                applied.append((t, {**params, "name": t.name}))
        if len(applied) == 1 and getattr(applied[0][0], "records_raw_checksum", False):
            applied[0][1]["raw_checksum"] = raw_sum
        stored = data.nbytes if isinstance(data, memoryview) else len(data)
        if stored > self.stored_bound(raw.nbytes):
            raise RuntimeError(
                f"transforms {[p['name'] for _, p in applied]} made {stored} bytes of {raw.nbytes} for {place.tensor}, "
                f"more than the {MAX_GROWTH} extra bytes a chunk may grow by"
            )
        return Encoded(data, tuple(p for _, p in applied), raw_sum)


def pipeline(*transforms: Transform | None) -> Pipeline | None:
    """The pipeline of the transforms given (None ones left out); None when there are none, so a save
    without transforms takes the plain path."""
    chosen = [t for t in transforms if t is not None]
    return Pipeline(chosen) if chosen else None


class Decoders:
    """The read side: name -> Transform, built from the reader's key material (one opaque value).

    Each name is looked up in :data:`REGISTRY` and its factory called once, at the first chunk that uses it
    (so an optional dependency is imported only by a checkpoint that needs it). Thread-safe.

    Example:
        >>> raw = Decoders(key).decode(chunk.transforms, stored, place, raw_nbytes)
    """

    def __init__(self, key: Any = None) -> None:
        self.key = key
        self._made: dict[str, Transform] = {}
        self._lock = threading.Lock()

    def get(self, name: object) -> Transform:
        """The transform that decodes ``name``; FormatVersionError if this trainstate does not know it."""
        if not isinstance(name, str) or name not in REGISTRY:
            raise FormatVersionError(
                f"a chunk uses byte transform {name!r:.40}, which this trainstate does not know: it was written by "
                "a newer trainstate; upgrade trainstate to read it"
            )
        made = self._made.get(name)
        if made is None:
            with self._lock:
                made = self._made.get(name)
                if made is None:
                    made = self._made[name] = _factory(REGISTRY[name])(self.key)
        return made

    def decode(
        self,
        transforms: Sequence[Mapping[str, Any]],
        stored: memoryview,
        place: Place,
        raw_nbytes: int,
        *,
        verify: bool = True,
        what: str = "",
    ) -> bytes | bytearray | memoryview:
        """A chunk's raw bytes from its (checked) stored bytes: its transforms undone in reverse order.

        Raises:
            CorruptCheckpointError: the bytes do not decode, decode to the wrong size, or (``verify``) fail
                the raw checksum the manifest records.
            FormatVersionError: a transform this trainstate does not know.
        """
        what = what or f"tensor {place.tensor} chunk at {list(place.offset)}"
        data: bytes | bytearray | memoryview = stored
        try:
            for params in reversed(transforms):
                t = self.get(params.get("name"))
                data = t.decode(data if isinstance(data, memoryview) else memoryview(data), params, place, raw_nbytes)
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - a library's own error on bytes that passed their checksum
            raise CorruptCheckpointError(f"{what}: its stored bytes do not decode ({type(e).__name__}: {e})") from e
        found = data.nbytes if isinstance(data, memoryview) else len(data)
        if found != raw_nbytes:
            raise CorruptCheckpointError(f"{what} decodes to {found} bytes, its box holds {raw_nbytes}")
        expected = transforms[0].get("raw_checksum") if transforms else None
        if verify and expected is not None:
            if not isinstance(expected, str):
                raise CorruptCheckpointError(f"{what}: its raw_checksum is not a string: {expected!r:.40}")
            checksum.check(data if not isinstance(data, bytearray) else memoryview(data), expected, f"{what}, decoded")
        return data


def raw_checksum(chunk: Any) -> str | None:
    """The checksum of a chunk's raw bytes where it is known, else None: its ``checksum`` when it has no
    transforms, what the writer computed (``Chunk.raw_checksum``, kept in memory, never written for an
    encrypted chunk), or the ``raw_checksum`` a compressed-only chunk records in its params."""
    if not chunk.transforms:
        return str(chunk.checksum)
    if chunk.raw_checksum is not None:
        return str(chunk.raw_checksum)
    recorded = chunk.transforms[0].get("raw_checksum") if len(chunk.transforms) == 1 else None
    return recorded if isinstance(recorded, str) else None


def _factory(target: str) -> Callable[[Any], Transform]:
    module, _, attr = target.partition(":")
    made: Callable[[Any], Transform] = getattr(importlib.import_module(module), attr)
    return made


def compression(spec: object) -> Transform | None:
    """The compression transform ``compression=`` asks for: None / ``"zstd"`` / ``"zstd:LEVEL"``.

    Raises:
        InvalidArgumentError: anything else.
        MissingDependencyError: zstandard is not installed.
    """
    from trainstate._transforms.zstd import parse

    return parse(spec)


def encrypting(pipeline: Pipeline | None, key: Any) -> Pipeline | None:
    """``pipeline`` made to end with encryption under ``key`` (a resolved key; None: left as it is): every
    writer that authenticates a manifest with a key must also encrypt its chunks."""
    if key is None or (pipeline is not None and "aes-256-gcm" in pipeline.names):
        return pipeline
    from trainstate._transforms.aes_gcm import AesGcm

    return Pipeline([*(pipeline.transforms if pipeline is not None else ()), AesGcm(key)])
