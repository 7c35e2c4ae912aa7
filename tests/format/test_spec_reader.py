"""A second, independent reader, written from docs/format.md alone: it imports nothing from trainstate.

It opens every fixture, verifies the manifest checksum (over the file's bytes, §5.1), every header and chunk
checksum, reads every tensor and rebuilds the tree, and compares with the values the fixtures were saved from.
If it cannot read a fixture, either the spec leaves something out or the code strays from the spec.
It also checks that the example closing the spec (§9) shows the spec-example fixture's real bytes; run
``python tests/format/test_spec_reader.py`` to print the blocks the document must contain.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import math
import re
import shutil
import stat
import struct
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import xxhash
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
SPEC = ROOT / "docs" / "format.md"


class SpecError(Exception):
    """The checkpoint breaks a rule of docs/format.md."""


# -- §4.1 dtypes: code -> NumPy type (every element little-endian) ---------------------------------------
DTYPES = {
    "BOOL": np.dtype("?"),
    "U8": np.dtype("u1"),
    "I8": np.dtype("i1"),
    "U16": np.dtype("<u2"),
    "I16": np.dtype("<i2"),
    "U32": np.dtype("<u4"),
    "I32": np.dtype("<i4"),
    "U64": np.dtype("<u8"),
    "I64": np.dtype("<i8"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "C64": np.dtype("<c8"),
    "C128": np.dtype("<c16"),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E4M3FNUZ": np.dtype(ml_dtypes.float8_e4m3fnuz),
    "F8_E5M2FNUZ": np.dtype(ml_dtypes.float8_e5m2fnuz),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
}
KINDS = ("torch", "numpy", "numpy-scalar")
FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
MAX_DEPTH = 200


# -- §5 checksums -----------------------------------------------------------------------------------------
def xxh3_64(data: bytes) -> str:
    """XXH3-64, seed 0, as 16 lowercase hex digits, most significant first."""
    return "xxh3_64:" + format(xxhash.xxh3_64_intdigest(data), "016x")


def check(data: bytes, expected: Any, what: str) -> None:
    if not isinstance(expected, str) or expected.split(":", 1)[0] != "xxh3_64":
        raise SpecError(f"{what}: unknown checksum {expected!r}")
    if xxh3_64(data) != expected:
        raise SpecError(f"{what}: checksum mismatch")


# -- §3 limits --------------------------------------------------------------------------------------------
def parse_cost(m: bytes) -> int:
    c = m.count
    if m.isascii():
        k = 2 if c(b"\\u") == c(b"\\u00") else 5
    else:
        k = 8
    return (
        60 * (c(b"[") + c(b"{"))
        + 40 * c(b"{")
        + 40 * (c(b",") + c(b"[") + c(b"{") + 1)
        + 24 * (c(b'"') // 2)
        + 48 * c(b":")
        + k * len(m)
    )


# -- §12: encryption ----------------------------------------------------------------------------------------
KEYS = {"v1.3-encrypted": bytes(range(32))}  # the fixtures' TEST keys (§12.4), by fixture folder


def hkdf(key: bytes, salt: bytes | None, info: str, length: int) -> bytes:
    return HKDF(hashes.SHA256(), length, salt, info.encode()).derive(key)


def check_mac(m: dict[str, Any], covered: bytes, c: str, key: bytes | None) -> None:
    """§12.3: the encryption object, the key check, then the MAC over the bytes §5.1 covers."""
    enc = m["encryption"]
    if not isinstance(enc, dict) or enc.get("algorithm") != "aes-256-gcm" or enc.get("kdf") != "hkdf-sha256":
        raise SpecError(f"unknown encryption {enc!r:.80}")
    if key is None:
        raise SpecError("an encrypted checkpoint, and no key")
    salt = bytes.fromhex(enc["salt"])
    if len(salt) != 16 or bytes.fromhex(enc["key_check"]) != hkdf(key, salt, "trainstate key check v1", 16):
        raise SpecError("another key")
    mac = hmac.new(hkdf(key, salt, "trainstate manifest hmac-sha256 v1", 32), covered, hashlib.sha256)
    if c != "hmac-sha256:" + mac.hexdigest():
        raise SpecError("manifest MAC mismatch")


def aes_256_gcm(
    key: bytes, name: str, t: dict[str, Any], c: dict[str, Any], params: dict[str, Any], data: bytes
) -> bytes:
    """§12.2: undo the transform; the associated data binds the chunk to its tensor and box."""
    n, d, rank = name.encode("utf-8", "surrogatepass"), t["dtype"].encode(), len(c["shape"])
    aad = b"trainstate aes-256-gcm chunk v1\x00" + struct.pack(
        f"<I{len(n)}sI{len(d)}sI{rank}Q{rank}Q", len(n), n, len(d), d, rank, *c["offset"], *c["shape"]
    )
    chunk_key = hkdf(key, None, "trainstate aes-256-gcm chunk key v1", 32)
    return AESGCM(chunk_key).decrypt(bytes.fromhex(params["nonce"]), data, aad)


# -- §3 and §5.1: the manifest ---------------------------------------------------------------------------
def read_manifest(raw: bytes, key: bytes | None = None) -> dict[str, Any]:
    if len(raw) > 1 << 30 or parse_cost(raw) > 18 * len(raw) + (1 << 28):
        raise SpecError("manifest over the limits")
    m = json.loads(raw)
    if not isinstance(m, dict) or m.get("format") != "trainstate":
        raise SpecError("not a trainstate manifest")
    version = m.get("format_version")
    if not isinstance(version, str) or not re.fullmatch(r"[0-9]{1,6}\.[0-9]{1,6}", version):
        raise SpecError(f"bad format_version {version!r}")
    if int(version.split(".")[0]) != 1:
        raise SpecError(f"format version {version}: another major version")
    c = m.get("checksum")
    if not isinstance(c, str):
        raise SpecError("manifest has no checksum")
    prefix = b'{"checksum":"' + c.encode() + b'",'
    if not raw.startswith(prefix):  # the re-formatted-manifest rule is a MAY: this reader does not take it
        raise SpecError("manifest does not begin with its checksum")
    if "encryption" in m:  # 1.3: the checksum is a MAC
        check_mac(m, b"{" + raw[len(prefix) :].rstrip(b"\n"), c, key)
    else:
        check(b"{" + raw[len(prefix) :].rstrip(b"\n"), c, "manifest")
    for field, kind in [("created", (int, float)), ("writer", str), ("files", list), ("tensors", dict)]:
        if not isinstance(m.get(field), kind) or isinstance(m[field], bool):
            raise SpecError(f"manifest field {field} is missing or mistyped")
    if not math.isfinite(m["created"]) or "tree" not in m or "metadata" not in m:
        raise SpecError("manifest fields created / tree / metadata")
    world = m.get("world_size", 1)  # optional, 1.2: the ranks that saved it together
    if type(world) is not int or world < 1:
        raise SpecError(f"manifest field world_size {world!r}: not a positive integer")
    return m


# -- §3.1 the line layout ---------------------------------------------------------------------------------
def tensor_line(raw: bytes, name: str) -> Any:
    """Tensor ``name``'s raw entry, found by §3.1's binary search over the tensor lines of manifest bytes
    whose checksum was checked; None where they are not in the layout, or a neighbour has the same key, or
    no line has the name (a reader then parses the whole manifest)."""
    lines = raw.split(b"\n")
    if b'"tensors":{' not in lines:
        return None
    first = lines.index(b'"tensors":{') + 1
    last = next((i for i in range(first, len(lines)) if lines[i].startswith(b"}")), None)
    if last is None:
        return None
    entries = lines[first:last]

    def member(line: bytes) -> tuple[str, Any]:
        (item,) = json.loads(b"{" + line.removesuffix(b",") + b"}").items()
        return item

    lo, hi = 0, len(entries)
    while lo < hi:
        mid = (lo + hi) // 2
        key, value = member(entries[mid])
        if key == name:
            if any(member(entries[i])[0] == name for i in (mid - 1, mid + 1) if 0 <= i < len(entries)):
                return None
            return value
        lo, hi = (mid + 1, hi) if key < name else (lo, mid)
    return None


# -- §5b zstd ---------------------------------------------------------------------------------------------
def unzstd(stored: bytes, raw_size: int, name: str) -> bytes:
    """One zstd frame whose declared content size is the box's raw size (checked before decompressing)."""
    import zstandard

    try:
        declared = zstandard.frame_content_size(stored)
    except zstandard.ZstdError as e:
        raise SpecError(f"{name}: not a zstd frame ({e})") from None
    if declared != raw_size:
        raise SpecError(f"{name}: the zstd frame declares {declared} bytes, the box holds {raw_size}")
    try:
        raw = zstandard.ZstdDecompressor().decompress(stored, allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise SpecError(f"{name}: the zstd frame does not decompress ({e})") from None
    if len(raw) != raw_size:
        raise SpecError(f"{name}: decompressed to {len(raw)} bytes, the box holds {raw_size}")
    return bytes(raw)


def zstd(key: bytes, name: str, t: dict[str, Any], c: dict[str, Any], params: dict[str, Any], data: bytes) -> bytes:
    """§5b: undo the transform (the box's raw size is what the frame must declare)."""
    return unzstd(data, count(c["shape"]) * DTYPES[t["dtype"]].itemsize, name)


TRANSFORMS = {"zstd": zstd, "aes-256-gcm": aes_256_gcm}  # name -> how to undo it (§5b, §12)


def plain_name(name: Any) -> str:
    if not isinstance(name, str) or not FILE_NAME.fullmatch(name) or len(name) > 201 or name == "manifest.json":
        raise SpecError(f"illegal file name {name!r}")
    return name


def count(shape: list[int]) -> int:
    return math.prod(shape)


def ints(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or any(type(v) is not int or v < 0 for v in value):
        raise SpecError(f"{what} is not a list of non-negative integers")
    return value


# -- the reader -------------------------------------------------------------------------------------------
class SpecReader:
    def __init__(self, path: Path, key: bytes | None = None) -> None:
        self.path = path
        self.key = key
        mpath = path / "manifest.json"
        if not mpath.exists():
            raise SpecError("no manifest.json: an incomplete checkpoint")
        if not stat.S_ISREG(mpath.lstat().st_mode):
            raise SpecError("manifest.json is not a regular file")
        self.manifest = read_manifest(mpath.read_bytes(), key)
        self.sizes: dict[str, int] = {}
        self.where: dict[str, Path] = {}  # §11: a "pool" file is in the run's _shared directory
        for f in self.manifest["files"]:
            name = plain_name(f["path"])
            if name in self.sizes or type(f["size"]) is not int:
                raise SpecError(f"files: {name} listed twice, or its size is not an integer")
            if type(f.get("pool", False)) is not bool:
                raise SpecError(f"files: {name}: pool is not a boolean")
            self.where[name] = path.parent / "_shared" / name if f.get("pool") else path / name
            st = self.where[name].lstat()
            if not stat.S_ISREG(st.st_mode) or st.st_size != f["size"]:
                raise SpecError(f"{name}: not a regular file of {f['size']} bytes")
            self.sizes[name] = f["size"]
            self.check_header(name, f["header_checksum"])
        self.entries = {name: self.entry(name, t) for name, t in self.manifest["tensors"].items()}
        self.check_disjoint_bytes()
        self.arrays: dict[str, Any] = {}
        self.stateful_types: list[str] = []

    def read(self, file: str, begin: int, end: int) -> bytes:
        with open(self.where[file], "rb") as fh:
            fh.seek(begin)
            data = fh.read(end - begin)
        if len(data) != end - begin:
            raise SpecError(f"{file} ends before byte {end}")
        return data

    def check_header(self, file: str, expected: str) -> None:
        (n,) = struct.unpack("<Q", self.read(file, 0, 8))
        if 8 + n > self.sizes[file] or (8 + n) % 8:
            raise SpecError(f"{file}: header length {n}")
        check(self.read(file, 0, 8 + n), expected, f"header of {file}")

    def entry(self, name: str, t: Any) -> dict[str, Any]:
        """One tensor entry, checked against §4 before anything is allocated."""
        if t["dtype"] not in DTYPES or t["kind"] not in KINDS:
            raise SpecError(f"{name}: unknown dtype {t['dtype']!r} or kind {t['kind']!r}")
        shape = ints(t["shape"], f"{name}.shape")
        itemsize = DTYPES[t["dtype"]].itemsize
        boxes = []
        for c in t["chunks"]:
            if c["file"] not in self.sizes:
                raise SpecError(f"{name}: chunk in an unlisted file {c['file']!r}")
            begin, end = ints(c["byte_range"], f"{name}.byte_range")
            offset, cshape = ints(c["offset"], f"{name}.offset"), ints(c["shape"], f"{name}.chunk shape")
            if not begin <= end <= self.sizes[c["file"]]:
                raise SpecError(f"{name}: byte range outside {c['file']}")
            if len(offset) != len(shape) or len(cshape) != len(shape):
                raise SpecError(f"{name}: chunk rank")
            if any(o + s > n for o, s, n in zip(offset, cshape, shape)):
                raise SpecError(f"{name}: box outside the tensor")
            transforms = c.get("transforms", [])
            if not isinstance(transforms, list) or not all(isinstance(x, dict) for x in transforms):
                raise SpecError(f"{name}: transforms is not an array of objects")
            unknown = [x.get("name") for x in transforms if x.get("name") not in TRANSFORMS]
            if unknown:  # §5b, §12: 1.3 defines zstd and aes-256-gcm
                raise SpecError(f"{name}: transform {unknown[0]!r} unknown")
            if transforms and count(cshape) * itemsize > (end - begin) * 2**15:
                raise SpecError(f"{name}: a transformed chunk claims more than 2^15 raw bytes per stored byte")
            if not transforms and end - begin != count(cshape) * itemsize:
                raise SpecError(f"{name}: {end - begin} bytes do not hold the box")
            boxes.append((offset, cshape))
        if sum(count(s) for _, s in boxes) != count(shape):
            raise SpecError(f"{name}: chunks do not tile the tensor")
        filled = [b for b in boxes if count(b[1])]
        for i, (ao, as_) in enumerate(filled):
            for bo, bs in filled[i + 1 :]:
                if all(a < b + m and b < a + n for a, n, b, m in zip(ao, as_, bo, bs)):
                    raise SpecError(f"{name}: boxes overlap")
        return t

    def check_disjoint_bytes(self) -> None:
        spans: dict[str, list[tuple[int, int]]] = {}
        for t in self.entries.values():
            for c in t["chunks"]:
                if c["byte_range"][0] < c["byte_range"][1]:
                    spans.setdefault(c["file"], []).append(tuple(c["byte_range"]))
        for ranges in spans.values():
            ranges.sort()
            if any(b < a_end for (_, a_end), (b, _) in zip(ranges, ranges[1:])):
                raise SpecError("two chunks share stored bytes")

    def tensor(self, name: str) -> Any:
        """§4 "Reading a tensor": every chunk checked, then placed at its box."""
        if name in self.arrays:  # tied: one array for every reference
            return self.arrays[name]
        t = self.entries[name]
        dtype = DTYPES[t["dtype"]]
        out = np.empty(t["shape"], dtype=dtype)
        pieces = []
        for c in t["chunks"]:
            stored = self.read(c["file"], *c["byte_range"])
            check(stored, c["checksum"], f"tensor {name}")
            for params in reversed(c.get("transforms", [])):  # undone in reverse order (§4)
                stored = TRANSFORMS[params["name"]](self.key, name, t, c, params, stored)  # type: ignore[arg-type]
            if len(stored) != count(c["shape"]) * dtype.itemsize:
                raise SpecError(f"{name}: {len(stored)} bytes do not hold the box")
            if c.get("transforms") and "raw_checksum" in c["transforms"][0]:
                check(stored, c["transforms"][0]["raw_checksum"], f"tensor {name}, decompressed")
            pieces.append((c, stored))
        for c, stored in pieces:
            box = tuple(slice(o, o + s) for o, s in zip(c["offset"], c["shape"]))
            out[box] = np.frombuffer(stored, dtype=dtype, count=count(c["shape"])).reshape(c["shape"])
        value = out[()] if t["kind"] == "numpy-scalar" else out
        self.arrays[name] = value
        return value

    def verify(self) -> None:
        """Every chunk of every listed tensor, referenced or not."""
        for name in self.entries:
            self.tensor(name)

    def load(self) -> Any:
        return self.decode(self.manifest["tree"], 0, tensors=True)

    def metadata(self) -> Any:
        return self.decode(self.manifest["metadata"], 0, tensors=False)

    # §6
    def decode(self, node: Any, depth: int, *, tensors: bool, key: bool = False) -> Any:
        if depth > MAX_DEPTH:
            raise SpecError("tree nests deeper than 200 levels")
        if node is None or isinstance(node, (bool, int, str)):
            return node
        if isinstance(node, float):
            if not math.isfinite(node):
                raise SpecError("a bare non-finite number")
            return node
        if not isinstance(node, dict):
            raise SpecError(f"malformed node {node!r:.60}")
        tag, v = node.get("t"), node.get("v")
        if tag == "float" and v in ("nan", "inf", "-inf"):
            return float(v)
        if tag == "bytes" and isinstance(v, str):
            return base64.b64decode(v, validate=True)
        if tag == "tuple" and isinstance(v, list):
            return tuple(self.decode(x, depth + 1, tensors=tensors, key=key) for x in v)
        if key:
            raise SpecError(f"{tag!r} node used as a dict key")
        if tag == "list" and isinstance(v, list):
            return [self.decode(x, depth + 1, tensors=tensors) for x in v]
        if tag == "dict" and isinstance(v, list):
            out = {}
            for item in v:
                if not (isinstance(item, list) and len(item) == 2):
                    raise SpecError("dict item is not a [key, value] pair")
                k = self.decode(item[0], depth + 1, tensors=False, key=True)
                out[k] = self.decode(item[1], depth + 1, tensors=tensors)
            return out
        if tag == "tensor" and isinstance(node.get("name"), str):
            if not tensors:
                raise SpecError("a tensor node where none may be")
            if node["name"] not in self.entries:
                raise SpecError(f"tree refers to an unlisted tensor {node['name']!r}")
            return self.tensor(node["name"])
        if tag == "stateful" and isinstance(node.get("type"), str) and "v" in node:
            self.stateful_types.append(node["type"])  # a label: nothing is imported or created
            return self.decode(v, depth + 1, tensors=tensors)
        raise SpecError(f"unknown or malformed node {node!r:.60}")


# -- what the fixtures hold -------------------------------------------------------------------------------
def basic_values() -> dict[str, Any]:
    """tests/fixtures/v1.0/basic: the state test_golden.py's golden_state() saves, restated here."""
    return {
        "weights": {
            "w": np.arange(12, dtype=np.float32).reshape(3, 4),
            "b": np.array([1, 2], dtype=ml_dtypes.bfloat16),
        },
        "optim": {
            "state": {0: {"step": np.float32(3.0), "m": np.full((2, 2), -0.5, dtype=np.float64)}},
            "param_groups": [{"lr": 0.001, "betas": (0.9, 0.999), "params": [0], "foreach": None}],
        },
        "step": 1200,
        "flags": [True, False],
        "name": "exp1",
        "nan": float("nan"),
        "blob": b"\x00\xff",
        "empty": np.zeros((0, 3), dtype=np.int8),
        "scalar0d": np.array(7, dtype=np.uint8),
    }


def example_values() -> dict[str, Any]:
    """tests/fixtures/v1.0/spec-example (make_spec_example.py), as a reader without torch returns it."""
    weight = np.array([[1.0, 2.0], [3.0, 4.0]], dtype=np.float32)
    return {
        "model": {"weight": weight, "bias": np.array([0.5, -0.5], dtype=np.float32)},
        "ema": {"weight": weight},
        "step": 7,
        "lr": 0.25,
        "betas": (0.9, 0.999),
        "scale": np.float16(1024.0),
        "z": np.array([1 + 2j], dtype=np.complex128),
        "history": [None, True, "ok", float("-inf")],
        "counts": {0: 3, (1, "b"): 4},
        "seed": b"\x01\x02\x03",
    }


def assert_exact(expected: Any, got: Any, path: str = "state") -> None:
    """Equal in type, dtype, shape and every byte; dict keys in order and of the same types."""
    assert type(got) is type(expected), f"{path}: {type(got).__name__}, expected {type(expected).__name__}"
    if isinstance(expected, (np.ndarray, np.generic)):
        assert got.dtype == expected.dtype and np.shape(got) == np.shape(expected), f"{path}: {got.dtype}"
        assert np.asarray(got).tobytes() == np.asarray(expected).tobytes(), f"{path}: {got!r}"
    elif isinstance(expected, dict):
        assert [(type(k), k) for k in got] == [(type(k), k) for k in expected], f"{path}: keys {list(got)}"
        for k in expected:
            assert_exact(expected[k], got[k], f"{path}.{k}")
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), f"{path}: length {len(got)}"
        for i, (e, g) in enumerate(zip(expected, got)):
            assert_exact(e, g, f"{path}.{i}")
    elif isinstance(expected, float) and math.isnan(expected):
        assert math.isnan(got), path
    else:
        assert got == expected, f"{path}: {got!r}, expected {expected!r}"


# -- the tests --------------------------------------------------------------------------------------------
def all_fixtures() -> list[Path]:
    return sorted(p.parent for p in FIXTURES.glob("*/*/manifest.json"))


@pytest.mark.parametrize("fixture", all_fixtures(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_fixture_verifies_and_decodes(fixture):
    reader = SpecReader(fixture, KEYS.get(fixture.parent.name))
    reader.verify()
    reader.load()
    reader.metadata()
    assert len(reader.arrays) == len(reader.manifest["tensors"]) > 0


def test_the_encrypted_fixture_needs_its_key():
    encrypted = FIXTURES / "v1.3-encrypted" / "basic"
    with pytest.raises(SpecError, match="no key"):
        SpecReader(encrypted)
    with pytest.raises(SpecError, match="another key"):
        SpecReader(encrypted, bytes(32))


def test_the_basic_fixture_holds_its_values():
    reader = SpecReader(FIXTURES / "v1.0" / "basic")
    assert_exact(basic_values(), reader.load())
    assert reader.metadata() == {"run": "golden"}
    raw_b = (FIXTURES / "v1.0" / "basic" / "data-00001.safetensors").read_bytes()
    start, end = reader.manifest["tensors"]["weights.b"]["chunks"][0]["byte_range"]
    as_f32 = (np.frombuffer(raw_b[start:end], dtype="<u2").astype("<u4") << 16).view("<f4")
    assert as_f32.tolist() == [1.0, 2.0]  # §4.1: BF16 is the upper half of a binary32


def test_the_line_layout_fixture_holds_the_same_values_and_finds_each_line():
    """v1.0-lines/basic is the basic fixture's state written in the line layout (§3.1)."""
    fixture = FIXTURES / "v1.0-lines" / "basic"
    reader = SpecReader(fixture)
    assert_exact(basic_values(), reader.load())
    raw = (fixture / "manifest.json").read_bytes()
    assert raw.count(b"\n") == 6 + len(reader.manifest["tensors"])  # one line each, six others
    for name, entry in reader.manifest["tensors"].items():
        assert tensor_line(raw, name) == entry
    assert tensor_line(raw, "weights") is None


def test_the_spec_example_holds_its_values():
    reader = SpecReader(FIXTURES / "v1.0" / "spec-example")
    state = reader.load()
    assert_exact(example_values(), state)
    assert state["ema"]["weight"] is state["model"]["weight"]  # tied: one array
    assert reader.stateful_types == ["torch.nn.modules.linear.Linear"]
    assert reader.metadata() == {"run": "example"}


@pytest.mark.parametrize("where", ["manifest", "header", "chunk"])
def test_the_reader_catches_a_flipped_byte(tmp_path, where):
    """The checks above are not vacuous: one changed byte anywhere is refused."""
    ck = tmp_path / "c"
    shutil.copytree(FIXTURES / "v1.0" / "spec-example", ck)
    target, at = {
        "manifest": ("manifest.json", 60),
        "header": ("data-00000.safetensors", 20),
        "chunk": ("data-00000.safetensors", 300),
    }[where]
    raw = bytearray((ck / target).read_bytes())
    raw[at] ^= 0x01
    (ck / target).write_bytes(bytes(raw))
    with pytest.raises(SpecError, match="checksum mismatch"):
        SpecReader(ck).verify()


def zstd_values() -> dict[str, Any]:
    """tests/fixtures/v1.3-zstd/basic (test_zstd_fixture.py), restated here."""
    import hashlib

    return {
        "model": {
            "w": (np.arange(1100 * 1000) % 7).astype(np.float32).reshape(1100, 1000),
            "b": np.arange(32).astype(ml_dtypes.bfloat16),
        },
        "noise": np.frombuffer(hashlib.shake_256(b"trainstate").digest(4096), dtype=np.uint8),
        "zeros": np.zeros((64, 64), dtype=np.float64),
        "scalar": np.float32(2.5),
        "empty": np.zeros((0, 4), dtype=np.int16),
        "step": 10,
    }


def test_the_zstd_fixture_holds_its_values():
    pytest.importorskip("zstandard")
    reader = SpecReader(FIXTURES / "v1.3-zstd" / "basic")
    assert reader.manifest["format_version"] == "1.3"
    assert_exact(zstd_values(), reader.load())
    assert reader.metadata() == {"run": "zstd"}


@pytest.mark.parametrize("where", ["stored", "raw_checksum"])
def test_the_reader_catches_a_changed_zstd_chunk(tmp_path, where):
    """A flipped stored byte fails the chunk's checksum; a wrong raw_checksum fails after decompressing."""
    pytest.importorskip("zstandard")
    ck = tmp_path / "c"
    shutil.copytree(FIXTURES / "v1.3-zstd" / "basic", ck)
    m = json.loads((ck / "manifest.json").read_bytes())
    chunk = m["tensors"]["model.w"]["chunks"][1]
    if where == "stored":
        raw = bytearray((ck / chunk["file"]).read_bytes())
        raw[chunk["byte_range"][0] + 10] ^= 0x01
        (ck / chunk["file"]).write_bytes(bytes(raw))
    else:  # resealed, so only the raw checksum is wrong
        chunk["transforms"][0]["raw_checksum"] = "xxh3_64:0123456789abcdef"
        del m["checksum"]
        body = json.dumps(m, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
        (ck / "manifest.json").write_bytes(b'{"checksum":"' + xxh3_64(body).encode() + b'",' + body[1:] + b"\n")
    with pytest.raises(SpecError, match="checksum mismatch"):
        SpecReader(ck).verify()


# -- §9: the document shows the fixture -------------------------------------------------------------------
def pretty(value: Any, indent: int = 0, width: int = 100) -> str:
    """JSON with members in the file's (sorted) order, containers on one line where they fit."""
    flat = json.dumps(value, sort_keys=True, separators=(", ", ": "))
    if not isinstance(value, (dict, list)) or not value or indent + len(flat) <= width:
        return flat
    pad = " " * (indent + 2)
    if isinstance(value, dict):
        lines = [f"{pad}{json.dumps(k)}: {pretty(value[k], indent + 2, width)}" for k in sorted(value)]
        return "{\n" + ",\n".join(lines) + "\n" + " " * indent + "}"
    lines = [pad + pretty(v, indent + 2, width) for v in value]
    return "[\n" + ",\n".join(lines) + "\n" + " " * indent + "]"


def example_blocks(fixture: Path) -> tuple[str, str]:
    """The data-file block and the manifest block of §9, rendered from the fixture's bytes."""
    raw = (fixture / "data-00000.safetensors").read_bytes()
    manifest = json.loads((fixture / "manifest.json").read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    lines = [f"{0:>4}  {raw[:8].hex(' ')}", f"{8:>4}  {raw[8 : 8 + n].decode().rstrip(' ')}"]
    chunks = sorted((c["byte_range"], name) for name, t in manifest["tensors"].items() for c in t["chunks"])
    lines += [f"{begin:>4}  {raw[begin:end].hex(' ')}  {name}" for (begin, end), name in chunks]
    return "```text\n" + "\n".join(lines) + "\n```", "```json\n" + pretty(manifest) + "\n```"


def example_facts(fixture: Path) -> list[str]:
    """Numbers the prose of §9 states, computed from the fixture."""
    raw = (fixture / "manifest.json").read_bytes()
    c = json.loads(raw)["checksum"]
    prefix = b'{"checksum":"' + c.encode() + b'",'
    body = b"{" + raw[len(prefix) :].rstrip(b"\n")
    files = json.loads(raw)["files"]
    bias = json.loads(raw)["tensors"]["model.bias"]["chunks"][0]
    (n,) = struct.unpack("<Q", (fixture / files[0]["path"]).read_bytes()[:8])
    return [
        f"`manifest.json` ({len(raw):,} bytes)",
        f"The file `F` is {len(raw):,} bytes",
        f"{len(prefix)}-byte prefix `{prefix.decode()}`",
        f'`B = "{{" + F[{len(prefix)}:{len(raw) - 1}]`',
        f"{len(body):,} bytes that begin `{body[:30].decode()}",
        f"XXH3-64 of `B` with seed 0 is `0x{xxhash.xxh3_64_intdigest(body):016x}`, hence `{c}`",
        f"`header_checksum`, `{files[0]['header_checksum']}`, is XXH3-64 of its bytes `[0, {8 + n})`",
        f"`model.bias` covers bytes `[{bias['byte_range'][0]}, {bias['byte_range'][1]})`",
        f"checksum is `{bias['checksum']}`",
    ]


def test_the_spec_ends_with_the_real_example():
    fixture = FIXTURES / "v1.0" / "spec-example"
    spec = SPEC.read_text()
    for block in example_blocks(fixture):
        assert block in spec, f"docs/format.md §9 should show:\n{block}"
    for fact in example_facts(fixture):
        assert fact in spec, f"docs/format.md §9 should say: {fact}"


if __name__ == "__main__":
    for block in example_blocks(FIXTURES / "v1.0" / "spec-example"):
        print(block, end="\n\n")
