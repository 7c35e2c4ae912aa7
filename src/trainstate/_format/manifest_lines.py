"""The manifest's canonical text in its line layout: each tensor entry on a line of its own, so one entry
is found without parsing the rest (docs/format.md §3.1). The writer (``manifest.py``) and the checksum's
re-formatted rule (§5.1) both take the text from here; :func:`split` and :meth:`Lines.find` read it back.

A manifest is one JSON document, and JSON allows whitespace between tokens; a JSON string cannot hold a raw
line feed, so every LF in a manifest is structure. trainstate's writer starts the three members that grow
with the state (``metadata``, ``tensors``, ``tree``) on lines of their own, and puts each member of
``tensors`` on its own line, in the canonical (sorted) order::

    {"checksum":"…","created":…,"files":[…],"format":"trainstate","format_version":"1.0",
    "metadata":null,
    "tensors":{
    "model.a":{"chunks":[…],"dtype":"F32","kind":"torch","shape":[2]},
    "model.b":{…}
    },
    "tree":{…},
    "writer":"trainstate 0.1.0"}

Opening a checkpoint to read one tensor then costs the header (the first and last lines) and a binary
search over the tensor lines: a few keys decoded, one entry parsed (``lazy_manifest.py``), not the whole
manifest, which for a large model is mostly those lines and the tree. :func:`split` finds the layout only
where it is exactly this; anything else (an older trainstate's manifest, one re-indented by hand) is left
to the full parse. Nothing here validates an entry: it finds the raw JSON of one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from json.decoder import scanstring  # type: ignore[attr-defined]  # C, in every CPython; typeshed omits it
from json.encoder import encode_basestring_ascii
from typing import Any

OWN_LINES = frozenset({"metadata", "tensors", "tree"})  # top-level members the writer starts on a new line

_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
_DECODER = json.JSONDecoder()

# The writer's bytes around the tensor lines, as a reader looks for them.
_METADATA = b'\n"metadata":'
_TENSORS = b'\n"tensors":{\n'
_TREE = b'\n},\n"tree":'
# What the header holds in their place: the header parses as a manifest whose big members are empty.
_PLACEHOLDERS = b'\n"metadata":null,\n"tensors":{},\n"tree":null,'

MISSING = object()  # find(): no such line, or lines that are not the layout (the full parse decides)


def dumps(value: Any) -> str:
    """The canonical JSON of a value (docs/format.md §3): sorted keys, no whitespace, ASCII, no NaN."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def canonical_parts(
    body: dict[str, Any], texts: Mapping[str, str | list[bytes] | list[bytes | memoryview]]
) -> list[bytes | memoryview]:
    """The canonical JSON of a manifest ``body`` plus the fields in ``texts`` (canonical JSON text already,
    or its parts; ``tensors`` laid out in lines already), in parts to be joined: ``b"{"``, then each
    member, with a line feed before and after each member of :data:`OWN_LINES`."""
    fields: dict[str, list[bytes | memoryview]] = {k: [dumps(v).encode()] for k, v in body.items() if k not in texts}
    fields.update({k: list(v) if isinstance(v, list) else [v.encode()] for k, v in texts.items()})
    out: list[bytes | memoryview] = [b"{"]
    previous = ""
    for i, k in enumerate(sorted(fields)):
        comma = b"," if i else b""
        out += [comma + b"\n" if k in OWN_LINES or previous in OWN_LINES else comma, dumps(k).encode(), b":"]
        out += fields[k]
        previous = k
    return [*out, b"}"]


def canonical_lines(body: dict[str, Any]) -> bytes:
    """The canonical JSON of a manifest ``body`` (its ``tensors`` an object) in the line layout: what a
    manifest re-formatted by a tool was, if its content is unchanged (docs/format.md §5.1)."""
    return b"".join(canonical_parts(body, {"tensors": tensor_lines(body["tensors"])}))


def tensor_lines(entries: dict[str, Any]) -> list[bytes]:
    """The ``tensors`` object as JSON text in parts: one line per entry, sorted by name (as ``sort_keys``
    sorts, so its meaning is the canonical JSON's); ``{}`` when there is none."""
    if not entries:
        return [b"{}"]
    # One json.dumps of them all (a C call; one per entry costs 1.5x as much), cut where each member begins:
    # a comma outside any string, so a cut anywhere else would still be whitespace in the same JSON.
    names = sorted(entries)
    text = dumps(entries)
    cuts, at = [1], 1
    for name in names[1:]:
        at = text.find("," + encode_basestring_ascii(name) + ':{"chunks":', at)  # every writer's entry
        if at < 0:  # not an entry as the writer makes them (a re-formatted manifest's, §5.1): one at a time
            encode = _ENCODER.encode
            lines = [encode_basestring_ascii(name) + ":" + encode(entries[name]) for name in names]
            return [b"{\n", ",\n".join(lines).encode(), b"\n}"]
        cuts.append(at + 1)
    cuts.append(len(text))
    pieces = [text[begin:end] for begin, end in zip(cuts, cuts[1:])]  # each but the last ends with its comma
    pieces[-1] = pieces[-1][:-1]  # the object's "}"
    return [b"{\n", "\n".join(pieces).encode(), b"\n}"]


@dataclass(frozen=True)
class Lines:
    """A manifest in the line layout: its header, and where its tensor lines are.

    ``header`` is the manifest with the values of ``metadata``, ``tensors`` and ``tree`` replaced by
    ``null``, ``{}`` and ``null`` (valid JSON when the layout is the writer's). The tensor lines are
    ``raw[first:end]``, each ended by an LF (``raw[end]`` is the last one's); each is checked only when a
    lookup reads it.
    """

    raw: bytes | bytearray
    header: bytes
    first: int
    end: int

    def find(self, name: str) -> Any:
        """The raw JSON value of tensor ``name``'s line, or :data:`MISSING` when no line has that key or
        the lines around it are not the layout (a line that is not one ``"key":value`` member, a
        neighbour with the same key): the caller then asks the full parse, which keeps the last of two
        members with one name (as ``json.loads`` does)."""
        raw, lo, hi = self.raw, self.first, self.end
        while lo < hi:  # the lines starting in [lo, hi) may hold it; raw[hi] ends a line
            mid = (lo + hi) // 2
            start = raw.rfind(b"\n", lo - 1, mid) + 1  # of the line holding byte mid
            stop = raw.find(b"\n", mid, hi + 1)
            member = _member(raw[start:stop])
            if member is None:
                return MISSING
            key, text, at = member
            if name < key:
                hi = start - 1
            elif name > key:
                lo = stop + 1
            else:
                return self._value(name, text, at, start, stop)
        return MISSING

    def _value(self, name: str, text: str, at: int, start: int, stop: int) -> Any:
        raw = self.raw
        if start > self.first:  # sorted lines put a second member of the same name next to this one
            before = _member(raw[raw.rfind(b"\n", self.first - 1, start - 1) + 1 : start - 1])
            if before is None or before[0] == name:
                return MISSING
        if stop < self.end:
            after = _member(raw[stop + 1 : raw.find(b"\n", stop + 1, self.end + 1)])
            if after is None or after[0] == name:
                return MISSING
        try:
            value, done = _DECODER.raw_decode(text, at)
        except (ValueError, RecursionError):
            return MISSING
        last = stop == self.end
        return value if text[done:] == ("" if last else ",") else MISSING

    def disagrees(self) -> str | None:
        """Why these lines are not the manifest's tensor table as a whole parse reads it, or None.

        Run once, at the first whole use (``load``, ``verify``, ``inspect``), so that a lookup by line and a
        whole parse can never read two different tables of one file: the lines must be the value of the
        top-level ``tensors`` member that ``json.loads`` keeps (the bytes with that value replaced by ``0``
        still parse, to a document whose ``tensors`` is ``0``), each one ``"key":value`` member, keys in
        strictly increasing order (so a binary search finds the one member of each name).
        """
        raw = self.raw
        try:
            rest = json.loads(bytes(raw[: self.first - 2]) + b"0" + bytes(raw[self.end + 2 :]))
        except (ValueError, RecursionError):
            rest = None
        if not isinstance(rest, dict) or rest.get("tensors") != 0 or type(rest.get("tensors")) is not int:
            return "the tensor lines are not the manifest's top-level tensors member"
        previous: str | None = None
        start = self.first
        while start < self.end:
            stop = raw.find(b"\n", start, self.end + 1)
            member = _member(raw[start:stop])
            if member is None:
                return f"line at byte {start} is not one tensor entry"
            if previous is not None and member[0] <= previous:
                return f"tensor lines out of order or repeated at {member[0]!r:.80}"
            previous = member[0]
            start = stop + 1
        return None


def _member(line: bytes | bytearray) -> tuple[str, str, int] | None:
    """A tensor line's key, its text, and where its value begins; None if it does not begin ``"key":``."""
    try:
        text = line.decode("utf-8", "surrogatepass")  # as json.loads decodes bytes
        if text[:1] != '"':
            return None
        key, end = scanstring(text, 1)
    except (ValueError, UnicodeDecodeError):
        return None
    return (key, text, end + 1) if text[end : end + 1] == ":" else None


def split(raw: bytes | bytearray) -> Lines | None:
    """The line layout of manifest bytes, or None where they are not in it exactly as the writer lays it out."""
    if not raw.startswith(b'{"checksum":'):
        return None
    at = raw.find(_TENSORS)
    if at < 0:
        return None
    meta = raw.rfind(_METADATA, 0, at)
    if meta < 0 or raw.find(b"\n", meta + 1) != at:  # the metadata's line is the one before
        return None
    first = at + len(_TENSORS)
    # From the end, where the lines are short (searching forward for the "}" line that ends the tensor lines
    # would scan them all): the last line holds the members after the tree; the one before it, the tree.
    stop = len(raw)
    while stop and raw[stop - 1] == 0x0A:  # the LF that ends the file
        stop -= 1
    last = raw.rfind(b"\n", 0, stop)
    tree = raw.rfind(b"\n", 0, last)
    end = tree - 3  # the LF that ends the last tensor line: then "},", LF, "tree":
    if end < first - 1 or not raw.startswith(_TREE, end) or raw[last - 1 : last] != b",":
        return None
    return Lines(raw, bytes(raw[:meta]) + _PLACEHOLDERS + bytes(raw[last:]), first, end)
