"""Hostile checkpoints: fuzz the manifest and the data-file headers, and check only trainstate errors come out.

Three campaigns start from one small valid checkpoint (two data files, several dtypes, nested dicts /
lists / tuples, int keys, tied arrays, plus "stateful" nodes naming ``os.system`` and a sentinel module,
and a pickle payload stored as bytes and as a tensor):

- **structure**: the parsed manifest is mutated (any node replaced by a hostile JSON value, keys deleted
  or added, chunks duplicated or tiled, tensors aliased, byte ranges swapped, shapes re-cut) and
  **re-sealed** with a correct checksum, so the reader has to catch the lie itself;
- **bytes**: raw byte mutations of ``manifest.json`` (flips, splices, truncation, hostile tokens), half of
  them re-sealed in place so they get past the checksum;
- **headers**: the first 8 + N bytes of a data file (u64 N, then JSON), including a huge N, with or
  without the manifest re-sealed to match.

Every example is loaded with ``trainstate.load`` and ``trainstate.open`` (keys, metadata, info, read of
every listed name, verify) under these invariants:

- every exception is a ``trainstate.CheckpointError`` (a ``KeyError`` only for a name not in ``keys()``),
  and damage is never reported as a key that does not fit (an ``EncryptionKeyError``, which stops a manager
  instead of making it fall back to an older checkpoint) unless the manifest's ``encryption`` object changed;
- nothing outside the checkpoint directory is opened, nothing is written, renamed or removed
  (``sys.addaudithook``), and nothing is imported, executed or spawned;
- the traced peak allocation (tracemalloc; NumPy reports its buffers to it) stays below
  ``2 * (bytes of all files) + 32 * (manifest bytes) + 4 MiB`` (the 32x covers Python's JSON objects);
- each example finishes within ``slow_after`` seconds (a SIGALRM breaks real hangs);
- an un-resealed change to the manifest is rejected and an un-resealed change to a header fails verify().

Each run is for a flavor (common.FLAVORS) of the base checkpoint: compressed (zstd chunks), encrypted
(AES-GCM chunks, a MAC for a checksum), incremental (the checkpoint of a run whose data files are in the
run's pool, ``<run>/_shared``, which the reader may open as well) or all three. For an encrypted one the
fuzzer re-seals with the key's MAC -- an insider who holds the key -- and every read is given the key;
the same invariants hold. A manifest changed and *not* re-sealed (half the byte mutations, a quarter of
the structural ones) must then be refused, and by the MAC (``TamperedCheckpointError``) whenever it passes
every check a reader makes before the MAC (common.must_be_tampered). Flavors with chunk transforms also
mutate the transforms (dropped, reordered, duplicated, nonces swapped or hostile); incremental ones the
``pool`` / ``new`` flags of the files.

Example ``i`` of a campaign draws from ``random.Random(f"{seed}/{campaign}/{i}")``, so
``python -m tools.reliability.fuzz --seed S --replay CAMPAIGN:I [--flavor NAME]`` shows exactly one
example again.
tests/reliability/test_fuzz.py drives the same mutators and checks through hypothesis.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import pickle
import random
import re
import shutil
import signal
import struct
import sys
import tempfile
import threading
import time
import traceback
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

import trainstate
from trainstate import _checksum as checksum
from trainstate import _transforms as transforms
from trainstate._format import datafile, manifest_mac
from trainstate._keys import Key

from .common import FLAVORS, PLAIN, Flavor, Row, must_be_tampered, save_steps

MANIFEST = "manifest.json"
SENTINEL = "trainstate_fuzz_sentinel"  # a module that flags itself when imported: it never must be
CAMPAIGNS = {
    "structure": "hostile manifests (structure)",
    "bytes": "hostile bytes (manifest)",
    "headers": "hostile data-file headers",
}
UNLISTED = "__fuzz_not_a_listed_tensor__"
MiB = 1 << 20

# ------------------------------------------------------------------------------------------------
# manifest helpers


def canonical(body: Any) -> bytes:
    """The manifest's canonical serialization (docs/format.md §3)."""
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def seal(body: dict[str, Any], key: Key | None = None) -> bytes:
    """Manifest bytes for ``body`` with a correct checksum: a lie the checksum cannot catch. With ``key``,
    the checksum is the MAC an encrypted checkpoint's manifest carries (the lie of an insider with the key)."""
    body = {k: v for k, v in body.items() if k != "checksum"}
    body["checksum"] = digest(canonical(body), body, key)
    return canonical(body) + b"\n"


def digest(data: bytes, body: Any, key: Key | None) -> str:
    """The checksum member a reader expects for ``data`` (the bytes it covers): xxh3, or with ``key`` the
    MAC keyed with the salt ``body`` declares (its base's salt where the mutated one is not one)."""
    if key is None:
        return checksum.digest(data)
    enc = body.get("encryption") if isinstance(body, dict) else None
    salt = enc.get("salt") if isinstance(enc, dict) else None
    try:
        salt_bytes = bytes.fromhex(salt) if isinstance(salt, str) else b"\0" * manifest_mac.SALT_BYTES
    except ValueError:  # not hex: the reader refuses the encryption object before the MAC anyway
        salt_bytes = b"\0" * manifest_mac.SALT_BYTES
    mac = manifest_mac.Mac(key, salt_bytes)
    mac.update(data)
    return mac.result()


def reseal_bytes(raw: bytes, rnd: Any, key: Key | None = None) -> bytes | None:
    """Fix the checksum inside (possibly non-canonical) manifest bytes in place; None if impossible."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(body, dict) or not isinstance(body.get("checksum"), str):
        return None
    old = json.dumps(body["checksum"]).encode()
    if old not in raw:
        return None
    prefix = b'{"checksum":' + old + b","
    if raw.startswith(prefix) and rnd.random() < 0.5:  # the reader hashes these bytes as they are
        new = digest(b"{" + raw[len(prefix) :].rstrip(b"\n"), body, key)
    else:  # the reader hashes the canonical form of what it parsed
        rest = {k: v for k, v in body.items() if k != "checksum"}
        try:
            new = digest(canonical(rest), body, key)
        except (ValueError, RecursionError):
            return None
    return raw.replace(old, json.dumps(new).encode(), 1)


def _same_body(raw: bytes, base_raw: bytes) -> bool:
    try:
        return canonical(json.loads(raw)) == canonical(json.loads(base_raw))
    except (ValueError, RecursionError):
        return False


# ------------------------------------------------------------------------------------------------
# the base checkpoint


class _Payload:
    """Unpickling this would import the sentinel module (i.e. run code)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (__import__, (SENTINEL,))


@dataclass
class Base:
    """One valid checkpoint, held in memory: file name -> bytes, plus the parsed manifest."""

    files: dict[str, bytes]
    body: dict[str, Any]
    pwned_marker: str  # a file the os.system payload would create
    many_chunks: bool = True  # let tiling make 1000+ chunks (slow by design; the tests keep it off)
    flavor: Flavor = PLAIN
    pool: frozenset[str] = frozenset()  # data files in the run's pool (incremental), not in the checkpoint

    @property
    def manifest(self) -> bytes:
        return self.files[MANIFEST]

    @property
    def data_files(self) -> list[str]:
        return sorted(n for n in self.files if n != MANIFEST)

    @property
    def key(self) -> Key | None:
        return Key(self.flavor.key) if self.flavor.key is not None else None

    @property
    def extra_fields(self) -> list[str]:
        """Field names the flavor's manifests add, for mutations to use (none for plain: its draws stay)."""
        out = []
        if self.flavor.key is not None:
            out += ["encryption", "algorithm", "kdf", "salt", "key_check", "nonce"]
        if self.flavor.compression is not None:
            out += ["raw_checksum"]
        if self.flavor.incremental:
            out += ["pool", "new"]
        return out


def _base_state() -> dict[str, Any]:
    payload = pickle.dumps(_Payload(), protocol=2)
    b = np.arange(10, dtype=np.int64)
    return {
        "w": np.arange(128 * 128, dtype=np.float32).reshape(128, 128),  # 64 KiB: amplification shows
        "b": b,
        "b_tied": b,
        "e": np.zeros((0, 3), dtype=np.float16),
        "sc": np.float32(2.5),
        "bf": np.ones(7, dtype=ml_dtypes.bfloat16),
        "c": (np.arange(4) * (1 + 1j)).astype(np.complex128).reshape(2, 2),
        "f8": np.linspace(-2, 2, 9).astype(ml_dtypes.float8_e4m3fn),
        "mask": np.array([[True, False, True]]),
        "payload_arr": np.frombuffer(payload, dtype=np.uint8).copy(),
        "opt": {
            "state": {0: {"m": np.full(5, -1.0), "step": 3}, 1: {"m": np.full((2, 3), 0.5, np.float32)}},
            "param_groups": [{"lr": 0.1, "params": [0, 1]}],
        },
        "t": (1, "a", None, [True, 2.5, float("nan"), -0.0]),
        "raw": b"xy",
        "payload": payload,
        "step": 7,
    }


def build_base(workdir: str, flavor: Flavor = PLAIN) -> Base:
    """Save the small valid checkpoint, then plant code-execution bait in its tree and metadata.

    An incremental flavor saves it as the second checkpoint of a run whose first had the same tensors
    but other optimizer moments: it shares the rest through the pool and writes those again.
    """
    state = _base_state()
    metadata = {"run": "fuzz", "step": 7}
    pool: frozenset[str] = frozenset()
    if flavor.incremental:
        earlier = _base_state()
        earlier["opt"]["state"][0]["m"] = np.full(5, -2.0)
        run = os.path.join(workdir, "base-run")
        (path_,) = save_steps(Path(run), [(6, earlier), (7, state)], flavor, metadata)[1:]
        path = str(path_)
        with open(os.path.join(path, MANIFEST), "rb") as f:
            listed = json.loads(f.read())["files"]
        pool = frozenset(f["path"] for f in listed if f.get("pool"))
        names = [MANIFEST, *sorted(pool)]
        where = {n: os.path.join(run, "_shared", n) if n in pool else os.path.join(path, n) for n in names}
    else:
        path = run = os.path.join(workdir, "base")
        trainstate.save(path, state, metadata=metadata, threads=2, fsync=False, **flavor.save_kwargs())
        where = {n: os.path.join(path, n) for n in sorted(os.listdir(path))}
    files = {}
    for name, file in where.items():
        with open(file, "rb") as f:
            files[name] = f.read()
    shutil.rmtree(run)
    key = Key(flavor.key) if flavor.key is not None else None
    body = json.loads(files[MANIFEST])
    payload = state["payload"]
    marker = os.path.join(workdir, "pwned")
    bait = [
        ["os_system", {"t": "stateful", "type": "os.system", "v": f"touch {marker}"}],
        ["sentinel", {"t": "stateful", "type": f"{SENTINEL}.Boom", "v": {"t": "dict", "v": [["x", 1]]}}],
        [
            "pickled",
            {"t": "stateful", "type": "pickle.loads", "v": {"t": "bytes", "v": base64.b64encode(payload).decode()}},
        ],
        ["reduce", {"t": "stateful", "type": "builtins.eval", "v": "__import__('os').system('touch " + marker + "')"}],
    ]
    body["tree"]["v"].extend(bait)
    body["metadata"]["v"].append(["hook", {"t": "stateful", "type": f"{SENTINEL}.Hook", "v": None}])
    files[MANIFEST] = seal(body, key)
    return Base(files, json.loads(files[MANIFEST]), marker, flavor=flavor, pool=pool)


CHECKPOINT = "step_00000007"  # an incremental case's checkpoint, in its run directory beside _shared


def write_case(base: Base, files: dict[str, bytes], path: str) -> str:
    """Write a case's files at ``path``; returns the checkpoint's path (for an incremental base, ``path`` is
    the run directory: the checkpoint is in it, the pool files in its ``_shared``)."""
    os.mkdir(path)
    ckpt = path
    if base.pool:
        ckpt = os.path.join(path, CHECKPOINT)
        os.mkdir(ckpt)
        os.mkdir(os.path.join(path, "_shared"))
    for name, data in files.items():
        where = os.path.join(path, "_shared", name) if name in base.pool else os.path.join(ckpt, name)
        with open(where, "wb") as f:
            f.write(data)
    return ckpt


# ------------------------------------------------------------------------------------------------
# hostile values and the three mutators.  ``rnd`` is a random.Random or hypothesis' st.randoms().

HUGE_INTS = [
    0,
    1,
    -1,
    2,
    7,
    8,
    255,
    256,
    2**31 - 1,
    2**31,
    2**32,
    2**40,
    2**53 + 1,
    2**62,
    2**63 - 1,
    2**63,
    2**64 - 1,
    2**64,
    2**100,
    -(2**63),
    -(2**64),
    10**400,
    -(10**4000),
    10**4200,
]
FLOATS = [0.0, -0.0, 0.5, 1.5, -2.5, 1e20, 1e308, -1e308, 5e-324, 2.0**63]
STRINGS = [
    "",
    ".",
    "..",
    "../../etc/passwd",
    "/etc/passwd",
    "manifest.json",
    "./manifest.json",
    "/dev/zero",
    "/proc/self/mem",
    "data-00000.safetensors",
    "data-00001.safetensors",
    "data-00000.safetensors/..",
    "..\\..\\windows",
    "data-00000.safetensors\x00",
    ".data",
    "-",
    "a" * 201,
    "a" * 202,
    "\u00e9t\u00e9",
    "\ud800",
    "\x00",
    " ",
    "1" * 5000 + ".0",
    "2.0",
    "1.999999",
    "0.1",
    "1",
    "1.0.0",
    "F32",
    "U8",
    "C128",
    "F8_E8M0",
    "I64",
    "f32",
    "torch",
    "numpy",
    "numpy-scalar",
    "xxh3_64:0000000000000000",
    "xxh3_64:",
    "md5:d41d8cd98f00b204",
    "sha256",
    "os.system",
    "builtins.eval",
    "subprocess.Popen",
    SENTINEL,
    "tensor",
    "stateful",
    "bytes",
    "float",
    "dict",
    "list",
    "tuple",
    "nan",
    "inf",
    "-inf",
    "w",
    "b",
    "opt.state.0.m",
    "%s%n",
    "{}",
    "x" * 100_000,
]
FIELD_NAMES = [
    "format",
    "format_version",
    "checksum",
    "created",
    "writer",
    "metadata",
    "files",
    "tensors",
    "tree",
    "path",
    "size",
    "header_checksum",
    "dtype",
    "shape",
    "kind",
    "chunks",
    "file",
    "byte_range",
    "offset",
    "transforms",
    "name",
    "t",
    "v",
    "type",
    "__metadata__",
    "__proto__",
]


def hostile_value(rnd: Any, base: Base | None = None, depth: int = 0) -> Any:
    """A JSON value chosen to break a parser: huge numbers, paths, deep or long containers, fake nodes."""
    r = rnd.randrange(16 if depth < 2 else 8)
    if r == 0:
        return rnd.choice(HUGE_INTS)
    if r == 1:
        return rnd.randint(-(2**65), 2**65) if rnd.random() < 0.3 else rnd.randint(-3, 20_000)
    if r == 2:
        return rnd.choice(FLOATS)
    if r == 3:
        return rnd.choice([None, True, False])
    if r in (4, 5):
        return rnd.choice(STRINGS)
    if r == 6:
        return rnd.choice([[], {}, [[]], [{}], {"": None}])
    if r == 7:
        return "".join(chr(rnd.randrange(0x20, 0x3000)) for _ in range(rnd.randrange(1, 12)))
    if r == 8:
        return [hostile_value(rnd, base, depth + 1) for _ in range(rnd.randrange(0, 4))]
    if r == 9:
        return {
            rnd.choice(_field_names(base) + STRINGS[:12]): hostile_value(rnd, base, depth + 1)
            for _ in range(rnd.randrange(0, 4))
        }
    if r == 10:  # deep nesting, tree-like or bare
        d = rnd.choice([50, 199, 200, 201, 202, 400])
        node: Any = rnd.choice([0, {"t": "tensor", "name": "w"}, []])
        tagged = rnd.random() < 0.5
        for _ in range(d):
            node = {"t": "list", "v": [node]} if tagged else [node]
        return node
    if r == 11:  # long containers
        n = rnd.choice([1000, 10_000])
        return [0] * n if rnd.random() < 0.5 else {f"k{i}": i for i in range(n // 10)}
    if r == 12:  # fake tree nodes
        names = sorted(base.body["tensors"]) if base else ["w"]
        return rnd.choice(
            [
                {"t": "tensor", "name": rnd.choice(names + ["nope", "../w"])},
                {"t": "tensor", "name": hostile_value(rnd, base, depth + 1)},
                {
                    "t": "stateful",
                    "type": rnd.choice(["os.system", f"{SENTINEL}.X", "builtins.exec"]),
                    "v": hostile_value(rnd, base, depth + 1),
                },
                {"t": "bytes", "v": rnd.choice(["!!!", "gASV", "", "A", base64.b64encode(b"\x80\x04K\x01.").decode()])},
                {"t": "float", "v": rnd.choice(["nan", "inf", "-inf", "NaN", 1.0])},
                {"t": "dict", "v": [[hostile_value(rnd, base, depth + 1), hostile_value(rnd, base, depth + 1)]]},
                {"t": "dict", "v": [[{"t": "list", "v": []}, 1]]},
                {"t": "dict", "v": [[{"t": "tensor", "name": "w"}, 1]]},
                {
                    "t": rnd.choice(["list", "tuple", "dict", "pickle", "eval", ""]),
                    "v": hostile_value(rnd, base, depth + 1),
                },
            ]
        )
    if r == 13:  # fake chunk
        return {
            "file": rnd.choice(["data-00000.safetensors", "../data-00000.safetensors", "manifest.json"]),
            "byte_range": [rnd.choice(HUGE_INTS[:12]), rnd.choice(HUGE_INTS)],
            "offset": [0],
            "shape": [rnd.choice(HUGE_INTS)],
            "checksum": "xxh3_64:0000000000000000",
        }
    if r == 14:  # fake shape
        return rnd.choice([[2**40], [0, 2**63], [0, 2**64], [1] * 65, [0] * 70, [2**32, 2**32], [-1], [1.5]])
    return {"name": rnd.choice(["zstd", "aes", None, [], {}])}


def _field_names(base: Base | None) -> list[str]:
    return FIELD_NAMES + base.extra_fields if base is not None else FIELD_NAMES


def _paths(node: Any, prefix: tuple = ()) -> Iterator[tuple]:
    yield prefix
    if isinstance(node, dict):
        for k in list(node):
            yield from _paths(node[k], prefix + (k,))
    elif isinstance(node, list):
        for i in range(len(node)):
            yield from _paths(node[i], prefix + (i,))


def _get(node: Any, path: tuple) -> Any:
    for p in path:
        node = node[p]
    return node


def _fmt(path: tuple) -> str:
    return ".".join(str(p) for p in path) or "<root>"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _pick_path(rnd: Any, body: Any) -> tuple:
    paths = list(_paths(body))
    x = rnd.random()
    if x < 0.45:  # bias towards what the parser validates
        return rnd.choice([p for p in paths if p[:1] in (("tensors",), ("files",))] or paths)
    if x < 0.6:  # the top-level fields themselves
        return rnd.choice([p for p in paths if len(p) == 1] or paths)
    return rnd.choice(paths)


def _tensor_names(body: Any) -> list[str]:
    tensors = body.get("tensors") if isinstance(body, dict) else None
    return sorted(tensors) if isinstance(tensors, dict) else []


def _chunks(body: Any) -> list[dict]:
    out = []
    for name in _tensor_names(body):
        t = body["tensors"][name]
        if isinstance(t, dict) and isinstance(t.get("chunks"), list):
            out.extend(c for c in t["chunks"] if isinstance(c, dict))
    return out


def _copy(x: Any) -> Any:
    return json.loads(json.dumps(x))


def _tile_count(rnd: Any, nbytes: int, many: bool) -> int:
    """How many times to repeat a chunk: up to 300 for the 64 KiB tensor (an allocation 300x its bytes),
    up to 300 for small ones, and with ``many`` now and then 1000-2000 (what validation time does)."""
    if nbytes < 4096 and many and rnd.random() < 0.05:
        return rnd.randint(1000, 2000)
    return rnd.choice([2, 3, rnd.randint(2, 64), rnd.randint(65, 300)])


def _op_replace(rnd: Any, body: dict, base: Base) -> str:
    path = _pick_path(rnd, body)
    value = hostile_value(rnd, base)
    if not path:  # a non-object root is the bytes campaign's job
        body.clear()
        body.update(value if isinstance(value, dict) else {})
        return f"root = {_short(value)}"
    _get(body, path[:-1])[path[-1]] = value
    return f"{_fmt(path)} = {_short(value)}"


def _op_delete(rnd: Any, body: dict, base: Base) -> str:
    candidates = [p for p in _paths(body) if p and isinstance(_get(body, p[:-1]), (dict, list))]
    path = _pick_path(rnd, body) if rnd.random() < 0.3 else rnd.choice(candidates)
    if not path:
        return "delete nothing"
    del _get(body, path[:-1])[path[-1]]
    return f"del {_fmt(path)}"


def _op_add(rnd: Any, body: dict, base: Base) -> str:
    containers = [p for p in _paths(body) if isinstance(_get(body, p), (dict, list))]
    if rnd.random() < 0.4:
        containers = [p for p in containers if p[:1] == ("tensors",)] or containers
    path = rnd.choice(containers)
    target = _get(body, path)
    value = hostile_value(rnd, base)
    if isinstance(target, dict):
        key = rnd.choice(_field_names(base) + ["extra", "x" * 300])
        if "byte_range" in target and rnd.random() < 0.5:  # a chunk: its one optional field
            key = "transforms"
        target[key] = value
        return f"{_fmt(path + (key,))} += {_short(value)}"
    target.insert(rnd.randint(0, len(target)), value)
    return f"{_fmt(path)}.insert({_short(value)})"


def _op_duplicate_chunk(rnd: Any, body: dict, base: Base) -> str:
    names = [
        n
        for n in _tensor_names(body)
        if isinstance(body["tensors"][n], dict)
        and isinstance(body["tensors"][n].get("chunks"), list)
        and body["tensors"][n]["chunks"]
    ]
    if not names:
        return "no chunk to duplicate"
    name = rnd.choice(names)
    chunks = body["tensors"][name]["chunks"]
    chunks.append(_copy(rnd.choice(chunks)))
    return f"tensors.{name}: duplicate chunk"


def _op_tile(rnd: Any, body: dict, base: Base) -> str:
    """Consistent lie: k chunks that all point at the same stored bytes tile a k-times larger tensor."""
    names = [n for n in _tensor_names(body) if _single_chunk(body["tensors"][n])]
    if not names:
        return "no tensor to tile"
    name = rnd.choice(names)
    t = body["tensors"][name]
    c = t["chunks"][0]
    nbytes = c["byte_range"][1] - c["byte_range"][0] if _ints_ok(c.get("byte_range")) else 0
    k = _tile_count(rnd, nbytes, base.many_chunks)
    t["shape"] = [t["shape"][0] * k] + list(t["shape"][1:])
    t["chunks"] = [dict(_copy(c), offset=[i * c["shape"][0]] + [0] * (len(c["shape"]) - 1)) for i in range(k)]
    return f"tensors.{name}: {k} chunks over the same {nbytes} bytes (tile)"


def _single_chunk(t: Any) -> bool:
    if not isinstance(t, dict) or not isinstance(t.get("chunks"), list) or len(t["chunks"]) != 1:
        return False
    c = t["chunks"][0]
    return (
        isinstance(c, dict)
        and _ints_ok(t.get("shape"))
        and len(t["shape"]) >= 1
        and t["shape"][0] > 0
        and _ints_ok(c.get("shape"))
        and c["shape"] == t["shape"]
        and _ints_ok(c.get("byte_range"))
    )


def _ints_ok(v: Any) -> bool:
    return isinstance(v, list) and all(type(x) is int for x in v)


def _op_alias(rnd: Any, body: dict, base: Base) -> str:
    """Consistent lie: k more tensor entries that share one tensor's stored bytes, all in the tree."""
    names = _tensor_names(body)
    tree = body.get("tree")
    if not names or not (isinstance(tree, dict) and tree.get("t") == "dict" and isinstance(tree.get("v"), list)):
        return "no tensor to alias"
    name = rnd.choice(names)
    k = _tile_count(rnd, 65536 if name == "w" else 0, base.many_chunks)
    for i in range(k):
        alias = f"{name}~alias{i}"
        body["tensors"][alias] = _copy(body["tensors"][name])
        tree["v"].append([alias, {"t": "tensor", "name": alias}])
    return f"tensors.{name}: {k} aliases sharing its bytes"


def _op_swap(rnd: Any, body: dict, base: Base) -> str:
    chunks = _chunks(body)
    if len(chunks) < 2:
        return "nothing to swap"
    a, b = rnd.sample(chunks, 2)
    key = rnd.choice(["byte_range", "file", "checksum", "shape", "offset"])
    if key in a and key in b:
        a[key], b[key] = b[key], a[key]
    return f"swap {key} of two chunks"


def _op_swap_tensors(rnd: Any, body: dict, base: Base) -> str:
    names = _tensor_names(body)
    if len(names) < 2:
        return "nothing to swap"
    a, b = rnd.sample(names, 2)
    key = rnd.choice(["chunks", "shape", "dtype", "kind", None])
    ta, tb = body["tensors"][a], body["tensors"][b]
    if key is None:
        body["tensors"][a], body["tensors"][b] = tb, ta
    elif isinstance(ta, dict) and isinstance(tb, dict) and key in ta and key in tb:
        ta[key], tb[key] = tb[key], ta[key]
    return f"swap {key or 'entries'} of tensors {a} and {b}"


def _op_reshape(rnd: Any, body: dict, base: Base) -> str:
    """Consistent lie about a shape: same volume, or an empty tensor with absurd dimensions."""
    names = [
        n
        for n in _tensor_names(body)
        if isinstance(body["tensors"][n], dict)
        and isinstance(body["tensors"][n].get("chunks"), list)
        and len(body["tensors"][n]["chunks"]) == 1
        and isinstance(body["tensors"][n]["chunks"][0], dict)
        and _ints_ok(body["tensors"][n].get("shape"))
    ]
    if not names:
        return "no tensor to reshape"
    name = rnd.choice(names)
    t = body["tensors"][name]
    c = t["chunks"][0]
    volume = 1
    for n in t["shape"]:
        volume *= n
    if volume == 0 or rnd.random() < 0.3:
        shape = rnd.choice([[0, 2**62], [0, 2**63], [2**64, 0], [0] * 65, [0, 1, 2**40], [0] * 33 + [2**31] * 32])
        c["byte_range"] = [c["byte_range"][0]] * 2 if _ints_ok(c.get("byte_range")) else c.get("byte_range")
    else:
        shape = rnd.choice([[volume] + [1] * rnd.choice([1, 31, 63, 64]), [1] * 70 + [volume], [volume, 1, 1]])
    t["shape"] = shape
    c["shape"] = list(shape)
    c["offset"] = [0] * len(shape)
    return f"tensors.{name}: shape {_short(shape)} (consistent)"


def _op_claim(rnd: Any, body: dict, base: Base) -> str:
    """A tensor claiming 2^40 elements (or more) over a small byte range."""
    names = _tensor_names(body)
    if not names:
        return "no tensor"
    name = rnd.choice(names)
    n = rnd.choice([2**40, 2**40 + 1, 2**61, 2**64])
    size = 16
    body["tensors"][name] = {
        "dtype": rnd.choice(["U8", "F32", "C128"]),
        "shape": [n],
        "kind": "numpy",
        "chunks": [
            {
                "file": "data-00000.safetensors",
                "byte_range": [0, rnd.choice([n, size, n * 4])],
                "offset": [0],
                "shape": [n],
                "checksum": "xxh3_64:0000000000000000",
                **({"transforms": [{"name": rnd.choice(["zstd", "identity"])}]} if rnd.random() < 0.3 else {}),
            }
        ],
    }
    return f"tensors.{name}: claims {n} elements"


def _op_files(rnd: Any, body: dict, base: Base) -> str:
    files = body.get("files")
    if not isinstance(files, list) or not files:
        return "no files"
    r = rnd.randrange(3)
    if r == 0:
        files.append(_copy(rnd.choice(files)))
        return "files: duplicate entry"
    f = rnd.choice(files)
    if not isinstance(f, dict):
        return "files: entry not a dict"
    key = rnd.choice(["path", "size", "header_checksum"])
    value = rnd.choice(STRINGS[:16]) if key == "path" and r == 1 else hostile_value(rnd, base)
    f[key] = value
    return f"files[].{key} = {_short(value)}"


def _op_transforms(rnd: Any, body: dict, base: Base) -> str:
    """A chunk's transforms (zstd, aes-256-gcm) lie: dropped, reordered, doubled, or a nonce that is another
    chunk's or no nonce at all. Its checksum still covers its stored bytes, so only the decoding can tell."""
    chunks = [c for c in _chunks(body) if isinstance(c.get("transforms"), list) and c["transforms"]]
    if not chunks:
        return "no transformed chunk"
    c = rnd.choice(chunks)
    ts = c["transforms"]
    r = rnd.randrange(6)
    if r == 0:
        del ts[rnd.randrange(len(ts))]
        return f"a transform dropped: {_short(ts)}"
    if r == 1:
        ts.reverse()
        return f"transforms reversed: {_short(ts)}"
    if r == 2:
        ts.append(_copy(rnd.choice(ts)))
        return f"a transform doubled: {_short(ts)}"
    t = rnd.choice([t for t in ts if isinstance(t, dict)] or [{}])
    if r == 3:  # another chunk's nonce (or zstd parameters) in its place
        other = rnd.choice([x for o in chunks for x in o["transforms"] if isinstance(x, dict)])
        t.clear()
        t.update(_copy(other))
        return f"a transform copied from another chunk: {_short(other)}"
    if r == 4:
        member = rnd.choice(["nonce", "raw_checksum", "name"])
        value = rnd.choice(
            [None, "", "0" * 24, "0" * 23, "g" * 24, "0" * 32, "xxh3_64:0000000000000000", "aes-256-gcm", "zstd"]
            + [hostile_value(rnd, base)]
        )
        t[member] = value
        return f"transform.{member} = {_short(value)}"
    ts.insert(rnd.randrange(len(ts) + 1), rnd.choice([{"name": "zstd"}, {"name": "aes-256-gcm", "nonce": "0" * 24}]))
    return f"a transform inserted: {_short(ts)}"


def _op_pool(rnd: Any, body: dict, base: Base) -> str:
    """A file's place lies: a pool file said to be the checkpoint's own or the reverse, or its flags hostile."""
    files = [f for f in body.get("files") or [] if isinstance(f, dict)] if isinstance(body.get("files"), list) else []
    if not files:
        return "no files"
    f = rnd.choice(files)
    member = rnd.choice(["pool", "new"])
    value = rnd.choice([True, False, None, 1, 0, "true", [], hostile_value(rnd, base)])
    if value is None and rnd.random() < 0.5:
        f.pop(member, None)
        return f"files[{f.get('path')!r:.40}].{member} deleted"
    f[member] = value
    return f"files[{f.get('path')!r:.40}].{member} = {_short(value)}"


STRUCTURE_OPS: list[tuple[str, Callable[[Any, dict, Base], str], int]] = [
    ("replace", _op_replace, 10),
    ("delete", _op_delete, 5),
    ("add", _op_add, 4),
    ("duplicate", _op_duplicate_chunk, 2),
    ("tile", _op_tile, 2),
    ("alias", _op_alias, 1),
    ("swap", _op_swap, 2),
    ("swap-tensors", _op_swap_tensors, 1),
    ("reshape", _op_reshape, 2),
    ("claim", _op_claim, 1),
    ("files", _op_files, 2),
]


def _weighted(rnd: Any, ops: list[tuple[str, Callable, int]]) -> tuple[str, Callable]:
    total = sum(w for _, _, w in ops)
    x = rnd.randrange(total)
    for name, fn, w in ops:
        if x < w:
            return name, fn
        x -= w
    raise AssertionError


@dataclass
class Case:
    """One hostile checkpoint: its files and what was done to make it."""

    campaign: str
    files: dict[str, bytes]
    steps: list[str]
    ops: set[str] = field(default_factory=set)
    must_reject: bool = False  # un-resealed manifest change: open() must raise
    must_fail_verify: bool = False  # un-resealed header change: verify() must raise
    expect: str | None = None  # the error open() and load() must raise (an encrypted manifest's MAC: Tampered...)

    def describe(self) -> str:
        return "; ".join(self.steps)


def _structure_ops(base: Base) -> list[tuple[str, Callable[[Any, dict, Base], str], int]]:
    """The structural mutations for ``base``: the plain ones, and those of its flavor's own fields."""
    ops = list(STRUCTURE_OPS)
    if base.flavor.key is not None or base.flavor.compression is not None:
        ops.append(("transforms", _op_transforms, 3))
    if base.flavor.incremental:
        ops.append(("pool", _op_pool, 2))
    return ops


def structure_case(base: Base, rnd: Any) -> Case:
    body = _copy(base.body)
    old_mac = body.pop("checksum")
    steps, ops = [], set()
    for _ in range(rnd.choice([1, 1, 1, 2, 3])):
        name, fn = _weighted(rnd, _structure_ops(base))
        ops.add(name)
        steps.append(fn(rnd, body, base))
    outsider = base.key is not None and rnd.random() < 0.25  # changed without the key: the old MAC stays
    try:
        raw = canonical({**body, "checksum": old_mac}) + b"\n" if outsider else seal(body, base.key)
    except (ValueError, RecursionError) as e:  # nested past the encoder's limit: keep the base manifest
        raw = base.manifest
        steps.append(f"not sealable ({type(e).__name__}), unchanged")
        outsider = False
    if not outsider:
        return Case("structure", {**base.files, MANIFEST: raw}, steps, ops)
    steps.append("not re-sealed (no key)")
    must_reject = not _same_body(raw, base.manifest)
    expect = "TamperedCheckpointError" if must_reject and must_be_tampered(raw, base.manifest) else None
    return Case("structure", {**base.files, MANIFEST: raw}, steps, ops, must_reject=must_reject, expect=expect)


BYTE_TOKENS = [
    b"NaN",
    b"Infinity",
    b"-Infinity",
    b"1e999",
    b"-1e999",
    b"9" * 5000,
    b"1" * 4400,
    b'"\\ud800"',
    b'"\\u0000"',
    b"\x00",
    b"\xff\xfe",
    b"\xef\xbb\xbf",
    b"\xc3(",
    b"[" * 100_000,
    b"{" * 50_000,
    b'"' + b"a" * 100_000 + b'"',
    b"18446744073709551616",
    b"-9223372036854775809",
    b"1099511627776",
    b"0.0e-999999",
    b'"../../etc/passwd"',
    b'"/etc/passwd"',
    b'"manifest.json"',
    b"null",
    b"true",
    b"[]",
    b"{}",
    b",",
    b":",
    b'"',
    b"\\",
    b" " * 4096,
    b"\n",
    b"//",
    b"/*",
]


def bytes_case(base: Base, rnd: Any) -> Case:
    raw = bytearray(base.manifest)
    steps = []
    for _ in range(rnd.choice([1, 1, 2, 3])):
        r = rnd.randrange(9)
        n = len(raw)
        i = rnd.randrange(n + 1)
        if r == 0 and n:
            j = rnd.randrange(n)
            bit = rnd.randrange(8)
            raw[j] ^= 1 << bit
            steps.append(f"flip bit {bit} of byte {j}")
        elif r == 1:
            tok = rnd.choice(BYTE_TOKENS)
            j = min(n, i + rnd.randrange(0, 12))
            raw[i:j] = tok
            steps.append(f"bytes {i}:{j} = {_short(tok)}")
        elif r == 2:
            tok = bytes(rnd.randrange(256) for _ in range(rnd.randrange(1, 9)))
            raw[i:i] = tok
            steps.append(f"insert {tok!r} at {i}")
        elif r == 3:
            j = min(n, i + rnd.randrange(1, 64))
            del raw[i:j]
            steps.append(f"delete bytes {i}:{j}")
        elif r == 4:
            del raw[i:]
            steps.append(f"truncate at {i}")
        elif r == 5:  # a number token in the manifest (byte ranges, sizes, shapes) becomes another
            numbers = list(re.finditer(rb"(?<![A-Za-z0-9_.:-])\d+(?![A-Za-z0-9_.])", bytes(raw)))
            if numbers:
                m = rnd.choice(numbers)
                tok = rnd.choice([str(rnd.choice(HUGE_INTS)).encode(), b"-1", b"1.5", b"1e3", b"0x10", b"00", b"1e400"])
                raw[m.start() : m.end()] = tok
                steps.append(f"number at {m.start()} = {_short(tok)}")
        elif r == 6:  # a string token becomes a hostile one
            strings = list(re.finditer(rb'"[^"\\]*"', bytes(raw)))
            if strings:
                m = rnd.choice(strings)
                tok = json.dumps(rnd.choice(STRINGS)).encode()
                raw[m.start() : m.end()] = tok
                steps.append(f"string at {m.start()} = {_short(tok)}")
        elif r == 7:
            j = min(n, i + rnd.randrange(1, 200))
            raw[i:i] = raw[i:j]
            steps.append(f"duplicate bytes {i}:{j}")
        else:
            whole = rnd.choice(
                [
                    b"",
                    b"\n",
                    b" " * 64,
                    b"{}",
                    b"[]",
                    b"null",
                    b"\x00" * 64,
                    b"\xff" * 8,
                    b"[" * 200_000,
                    b'{"format":"trainstate"}',
                    b'{"format":"trainstate","format_version":"1.0"}',
                ]
            )
            raw[:] = whole
            steps.append(f"whole file = {_short(whole)}")
    out = bytes(raw)
    resealed = None
    if rnd.random() < 0.5:
        resealed = reseal_bytes(out, rnd, base.key)
    if resealed is not None:
        steps.append("resealed")
        out = resealed
    must_reject = resealed is None and not _same_body(out, base.manifest)
    expect = None
    if must_reject and base.key is not None and must_be_tampered(out, base.manifest):
        expect = "TamperedCheckpointError"
    return Case("bytes", {**base.files, MANIFEST: out}, steps, {"bytes"}, must_reject=must_reject, expect=expect)


HEADER_JSON = [
    b"[]",
    b'"x"',
    b"null",
    b"1",
    b"{}",
    b"NaN",
    b"[" * 10_000,
    b"\xff\xfe\x00",
    b'{"\\ud800":1}',
    b'{"w":{"dtype":"F32","shape":[1099511627776],"data_offsets":[0,4398046511104]}}',
    b'{"w":{"dtype":"PICKLE","shape":[-1],"data_offsets":[-1,18446744073709551615]}}',
    b'{"__metadata__":{"format":"pt","pickle":"\\u0080\\u0004"}}',
    b'{"a":' * 2000,
]


def headers_case(base: Base, rnd: Any) -> Case:
    name = rnd.choice(base.data_files)
    data = bytearray(base.files[name])
    (n,) = struct.unpack("<Q", data[:8])
    steps = [name]
    shift = 0  # bytes the data section moved by
    r = rnd.randrange(6)
    if r == 0:
        new = rnd.choice(
            [
                0,
                1,
                7,
                n - 1,
                n + 1,
                n + 8,
                len(data) - 8,
                len(data) - 7,
                len(data),
                2**32,
                2**63,
                2**64 - 1,
                datafile.MAX_HEADER,
                datafile.MAX_HEADER + 1,
                rnd.randrange(2**64),
            ]
        )
        data[:8] = struct.pack("<Q", new)
        steps.append(f"N = {new}")
    elif r == 1:
        for _ in range(rnd.randint(1, 4)):
            j = rnd.randrange(8 + n)
            bit = rnd.randrange(8)
            data[j] ^= 1 << bit
            steps.append(f"flip bit {bit} of header byte {j}")
    elif r == 2:  # same length, hostile JSON
        tok = rnd.choice(HEADER_JSON)[:n]
        data[8 : 8 + n] = tok + b" " * (n - len(tok))
        steps.append(f"header = {_short(tok)}")
    elif r == 3:  # the header grows or shrinks; the data section moves
        j = 8 + rnd.randrange(n + 1)
        if rnd.random() < 0.5:
            tok = rnd.choice(HEADER_JSON + [b" " * rnd.randrange(1, 64)])
            data[j:j] = tok
            shift = len(tok)
        else:
            k = min(rnd.randrange(1, 32), 8 + n - j)
            del data[j : j + k]
            shift = -k
        steps.append(f"header resized by {shift} at {j}")
        if rnd.random() < 0.7:
            data[:8] = struct.pack("<Q", n + shift)
            steps.append("N follows")
    elif r == 4:
        del data[rnd.randrange(0, 8 + n) :]
        steps.append(f"file truncated to {len(data)} bytes")
    else:  # overwrite in place with a token that breaks JSON
        tok = rnd.choice([b'"', b"\\", b"\x00", b"}", b"{", b"9" * 30, b"\xc3", b"\\ud800", b"NaN", b"1e999"])
        j = 8 + rnd.randrange(max(1, n - len(tok)))
        data[j : j + len(tok)] = tok
        steps.append(f"header bytes at {j} = {tok!r}")
    files = {**base.files, name: bytes(data)}
    changed = bytes(data[: 8 + n]) != base.files[name][: 8 + n] or len(data) != len(base.files[name])
    resealed = rnd.random() < 0.5
    if resealed:
        body = _copy(base.body)
        body.pop("checksum")
        (n2,) = struct.unpack("<Q", data[:8]) if len(data) >= 8 else (0,)
        for f in body["files"]:
            if f["path"] == name:
                f["size"] = len(data)
                if 8 + n2 <= len(data):
                    f["header_checksum"] = checksum.digest(bytes(data[: 8 + n2]))
        if shift:
            for c in _chunks(body):
                if c["file"] == name:
                    c["byte_range"] = [c["byte_range"][0] + shift, c["byte_range"][1] + shift]
            steps.append("chunks shifted")
        files[MANIFEST] = seal(body, base.key)
        steps.append("manifest resealed")
    return Case("headers", files, steps, {"headers"}, must_fail_verify=changed and not resealed)


MUTATORS: dict[str, Callable[[Base, Any], Case]] = {
    "structure": structure_case,
    "bytes": bytes_case,
    "headers": headers_case,
}

# ------------------------------------------------------------------------------------------------
# watching: audit events, allocation, time

_WATCH: list[tuple[str, tuple]] | None = None  # recording switch for the audit hook
_HOOKED = False
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
WRITE_EVENTS = {
    "os.rename",
    "os.remove",
    "os.rmdir",
    "os.mkdir",
    "os.symlink",
    "os.link",
    "os.truncate",
    "os.chmod",
    "os.chown",
    "os.utime",
    "os.chflags",
    "os.mkfifo",
    "os.mknod",
    "shutil.rmtree",
    "shutil.copyfile",
    "shutil.copymode",
    "shutil.copystat",
    "shutil.move",
    "shutil.chown",
    "tempfile.mkstemp",
    "tempfile.mkdtemp",
}
CODE_EVENTS = {
    "import",
    "exec",
    "compile",
    "os.system",
    "os.exec",
    "os.posix_spawn",
    "os.spawn",
    "os.fork",
    "os.forkpty",
    "os.startfile",
    "subprocess.Popen",
    "pickle.find_class",
    "marshal.loads",
    "marshal.load",
    "ctypes.dlopen",
    "ctypes.dlsym",
    "ctypes.call_function",
    "code.__new__",
    "function.__new__",
    "builtins.input",
    "socket.connect",
    "socket.__new__",
    "webbrowser.open",
    "urllib.Request",
    "os.kill",
    "signal.pthread_kill",
    "cpython.run_command",
}
WATCHED = {"open"} | WRITE_EVENTS | CODE_EVENTS


def _audit(event: str, args: tuple) -> None:
    watch = _WATCH
    if watch is not None and event in WATCHED:
        watch.append((event, args))


def install_audit_hook() -> None:
    """Install the recording hook once per process (audit hooks cannot be removed)."""
    global _HOOKED
    if not _HOOKED:
        sys.addaudithook(_audit)
        _HOOKED = True


class _Hang(BaseException):
    """Raised by SIGALRM inside an operation that ran past ``hang_after``."""


class _Stop(Exception):
    """An operation hung: the rest of the example is skipped (it would hang again)."""


@dataclass(frozen=True)
class Violation:
    kind: str  # "exception", "outside-open", "write", "code", "allocation", "slow", "hang", "undetected"
    op: str  # load, open, keys, info, metadata, read, verify, header
    signature: str  # stable key for grouping: exception type and where it came from
    detail: str

    def __str__(self) -> str:
        return f"{self.kind} in {self.op}: {self.signature} ({self.detail})"


@dataclass
class Outcome:
    results: dict[str, str] = field(default_factory=dict)  # op -> "ok" or the error's class name
    violations: list[Violation] = field(default_factory=list)
    peak: int = 0
    bound: int = 0
    seconds: float = 0.0


def _origin(e: BaseException) -> str:
    """Innermost trainstate frame of the exception's traceback, as 'pkg/file.py:function'."""
    where = "?"
    for frame, _ in traceback.walk_tb(e.__traceback__):
        filename = frame.f_code.co_filename.replace(os.sep, "/")
        if "/trainstate/" in filename:
            where = filename.rsplit("/trainstate/", 1)[1] + ":" + frame.f_code.co_name
    return where


def signature(e: BaseException) -> str:
    sig = f"{type(e).__name__}@{_origin(e)}"
    ctx = e.__cause__ or (e.__context__ if e.__suppress_context__ else None)
    if ctx is not None and not isinstance(ctx, trainstate.CheckpointError):
        sig += f" <- {type(ctx).__name__}@{_origin(ctx)}"
    return sig


def _inside(path: Any, *roots: str) -> bool:
    if isinstance(path, int):
        return True  # an fd opened earlier (and audited then)
    real = os.path.realpath(os.fsdecode(path))
    return any(real == root or real.startswith(root + os.sep) for root in roots)


KEY_ERRORS = {"KeyRequiredError", "WrongKeyError", "NotEncryptedError", "EncryptionKeyError"}


class Checker:
    """Runs one hostile checkpoint through every reading API and collects invariant violations."""

    def __init__(self, base: Base, *, slow_after: float = 2.0, hang_after: float = 5.0) -> None:
        self.base = base
        self._path = ""
        self.slow_after = slow_after
        self.hang_after = hang_after

    def check(self, path: str, case: Case | None = None) -> Outcome:
        roots = [os.path.realpath(path)]
        if self.base.pool:  # an incremental checkpoint: its run's pool may be read too (docs/format.md §11)
            roots.append(os.path.join(os.path.dirname(roots[0]), "_shared"))
        out = Outcome()
        total = manifest_size = 0
        for root in roots:
            for name in os.listdir(root) if os.path.isdir(root) else []:
                st = os.lstat(os.path.join(root, name))
                total += st.st_size
                manifest_size += st.st_size if name == MANIFEST else 0
        out.bound = 2 * total + 32 * manifest_size + 4 * MiB
        events: list[tuple[str, tuple]] = []
        started_tracing = not tracemalloc.is_tracing()
        if started_tracing:
            tracemalloc.start(1)
        global _WATCH
        t0 = time.perf_counter()
        self._path = path
        try:
            _WATCH = events
            self._run_all(path, out, case)
        except _Stop:
            pass
        finally:
            _WATCH = None
            out.seconds = time.perf_counter() - t0
            if started_tracing:
                tracemalloc.stop()
        self._judge_events(events, roots, out)
        if SENTINEL in sys.modules or getattr(sys, "_trainstate_fuzz_sentinel", False):
            out.violations.append(Violation("code", "any", "sentinel module imported", SENTINEL))
        if os.path.exists(self.base.pwned_marker):
            out.violations.append(Violation("code", "any", "os.system payload ran", self.base.pwned_marker))
        if out.seconds > self.slow_after and not any(v.kind == "hang" for v in out.violations):
            out.violations.append(
                Violation("slow", "all", "slow example", f"{out.seconds:.2f} s > {self.slow_after} s")
            )
        if case is not None and case.must_reject and out.results.get("open") == "ok":
            out.violations.append(Violation("undetected", "open", "changed manifest accepted", case.describe()))
        if case is not None and case.must_fail_verify and out.results.get("verify") == "ok":
            out.violations.append(Violation("undetected", "verify", "changed header passed verify", case.describe()))
        if not self._key_changed(case):  # the key given fits the manifest as written: any error is damage
            for op, result in out.results.items():
                if result in KEY_ERRORS:
                    detail = case.describe() if case is not None else "the base checkpoint"
                    out.violations.append(Violation("misclassified", op, f"{result} for damage", detail))
        if case is not None and case.expect is not None:
            for op in ("load", "open"):
                if out.results.get(op) not in (case.expect, "hang"):
                    found = out.results.get(op)
                    out.violations.append(
                        Violation("misclassified", op, f"{found} instead of {case.expect}", case.describe())
                    )
        return out

    def _key_changed(self, case: Case | None) -> bool:
        """Whether the case's manifest declares other encryption than the base's (a salt, a key check or
        the whole object changed, added or removed): only then may a key not fit it."""
        if case is None:
            return False
        try:
            body = json.loads(case.files[MANIFEST])
        except (ValueError, RecursionError):
            return False
        declared = body.get("encryption", None) if isinstance(body, dict) else None
        return bool(declared != self.base.body.get("encryption"))

    # -- the operations -------------------------------------------------------------------------

    def _run_all(self, path: str, out: Outcome, case: Case | None) -> None:
        kwargs = self.base.flavor.open_kwargs()
        self._op(out, "load", lambda: trainstate.load(path, **kwargs))
        holder: list[Any] = []
        if not self._op(out, "open", lambda: holder.append(trainstate.open(path, **kwargs))):
            return
        ck = holder[0]
        try:
            names: list[str] = []
            self._op(out, "keys", lambda: names.extend(ck.keys()))
            self._op(out, "metadata", lambda: ck.metadata)
            for name in names:
                self._op(out, "info", lambda name=name: ck.info(name))
            for name in names:
                self._op(out, "read", lambda name=name: ck.read(name))
            if UNLISTED not in names:
                self._op(out, "read-unlisted", lambda: ck.read(UNLISTED), unlisted=True)
            self._op(out, "verify", ck.verify)
        finally:
            self._op(out, "close", ck.close)
        if case is not None and case.campaign == "headers":
            for name, data in case.files.items():
                if name != MANIFEST:
                    self._op(
                        out,
                        "header",
                        lambda data=data, name=name: datafile.parse_header(data[: 1 << 20], len(data), name),
                    )

    def _op(self, out: Outcome, op: str, fn: Callable[[], Any], unlisted: bool = False) -> bool:
        alarm = threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")
        if alarm:
            previous = signal.signal(signal.SIGALRM, _raise_hang)
            signal.setitimer(signal.ITIMER_REAL, self.hang_after)
        base_mem = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        ok = False
        try:
            result = fn()
            del result
            ok = True
            status = "ok"
        except _Hang:
            status = "hang"
            out.violations.append(Violation("hang", op, "no answer", f"stopped after {self.hang_after} s"))
        except trainstate.CheckpointError as e:
            status = type(e).__name__
        except KeyError as e:
            status = "KeyError"
            if not unlisted:
                out.violations.append(Violation("exception", op, signature(e), self._text(e)))
        except BaseException as e:  # noqa: BLE001 - that is the point
            status = type(e).__name__
            out.violations.append(Violation("exception", op, signature(e), self._text(e)))
        finally:
            if alarm:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)
        if unlisted and status == "ok":
            out.violations.append(Violation("exception", op, "read of an unlisted name succeeded", UNLISTED))
        peak = tracemalloc.get_traced_memory()[1] - base_mem
        out.peak = max(out.peak, peak)
        if peak > out.bound:
            out.violations.append(
                Violation(
                    "allocation",
                    op,
                    "allocation beyond the files' size",
                    f"peak {peak / MiB:.1f} MiB > bound {out.bound / MiB:.1f} MiB",
                )
            )
        out.results.setdefault(op, status)
        if status != "ok":
            out.results[op] = status
        if status == "hang" and op != "close":
            raise _Stop
        return ok

    def _text(self, e: BaseException) -> str:
        return _short(str(e).replace(self._path, "<ckpt>"))

    def _judge_events(self, events: list[tuple[str, tuple]], roots: list[str], out: Outcome) -> None:
        for event, args in events:
            if event == "open":
                path, mode, flags = (tuple(args) + (None, None))[:3]
                writing = (isinstance(flags, int) and flags & _WRITE_FLAGS) or (
                    isinstance(mode, str) and any(ch in mode for ch in "wax+")
                )
                if path is not None and not _inside(path, *roots):
                    out.violations.append(
                        Violation("outside-open", "any", "opened outside the checkpoint", _short(path))
                    )
                elif writing:
                    out.violations.append(Violation("write", "any", "opened for writing", _short(path)))
            elif event in WRITE_EVENTS:
                out.violations.append(Violation("write", "any", event, _short(args)))
            else:
                out.violations.append(Violation("code", "any", event, _short(args)))


def _raise_hang(signum: int, frame: Any) -> None:
    raise _Hang()


# ------------------------------------------------------------------------------------------------
# the harness shared by the campaigns and the tests


class Harness:
    """A work directory, the base checkpoint, the sentinel module, and the checker."""

    def __init__(
        self,
        *,
        slow_after: float = 2.0,
        hang_after: float = 5.0,
        many_chunks: bool = True,
        flavor: Flavor = PLAIN,
        warm_up: int = 20,
    ) -> None:
        self.workdir = os.path.realpath(tempfile.mkdtemp(prefix="trainstate-fuzz-"))
        sentinel_dir = os.path.join(self.workdir, "sentinel")
        os.mkdir(sentinel_dir)
        with open(os.path.join(sentinel_dir, SENTINEL + ".py"), "w") as f:
            f.write(
                "import sys\nsys._trainstate_fuzz_sentinel = True\n"
                "class Boom:\n    def __init__(self, *a, **k):\n        sys._trainstate_fuzz_sentinel = True\n"
                "Hook = X = Boom\n"
            )
        sys.path.insert(0, sentinel_dir)  # importable, so that importing it would show
        self._sentinel_dir = sentinel_dir
        self.base = build_base(self.workdir, flavor)
        self.base.many_chunks = many_chunks
        self.checker = Checker(self.base, slow_after=slow_after, hang_after=hang_after)
        self._n = 0
        install_audit_hook()
        self._warm_up(warm_up)

    def _warm_up(self, count: int) -> None:
        """Exercise the success and error paths once unwatched, so lazy imports are not counted as code."""
        kwargs = self.base.flavor.open_kwargs()
        path = self.write({**self.base.files})
        try:
            trainstate.load(path, **kwargs)
            with trainstate.open(path, **kwargs) as ck:
                names = ck.keys()
                for name in names:
                    ck.read(name)
                ck.verify()
        finally:
            self.remove(path)
        decoders = transforms.Decoders(self.base.key)
        for name in transforms.REGISTRY:  # any manifest may name one: its (trainstate) module loads on first use
            decoders.get(name)
        warm = random.Random("warm-up")
        for mutate in MUTATORS.values():
            for _ in range(count):
                self.run_case(mutate(self.base, warm))

    def write(self, files: dict[str, bytes]) -> str:
        """Write a case; returns the checkpoint's path (inside its own run directory when incremental)."""
        self._n += 1
        return write_case(self.base, files, os.path.join(self.workdir, f"case-{self._n}"))

    def remove(self, path: str) -> None:
        """Remove a case :meth:`write` wrote at ``path``, its pool included."""
        shutil.rmtree(os.path.dirname(path) if self.base.pool else path, ignore_errors=True)

    def run_case(self, case: Case) -> Outcome:
        path = self.write(case.files)
        try:
            return self.checker.check(path, case)
        finally:
            self.remove(path)

    def run_files(self, files: dict[str, bytes], prepare: Callable[[str], None] | None = None) -> Outcome:
        """Check a checkpoint made of ``files``, after ``prepare(path)`` (e.g. to plant a symlink)."""
        path = self.write(files)
        try:
            if prepare is not None:
                prepare(path)
            return self.checker.check(path)
        finally:
            self.remove(path)

    def close(self) -> None:
        if self._sentinel_dir in sys.path:
            sys.path.remove(self._sentinel_dir)
        shutil.rmtree(self.workdir, ignore_errors=True)


def case_rng(seed: int, campaign: str, i: int) -> random.Random:
    return random.Random(f"{seed}/{campaign}/{i}")


# ------------------------------------------------------------------------------------------------
# the campaign


def run(examples: int = 2000, seed: int = 0, *, progress: bool = False, flavor: Flavor = PLAIN) -> list[Row]:
    """``examples`` hostile checkpoints per campaign; a Row per campaign counting clean outcomes."""
    harness = Harness(flavor=flavor)
    rows = []
    try:
        for campaign, title in CAMPAIGNS.items():
            passed = unsealed = tampered = 0
            found: dict[tuple[str, str], list[Any]] = {}
            t0 = time.perf_counter()
            for i in range(examples):
                case = MUTATORS[campaign](harness.base, case_rng(seed, campaign, i))
                outcome = harness.run_case(case)
                if not outcome.violations:
                    passed += 1
                unsealed += case.must_reject
                tampered += case.must_reject and outcome.results.get("open") == "TamperedCheckpointError"
                keys = {}
                for v in outcome.violations:  # one count per example and kind of violation
                    keys.setdefault((v.kind, v.signature), v)
                for key, v in keys.items():
                    entry = found.setdefault(key, [0, i, v, case])
                    entry[0] += 1
                if progress and (i + 1) % 500 == 0:
                    print(f"  {campaign}: {i + 1}/{examples} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
            notes = []
            replay_flavor = "" if flavor is PLAIN else f" --flavor {flavor.name}"
            for (kind, sig), (count, first, v, case) in sorted(found.items(), key=lambda kv: -kv[1][0]):
                detail = v.detail.replace(harness.workdir, "<tmp>")
                notes.append(
                    f"{count}x {kind}: {sig} in {v.op} ({detail}); first: --seed {seed} "
                    f"--replay {campaign}:{first}{replay_flavor} [{_short(case.describe())}]"
                )
            if flavor.key is not None and campaign != "headers":
                notes.append(f"{unsealed} of them changed without re-sealing (no key): refused, {tampered} by the MAC")
            rows.append(Row(title + flavor.label, examples, passed, measure="clean error", notes=notes))
    finally:
        harness.close()
    return rows


def replay(spec: str, seed: int = 0, flavor: Flavor = PLAIN) -> str:
    campaign, _, index = spec.partition(":")
    harness = Harness(flavor=flavor)
    try:
        case = MUTATORS[campaign](harness.base, case_rng(seed, campaign, int(index)))
        outcome = harness.run_case(case)
    finally:
        harness.close()
    lines = [
        f"case: {case.describe()}",
        f"results: {outcome.results}",
        f"peak {outcome.peak / MiB:.2f} MiB (bound {outcome.bound / MiB:.2f} MiB), {outcome.seconds:.3f} s",
    ]
    lines += [f"VIOLATION {v}" for v in outcome.violations] or ["no violation"]
    return "\n".join(lines)


def table(rows: list[Row]) -> str:
    lines = ["| campaign | trials | clean | rate |", "|---|---:|---:|---:|"]
    lines += [f"| {r.campaign} | {r.trials} | {r.passed} | {r.rate} |" for r in rows]
    for r in rows:
        lines += [f"- {r.campaign}: {note}" for note in r.notes]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--examples", type=int, default=2000, help="hostile checkpoints per campaign")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--replay", metavar="CAMPAIGN:I", help="re-run one example and show it")
    parser.add_argument("--flavor", choices=sorted(FLAVORS), default="plain")
    args = parser.parse_args(argv)
    flavor = FLAVORS[args.flavor]
    if args.replay:
        print(replay(args.replay, args.seed, flavor))
        return
    t0 = time.perf_counter()
    rows = run(args.examples, args.seed, progress=True, flavor=flavor)
    print(table(rows))
    print(f"\n{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
