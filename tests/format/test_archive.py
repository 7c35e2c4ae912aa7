"""The packed-checkpoint layout (docs/format.md §10): golden bytes, the packed fixture, and every kind of damage.

Damage is tried the way it reaches a user: a flipped byte in each region (header, index, padding, manifest,
data-file header, tensor bytes), a truncated copy, random bytes, and forged indexes re-sealed with a valid
checksum. Each must come out as a trainstate error (a tensor's damage as a CorruptCheckpointError naming
it), never as wrong data or a raw exception from inside.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import xxhash
from test_golden import FIXTURE as V1_BASIC
from test_golden import golden_state

import trainstate
from helpers import assert_same
from trainstate import _checksum as checksum
from trainstate._format import archive

PACKED_FIXTURE = Path(__file__).parent.parent / "fixtures" / "packed-v1.0" / "basic.tsar"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A small checkpoint and its packed bytes."""
    path = tmp_path_factory.mktemp("archive") / "tiny"
    state = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.array([7, -7], np.int16), "n": 3}
    trainstate.save(path, state, metadata={"k": 1}, threads=1, fsync=False)
    return path, trainstate.pack(path)


def _fields(data: bytes) -> tuple:
    return archive.HEADER.unpack(data[: archive.HEADER.size])


def _members(data: bytes) -> list[dict]:
    n = _fields(data)[3]
    return json.loads(data[32 : 32 + n])["files"]


# -- the layout -------------------------------------------------------------------------------------


def test_the_layout_is_as_the_spec_says(tiny):
    path, data = tiny
    magic, major, minor, n, total, summed = _fields(data)
    assert (magic, major, minor) == (b"\x89TSPACK\n", 1, 0)
    assert total == len(data)
    assert summed == checksum.value_of(data[:24] + data[32 : 32 + n])
    index = data[32 : 32 + n]
    assert index == json.dumps(json.loads(index), sort_keys=True, separators=(",", ":")).encode()
    members = _members(data)
    assert [m["name"] for m in members] == ["manifest.json", "data-00000.safetensors"]
    at = 32 + n
    for m in members:
        assert m["offset"] % 4096 == 0 and at <= m["offset"] < at + 4096  # the first page boundary after
        assert data[at : m["offset"]] == bytes(m["offset"] - at)  # zero padding
        assert data[m["offset"] : m["offset"] + m["length"]] == (path / m["name"]).read_bytes()  # unchanged
        at = m["offset"] + m["length"]
    assert at == total  # no trailing bytes


def test_packing_is_deterministic_and_repacking_changes_nothing(tiny):
    path, data = tiny
    assert trainstate.pack(path) == data
    assert trainstate.pack(data) == data


def test_packing_the_v1_fixture_gives_the_packed_fixture_byte_for_byte():
    """Pins the layout: a change to it must be a new archive version, with this fixture still loading."""
    assert trainstate.pack(V1_BASIC) == PACKED_FIXTURE.read_bytes()


def test_the_packed_fixture_still_loads_and_verifies():
    data = PACKED_FIXTURE.read_bytes()
    assert_same(golden_state(), trainstate.load(data))
    assert_same(golden_state(), trainstate.load(PACKED_FIXTURE))
    with trainstate.open(data) as ck:
        ck.verify()
        assert ck.metadata == {"run": "golden"}


def unpack_from_spec(data: bytes) -> dict[str, bytes]:
    """docs/format.md §10, read with nothing from trainstate: the archive's files by name."""
    magic, major, _minor, n, total, summed = struct.unpack("<8sHHIQQ", data[:32])
    assert magic == b"\x89TSPACK\n" and major == 1 and len(data) >= 32 + n and len(data) >= total
    assert xxhash.xxh3_64_intdigest(data[:24] + data[32 : 32 + n]) == summed
    files, at = {}, 32 + n
    for entry in json.loads(data[32 : 32 + n])["files"]:
        assert entry["offset"] == -(-at // 4096) * 4096 and not any(data[at : entry["offset"]])
        at = entry["offset"] + entry["length"]
        files[entry["name"]] = data[entry["offset"] : at]
    assert at == total and "manifest.json" in files
    return files


def test_a_reader_written_from_the_spec_reads_the_packed_fixture(tmp_path):
    """§10 is enough: unpacked by the function above, the fixture is tests/fixtures/v1.0/basic, file for file,
    and the spec-only checkpoint reader (test_spec_reader.py) verifies and decodes it."""
    from test_spec_reader import SpecReader, assert_exact, basic_values

    files = unpack_from_spec(PACKED_FIXTURE.read_bytes())
    assert files == {p.name: p.read_bytes() for p in V1_BASIC.iterdir()}
    for name, raw in files.items():
        (tmp_path / name).write_bytes(raw)
    reader = SpecReader(tmp_path)
    reader.verify()
    assert_exact(basic_values(), reader.load())


def test_an_archive_may_be_followed_by_other_bytes(tiny):
    """An archive embedded in a larger blob (appended to a binary, inside a resource file) reads as is."""
    _, data = tiny
    assert trainstate.load(data + os.urandom(5000))["n"] == 3


# -- damage -----------------------------------------------------------------------------------------


def _regions(data: bytes) -> dict[str, list[int]]:
    """Offsets to flip, by region: every byte of the header, index, manifest and data file; padding sampled."""
    n = _fields(data)[3]
    members = _members(data)
    manifest, datafile = members
    header_len = 8 + struct.unpack("<Q", data[datafile["offset"] : datafile["offset"] + 8])[0]
    pads = [(32 + n, manifest["offset"]), (manifest["offset"] + manifest["length"], datafile["offset"])]

    def span(begin: int, end: int) -> list[int]:
        return list(range(begin, end))

    return {
        "header": span(0, 32),
        "index": span(32, 32 + n),
        "padding": [x for a, b in pads for x in (a, (a + b) // 2, b - 1)],
        "manifest": span(manifest["offset"], manifest["offset"] + manifest["length"]),
        "data-file header": span(datafile["offset"], datafile["offset"] + header_len),
        "tensor bytes": span(datafile["offset"] + header_len, datafile["offset"] + datafile["length"]),
    }


def _outcome(data: bytearray) -> str:
    """What a user meets reading damaged bytes: 'ok' (read without complaint), 'clean: <error>' or 'UNCLEAN'."""
    errors = []
    for read in (lambda: trainstate.load(data), lambda: trainstate.open(data).verify()):
        try:
            read()
        except trainstate.CheckpointError as e:
            errors.append(f"clean: {type(e).__name__}: {e}")
        except Exception as e:  # noqa: BLE001 - exactly what this looks for
            return f"UNCLEAN {type(e).__name__}: {e}"
    return errors[0] if errors else "ok"


def test_a_byte_flipped_in_any_region_is_a_clean_error(tiny):
    _, pristine = tiny
    data = bytearray(pristine)
    assert _outcome(data) == "ok"
    failures, seen = [], {}
    for region, offsets in _regions(pristine).items():
        for offset in offsets:
            data[offset] ^= 1 << (offset % 8)  # a different bit at each position
            try:
                outcome = _outcome(data)
            finally:
                data[offset] = pristine[offset]
            seen.setdefault(region, set()).add(outcome.split(":")[1] if outcome.startswith("clean") else outcome)
            if not outcome.startswith("clean"):
                failures.append(f"{region} byte {offset}: {outcome}")
    assert not failures, "\n".join(failures[:30])
    assert seen["tensor bytes"] == {" CorruptCheckpointError"}
    assert seen["padding"] == {" CorruptCheckpointError"}


def test_damaged_tensor_bytes_are_a_corrupt_checkpoint_error_naming_the_tensor(tiny):
    _, pristine = tiny
    data = bytearray(pristine)
    data[-1] ^= 0x40  # the last byte of the last tensor written: "b"
    with trainstate.open(data) as ck:  # the manifest is intact: opening works, reading "b" fails
        assert ck.read("w").tolist() == [[0, 1, 2], [3, 4, 5]]
        with pytest.raises(trainstate.CorruptCheckpointError, match=r"checksum mismatch in tensor b "):
            ck.read("b")
    with pytest.raises(trainstate.CorruptCheckpointError, match=r"tensor b "):
        trainstate.load(data)


def test_a_truncated_archive_says_so(tiny):
    _, data = tiny
    members = _members(data)
    cuts = {1, 7, 8, 31, 32, 33, members[0]["offset"], members[1]["offset"] + 9, len(data) - 1}
    for cut in sorted(cuts):
        with pytest.raises(trainstate.CorruptCheckpointError, match="truncated"):
            trainstate.open(data[:cut])
    with pytest.raises(trainstate.InvalidArgumentError, match="not a packed trainstate checkpoint"):
        trainstate.open(b"")


@pytest.mark.parametrize("size", [1, 31, 32, 100, 10_000])
def test_random_bytes_are_not_a_packed_checkpoint(size):
    data = bytes(np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8))
    with pytest.raises(trainstate.InvalidArgumentError, match="not a packed trainstate checkpoint"):
        trainstate.load(data)
    after_magic = archive.MAGIC + data  # the right start, then noise
    with pytest.raises((trainstate.CorruptCheckpointError, trainstate.FormatVersionError)):
        trainstate.load(after_magic)


def _forge(data: bytes, edit, major: int = 1) -> bytes:
    """Apply ``edit`` to the index entries and re-seal header and index with a valid checksum (a forger's
    archive: only the layout checks can refuse it)."""
    total = _fields(data)[4]
    members = _members(data)
    first = members[0]["offset"]
    edit(members)
    index = json.dumps({"files": members}, sort_keys=True, separators=(",", ":")).encode()
    head = struct.pack("<8sHHIQ", archive.MAGIC, major, 0, len(index), total)
    sealed = head + struct.pack("<Q", checksum.value_of(head + index)) + index
    assert len(sealed) <= first, "the forged index does not fit before the first file"
    return sealed + bytes(first - len(sealed)) + data[first:]


def _set(i: int, **fields):
    def edit(members: list[dict]) -> None:
        members[i].update(fields)

    return edit


FORGERIES = {
    "unaligned": (_set(1, offset=4097), "placed at byte 4097"),
    "overlapping": (_set(1, offset=4096), "placed at byte 4096"),
    "past the end": (_set(1, length=1 << 40), "ends at byte"),
    "escaping name": (_set(1, name="../x.safetensors"), "malformed"),
    "hidden name": (_set(1, name=".data-00000.safetensors"), "malformed"),
    "duplicate": (_set(1, name="manifest.json"), "each file once"),
    "no manifest": (_set(0, name="data-00009.safetensors"), "must list manifest.json"),
    "negative": (_set(1, length=-1), "malformed"),
    "not an int": (_set(1, offset="8192"), "malformed"),
    "a bool": (_set(1, length=True), "malformed"),
    "extra field": (_set(1, mode=1), "malformed"),
    "one member gone": (lambda m: m.pop(), "ends at byte"),
}


@pytest.mark.parametrize("name", FORGERIES)
def test_a_forged_index_is_refused(tiny, name):
    _, data = tiny
    edit, message = FORGERIES[name]
    with pytest.raises(trainstate.CorruptCheckpointError, match=message):
        trainstate.open(_forge(data, edit))


def test_a_newer_archive_version_asks_for_an_upgrade(tiny):
    _, data = tiny
    with pytest.raises(trainstate.FormatVersionError, match=r"newer trainstate \(archive version 2\.0"):
        trainstate.open(_forge(data, lambda m: None, major=2))


def test_the_forger_itself_is_sound(tiny):
    """Re-sealing without an edit gives back the very bytes: the refusals above come from the edits."""
    _, data = tiny
    assert _forge(data, lambda m: None) == data


if __name__ == "__main__":
    PACKED_FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    PACKED_FIXTURE.write_bytes(trainstate.pack(V1_BASIC))
    print("wrote", PACKED_FIXTURE)
