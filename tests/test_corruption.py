"""Damaged checkpoints are caught: every flipped data byte, truncation, missing parts, lying manifests."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import trainstate
from helpers import reseal_manifest
from trainstate import _checksum as checksum


def _state():
    rng = np.random.default_rng(0)
    return {
        "a": rng.standard_normal((16, 8)).astype(np.float32),
        "b": np.arange(10, dtype=np.int64),
        "c": np.float32(1.5),
        "n": 3,
    }


@pytest.fixture
def ckpt(tmp_path):
    path = tmp_path / "c"
    trainstate.save(path, _state(), threads=1)
    return path


def test_every_flipped_data_byte_is_caught_on_load_or_verify(ckpt):
    data = ckpt / "data-00000.safetensors"
    original = data.read_bytes()
    for pos in range(len(original)):  # every byte of the file: header and tensor bytes
        flipped = bytearray(original)
        flipped[pos] ^= 1 << random.Random(pos).randrange(8)
        data.write_bytes(bytes(flipped))
        with pytest.raises(trainstate.CorruptCheckpointError):
            with trainstate.open(ckpt) as ck:
                ck.verify()
        with pytest.raises(trainstate.CorruptCheckpointError):
            trainstate.load(ckpt)  # plain load catches it too, header bytes included
        with pytest.raises(trainstate.CorruptCheckpointError):
            with trainstate.open(ckpt) as ck:
                ck.load()  # and so does open().load(): one load path, the same checks
    data.write_bytes(original)
    trainstate.load(ckpt)


def test_flipped_manifest_bytes_are_caught(ckpt):
    manifest = ckpt / "manifest.json"
    original = manifest.read_bytes()
    rnd = random.Random(1)
    for pos in rnd.sample(range(len(original) - 1), 300):  # the final newline cannot matter
        flipped = bytearray(original)
        flipped[pos] ^= 1 << rnd.randrange(8)
        manifest.write_bytes(bytes(flipped))
        with pytest.raises(trainstate.CorruptCheckpointError):
            trainstate.load(ckpt)


def test_truncated_data_file(ckpt):
    data = ckpt / "data-00000.safetensors"
    data.write_bytes(data.read_bytes()[:-3])
    with pytest.raises(trainstate.CorruptCheckpointError, match="truncated"):
        trainstate.open(ckpt)


def test_missing_checkpoint_and_missing_manifest(tmp_path, ckpt):
    with pytest.raises(trainstate.CheckpointNotFoundError):
        trainstate.load(tmp_path / "nope")
    with pytest.raises(FileNotFoundError):  # also a plain FileNotFoundError
        trainstate.open(tmp_path / "nope")
    (ckpt / "manifest.json").unlink()
    with pytest.raises(trainstate.IncompleteCheckpointError, match="never committed"):
        trainstate.load(ckpt)


def test_newer_major_version_is_refused(ckpt):
    reseal_manifest(ckpt, lambda b: b.update(format_version="2.0"))
    with pytest.raises(trainstate.FormatVersionError, match="upgrade trainstate"):
        trainstate.load(ckpt)


def test_unknown_transform_is_a_newer_writer_not_damage(ckpt):
    reseal_manifest(ckpt, lambda b: _first_chunk(b).update(transforms=[{"name": "brotli"}]))
    with pytest.raises(trainstate.FormatVersionError, match="does not know") as info:
        trainstate.load(ckpt, _state())
    assert not isinstance(info.value, trainstate.CorruptCheckpointError)


def test_newer_minor_version_loads(ckpt):
    reseal_manifest(ckpt, lambda b: b.update(format_version="1.7", future_field={"x": 1}))
    with trainstate.open(ckpt) as ck:
        assert ck.manifest.extra == {"future_field": {"x": 1}}
        assert np.array_equal(ck.read("b"), np.arange(10))


def _first_chunk(b):
    return b["tensors"]["a"]["chunks"][0]


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda b: _first_chunk(b).update(byte_range=[0, 10**12]), "outside|share bytes"),
        (lambda b: _first_chunk(b).update(byte_range=[8, 16]), "do not hold"),
        (lambda b: b["tensors"]["a"].update(shape=[1 << 40, 1 << 40]), "cover|too many elements"),
        (lambda b: b["tensors"]["a"].update(dtype="F128"), "unknown dtype"),
        (lambda b: b["tensors"]["a"].update(kind="pickle"), "unknown kind"),
        (lambda b: _first_chunk(b).update(file="../../etc/passwd"), "illegal data file"),
        (lambda b: b["files"][0].update(path="/etc/passwd"), "illegal data file"),
        (lambda b: _first_chunk(b).update(offset=[1, 0]), "exceeds"),
        (lambda b: b["tensors"]["a"].update(chunks=[]), "cover"),
        (lambda b: b.update(tree={"t": "pickle", "v": "cos\nsystem\n"}), "unknown tree node"),
        (lambda b: b.update(tree={"t": "tensor", "name": "zz"}), "does not list"),
        (lambda b: b["files"][0].update(size=-1), "negative|outside|size"),
    ],
)
def test_lying_manifests_are_refused(ckpt, edit, message):
    reseal_manifest(ckpt, edit)
    with pytest.raises(trainstate.CorruptCheckpointError, match=message):
        with trainstate.open(ckpt) as ck:
            ck.load()
    with pytest.raises(trainstate.CheckpointError):
        trainstate.load(ckpt, _state())


def test_deeply_nested_tree_is_refused(ckpt):
    deep: dict = {"t": "list", "v": []}
    node = deep
    for _ in range(300):
        child = {"t": "list", "v": []}
        node["v"].append(child)
        node = child
    reseal_manifest(ckpt, lambda b: b.update(tree=deep))
    with pytest.raises(trainstate.CorruptCheckpointError, match="deeper"):
        trainstate.load(ckpt)


def test_symlinked_data_file_is_refused(ckpt, tmp_path):
    data = ckpt / "data-00000.safetensors"
    outside = tmp_path / "outside.bin"
    os.replace(data, outside)
    os.symlink(outside, data)
    with pytest.raises(trainstate.CorruptCheckpointError, match="symlink"):
        trainstate.load(ckpt)


def test_checksums_can_be_skipped_for_speed(ckpt):
    data = ckpt / "data-00000.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    out = trainstate.load(ckpt, verify=False)  # the caller asked not to check: the damage shows in the data
    assert out["c"] != np.float32(1.5)  # the last stored tensor


def test_a_damaged_tensor_never_reaches_the_live_state(tmp_path):
    torch = pytest.importorskip("torch")
    model = torch.nn.Linear(64, 64)
    trainstate.save(tmp_path / "c", {"model": model}, threads=1)
    with trainstate.open(tmp_path / "c") as ck:
        chunk = ck.manifest.tensors["model.weight"].chunks[0]
    data = tmp_path / "c" / chunk.file
    raw = bytearray(data.read_bytes())
    raw[chunk.byte_range[0] + 100] ^= 0xFF
    data.write_bytes(bytes(raw))
    target = torch.nn.Linear(64, 64)
    with torch.no_grad():
        target.weight.fill_(7.0)
    with pytest.raises(trainstate.CorruptCheckpointError, match="(?s)model.weight.*partly restored"):
        trainstate.load(tmp_path / "c", {"model": target})
    assert bool((target.weight == 7.0).all())  # untouched, not half-overwritten with damaged bytes


_TRUNCATE_WHILE_OPEN = """
import os, sys
import numpy as np
import trainstate

path, how = sys.argv[1], sys.argv[2]
data = os.path.join(path, "data-00000.safetensors")


class Part:
    \"\"\"A stateful part of the target. With cut=True its state_dict() truncates the data file: a
    truncation that lands after the load opened the checkpoint and before it reads the tensors.\"\"\"

    def __init__(self, cut=False):
        self.w, self.cut = np.zeros(1 << 18, dtype=np.float32), cut

    def state_dict(self):
        if self.cut:
            os.truncate(data, 4096)
        return {"w": self.w}

    def load_state_dict(self, state):
        pass


try:
    if how == "load-during":
        trainstate.load(path, {"big": Part(cut=True), "small": np.zeros(8, dtype=np.int64)})
    else:
        ck = trainstate.open(path)
        os.truncate(data, 4096)  # mid-tensor: the file now ends inside "big"
        if how == "read":
            ck.read("big.w")
        elif how == "read-unverified":
            ck.read("big.w", verify=False).sum()
        elif how == "read-torch":
            ck.read("big.w", framework="torch")
        elif how == "read_into":
            ck.read_into("big.w", np.zeros(1 << 18, dtype=np.float32))
        elif how == "verify":
            ck.verify()
        elif how == "load":
            trainstate.load(path, {"big": Part(), "small": np.zeros(8, dtype=np.int64)})
except trainstate.CorruptCheckpointError as e:
    print("CorruptCheckpointError:", e)
    sys.exit(0)
print("no error")
sys.exit(3)
"""


class _Part:
    def state_dict(self):
        return {"w": np.arange(1 << 18, dtype=np.float32)}

    def load_state_dict(self, state):
        pass


@pytest.mark.parametrize("how", ["read", "read-unverified", "read-torch", "read_into", "verify", "load", "load-during"])
def test_a_data_file_truncated_while_open_is_corrupt_not_a_crash(tmp_path, how):
    """Reads go through a memory map made at open; touching it past a file's new end is SIGBUS, which
    kills the process. Run in a child so a crash shows up as a failure here, not as a dead pytest."""
    pytest.importorskip("torch")
    path = tmp_path / "c"
    trainstate.save(path, {"big": _Part(), "small": np.arange(8, dtype=np.int64)}, threads=1)
    src = str(Path(trainstate.__file__).parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_TRUNCATE_WHILE_OPEN), str(path), how],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, f"exit {proc.returncode} (-7 is SIGBUS)\n{proc.stdout}{proc.stderr}"
    assert "data-00000.safetensors" in proc.stdout and "truncated" in proc.stdout, proc.stdout


# ------------------------------------------------------------------------------------------------
# a manifest cannot make the reader build much more memory than its bytes


def forge_manifest(path, junk: bytes) -> int:
    """Make ``junk`` (JSON text) the manifest's metadata and re-seal it with a valid checksum, the way a
    forger would (bytes, not Python objects, so the test itself stays small); returns the manifest's size."""
    body = json.loads((path / "manifest.json").read_bytes())
    body.pop("checksum")
    body["metadata"] = "JUNK"
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode().replace(b'"JUNK"', junk)
    raw = b'{"checksum":' + json.dumps(checksum.digest(canonical)).encode() + b"," + canonical[1:] + b"\n"
    (path / "manifest.json").write_bytes(raw)
    return len(raw)


@pytest.mark.parametrize("unit", [b"[],", b'{"a":[]},', b"[[0]],"])
def test_a_manifest_costly_to_parse_is_refused_before_parsing(ckpt, unit):
    import tracemalloc

    n = (12 << 20) // len(unit)
    size = forge_manifest(ckpt, b"[" + unit * n + b"0]")  # ~12 MB; json.loads would build 0.25-0.35 GB
    tracemalloc.start()
    try:
        with pytest.raises(trainstate.CorruptCheckpointError, match="to parse"):
            trainstate.open(ckpt)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3 * size


def test_legit_manifests_stay_within_the_parse_cost_per_byte(tmp_path, monkeypatch, training_state):
    from trainstate._format import manifest, manifest_limits

    monkeypatch.setattr(manifest_limits, "PARSE_COST_ALLOWANCE", 0)  # the per-byte bound alone
    states = {
        "training": training_state,
        "many tensors": [np.full(2, i, np.float32) for i in range(5000)],  # the shortest names
        "plain values": {
            "epoch": 3,
            "losses": [0.5 + i / 7 for i in range(2000)],
            "order": list(range(100_000, 105_000)),
            "cfg": {"lr": 1e-3, "tags": ["a", "b"]},
        },
    }
    for name, state in states.items():
        path = tmp_path / name.replace(" ", "-")
        trainstate.save(path, state)
        raw = (path / "manifest.json").read_bytes()
        assert manifest_limits.parse_cost(raw) <= 0.8 * manifest_limits.PARSE_COST_PER_BYTE * len(raw), (
            name
        )  # with room
        with trainstate.open(path) as ck:
            assert len(ck.keys()) == len(manifest.parse(raw).tensors)


def test_a_state_whose_manifest_readers_would_refuse_is_not_saved(tmp_path, monkeypatch):
    from trainstate._format import manifest_limits

    monkeypatch.setattr(manifest_limits, "PARSE_COST_ALLOWANCE", 0)  # stands for a state 1,000 times as large
    with pytest.raises(trainstate.UnsupportedValueError, match="store long lists of numbers as arrays"):
        trainstate.save(tmp_path / "c", {"w": np.zeros(3), "seen": [[] for _ in range(5000)]})
    assert not (tmp_path / "c").exists()
