"""The limits on one manifest's bytes (docs/format.md, "Limits"): its size, and the memory a JSON parse of it may
take, estimated from its bytes before it is parsed, so that a hostile file is refused before it costs anything.
Writers refuse what readers would refuse (``Manifest.to_json_bytes``)."""

from __future__ import annotations

import numpy as np

from trainstate.errors import CorruptCheckpointError

# Limits on one manifest (docs/format.md, "Limits"). A merged manifest of 1,024 ranks x 1,000 sharded tensors
# (a million chunks) is about 0.15 GB, with a parse cost of about 10.5 bytes per byte.
MAX_BYTES = 1 << 30
PARSE_COST_PER_BYTE = 18  # parse_cost() may be this many bytes per manifest byte ...
PARSE_COST_ALLOWANCE = 256 << 20  # ... plus this much
MAX_COST_PER_BYTE = 148  # the most parse_cost() counts for one byte: a '{' (60 + 40 + 40) plus 8 of wide text


def parse_cost(raw: bytes | bytearray) -> int:
    """An upper bound on the memory (bytes) ``json.loads(raw)`` allocates, from counts of JSON's structural
    characters: no parsing, no copy.

    The weights are CPython's (3.11, 64-bit; later versions' objects are no larger), worst case per item: a container (list 56 bytes plus its
    slot array; dict 64 plus a 120-byte table), a value's slot and a number object, a string object, a dict
    member (table entry, resizes, json's key memo), and per byte the decoded text and string contents (4
    where non-ASCII text makes strings wide). Characters inside strings are counted as structure too,
    which only overestimates. tests/format/test_manifest.py checks the bound against tracemalloc.
    """
    braces, brackets, commas, quotes, colons = _counts(raw, b'{[,":')
    objects = braces
    containers = brackets + objects
    values = commas + containers + 1
    text = 1 if raw.isascii() else 4
    escapes = b"\\u" in raw and raw.count(b"\\u") > raw.count(b"\\u00")  # past Latin-1 (count only if any)
    wide_strings = text > 1 or escapes
    per_byte = text + (4 if wide_strings else 1)
    return 60 * containers + 40 * objects + 40 * values + 24 * (quotes // 2) + 48 * colons + per_byte * len(raw)


def _counts(raw: bytes | bytearray, chars: bytes) -> list[int]:
    """How many times each of ``chars`` occurs in ``raw``: NumPy compares over cache-sized blocks, several
    times faster than ``bytes.count`` once per character (a merged manifest can be 100s of MB)."""
    if len(raw) < 1 << 20:
        return [raw.count(bytes([c])) for c in chars]
    data = np.frombuffer(raw, dtype=np.uint8)
    out = [0] * len(chars)
    for begin in range(0, len(data), 1 << 18):
        block = data[begin : begin + (1 << 18)]
        for i, c in enumerate(chars):
            out[i] += int(np.count_nonzero(block == c))
    return out


def over_limits(raw: bytes | bytearray) -> str | None:
    """What makes these manifest bytes too large or too costly to parse, or None if nothing does."""
    if len(raw) > MAX_BYTES:
        return f"is {len(raw)} bytes, more than the {MAX_BYTES} a manifest may have"
    if (MAX_COST_PER_BYTE - PARSE_COST_PER_BYTE) * len(raw) <= PARSE_COST_ALLOWANCE:
        return None  # small enough that no content can exceed the budget (~2 MB): not worth counting
    cost, budget = parse_cost(raw), PARSE_COST_PER_BYTE * len(raw) + PARSE_COST_ALLOWANCE
    if cost > budget:
        return (
            f"would take up to {cost / 1e9:.2f} GB of memory to parse ({cost / len(raw):.1f} bytes per byte), "
            f"more than a manifest may ({PARSE_COST_PER_BYTE} per byte + {PARSE_COST_ALLOWANCE >> 20} MiB)"
        )
    return None


def check_limits(raw: bytes | bytearray, what: str) -> None:
    """Refuse manifest bytes over the limits on size and parse cost (:func:`over_limits`)."""
    problem = over_limits(raw)
    if problem:
        raise CorruptCheckpointError(
            f"{what} {problem}. trainstate refuses to write such a manifest, so this one is damaged or forged "
            "(or an older trainstate wrote it for a state of millions of tiny Python values): restore another "
            "checkpoint"
        )
