"""Hostile checkpoints: only trainstate's own errors come out, and nothing else happens.

Fuzzes the manifest (structure, re-sealed with a correct checksum; raw bytes) and the data-file headers
with the mutators and checks of tools/reliability/fuzz.py, driven by hypothesis. For every example
``trainstate.load`` and ``trainstate.open`` (+ keys, metadata, info, read of every listed name, verify)
must raise nothing but ``CheckpointError``, open nothing outside the checkpoint, write nothing, import or
run nothing, allocate no more than the files' size allows (tracemalloc) and finish within 2 s.

Violations the fuzzer found are kept as regression repros at the end of this file (all fixed);
the property tests tolerate no violation at all.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tools.reliability import fuzz  # the repository root is on sys.path (pyproject: pythonpath)

import trainstate

MANIFEST = fuzz.MANIFEST

pytestmark = pytest.mark.campaign  # run at test size; `-m "not campaign"` for a quick loop


@pytest.fixture(scope="module")
def harness():
    h = fuzz.Harness(slow_after=2.0, hang_after=5.0, many_chunks=False)
    yield h
    h.close()


# ------------------------------------------------------------------------------------------------
# violations tolerated by the property tests: none

KNOWN_EXCEPTIONS: dict[str, str] = {}  # none left: every violation the fuzzer found is fixed (see below)
SHARED_BYTES_OPS: set[str] = set()


def _known(v: fuzz.Violation, case: fuzz.Case) -> bool:
    if v.kind == "exception":
        return v.signature in KNOWN_EXCEPTIONS
    if v.kind == "allocation":
        return bool(case.ops & SHARED_BYTES_OPS)
    return False


def _assert_clean(outcome: fuzz.Outcome, case: fuzz.Case) -> None:
    new = [str(v) for v in outcome.violations if not _known(v, case)]
    assert not new, f"{case.describe()}\n" + "\n".join(new)


FUZZ = settings(
    max_examples=150,
    deadline=2000,
    database=None,
    derandomize=True,
    print_blob=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@FUZZ
@given(rnd=st.randoms(use_true_random=False))
def test_hostile_manifest_structure_resealed(harness, rnd):
    case = fuzz.structure_case(harness.base, rnd)
    _assert_clean(harness.run_case(case), case)


@FUZZ
@given(rnd=st.randoms(use_true_random=False))
def test_hostile_manifest_bytes(harness, rnd):
    case = fuzz.bytes_case(harness.base, rnd)
    _assert_clean(harness.run_case(case), case)


@FUZZ
@given(rnd=st.randoms(use_true_random=False))
def test_hostile_data_file_headers(harness, rnd):
    case = fuzz.headers_case(harness.base, rnd)
    _assert_clean(harness.run_case(case), case)


# ------------------------------------------------------------------------------------------------
# the checks themselves can fail: a loader that misbehaves is caught


def _misbehave(kind: str, harness) -> Callable[[str], None]:
    def act(path: str) -> None:
        if kind == "exception":
            raise RuntimeError("not a CheckpointError")
        if kind == "outside-open":
            open(os.path.join(harness.workdir, "elsewhere"), "a").close()
        if kind == "write":
            os.mkdir(os.path.join(path, "new-dir"))
        if kind == "code":  # import a module no other test can have imported already
            import importlib
            import uuid

            name = f"trainstate_probe_{uuid.uuid4().hex}"
            with open(os.path.join(harness.workdir, f"{name}.py"), "w") as f:
                f.write("X = 1\n")
            sys.path.insert(0, harness.workdir)
            try:
                importlib.import_module(name)
            finally:
                sys.path.remove(harness.workdir)
                sys.modules.pop(name, None)
        if kind == "allocation":
            import numpy as np

            np.ones(64 << 20, dtype=np.uint8)
        if kind == "hang":
            import time

            time.sleep(3)

    return act


@pytest.mark.parametrize("kind", ["exception", "outside-open", "write", "code", "allocation", "hang"])
def test_the_checks_catch_a_misbehaving_loader(harness, monkeypatch, kind):
    real_load = trainstate.load
    act = _misbehave(kind, harness)

    def load(path, *args, **kwargs):
        act(os.fspath(path))
        return real_load(path, *args, **kwargs)

    monkeypatch.setattr(trainstate, "load", load)
    path = harness.write(dict(harness.base.files))
    try:
        outcome = fuzz.Checker(harness.base, hang_after=1.0).check(path)
    finally:
        shutil.rmtree(path, ignore_errors=True)
    assert kind in {v.kind for v in outcome.violations if v.op in ("load", "any")}, outcome.violations


# ------------------------------------------------------------------------------------------------
# the base checkpoint, and code that must never run


def test_base_checkpoint_reads_cleanly_and_runs_no_code(harness):
    outcome = harness.run_files(dict(harness.base.files))
    assert outcome.violations == []
    assert {op: r for op, r in outcome.results.items() if r != "ok"} == {"read-unlisted": "UnknownKeyError"}
    path = harness.write(dict(harness.base.files))
    try:
        tree = trainstate.load(path)
    finally:
        shutil.rmtree(path)
    assert tree["payload"] == tree["payload_arr"].tobytes()  # the pickle comes back as bytes, not unpickled
    assert tree["pickled"] == tree["payload"]
    assert tree["os_system"].startswith("touch ")  # a stateful node decodes to its state; its type is a label
    assert tree["sentinel"] == {"x": 1}
    assert fuzz.SENTINEL not in sys.modules
    assert not os.path.exists(harness.base.pwned_marker)


def _sealed(harness, edit: Callable[[dict], Any], ops: set[str] | None = None) -> fuzz.Case:
    body = json.loads(harness.base.manifest)
    body.pop("checksum")
    edit(body)
    return fuzz.Case("structure", {**harness.base.files, MANIFEST: fuzz.seal(body)}, ["by hand"], ops or set())


def test_stateful_types_are_labels_never_imports(harness):
    def edit(body):
        bait = f"{fuzz.SENTINEL}.Boom"
        body["tree"] = {"t": "stateful", "type": bait, "v": body["tree"]}
        body["metadata"] = {"t": "stateful", "type": "os.system", "v": body["metadata"]}

    case = _sealed(harness, edit)
    outcome = harness.run_case(case)
    assert outcome.violations == []
    assert outcome.results["load"] == "ok"
    assert fuzz.SENTINEL not in sys.modules


# ------------------------------------------------------------------------------------------------
# symlinks, special files, names: refused, and nothing outside is opened


def _replace_with(kind: str, name: str, outside: str) -> Callable[[str], None]:
    def prepare(path: str) -> None:
        target = os.path.join(path, name)
        if kind == "symlink-outside":  # same bytes, same size: only the link itself is wrong
            shutil.copyfile(target, outside)
            os.remove(target)
            os.symlink(outside, target)
        elif kind == "symlink-relative":
            shutil.copyfile(target, outside)
            os.remove(target)
            os.symlink(os.path.relpath(outside, path), target)
        elif kind == "symlink-dev-zero":
            os.remove(target)
            os.symlink("/dev/zero", target)
        elif kind == "symlink-dangling":
            os.remove(target)
            os.symlink(outside + ".missing", target)
        elif kind == "fifo":
            os.remove(target)
            os.mkfifo(target)
        elif kind == "directory":
            os.remove(target)
            os.mkdir(target)

    return prepare


@pytest.mark.parametrize(
    "kind", ["symlink-outside", "symlink-relative", "symlink-dev-zero", "symlink-dangling", "fifo", "directory"]
)
@pytest.mark.parametrize("which", ["data", "manifest"])
def test_links_and_special_files_are_refused(harness, kind, which):
    name = harness.base.data_files[0] if which == "data" else MANIFEST
    outside = os.path.join(harness.workdir, f"outside-{which}-{kind}")
    outcome = harness.run_files(dict(harness.base.files), _replace_with(kind, name, outside))
    assert outcome.violations == []
    for op in ("load", "open"):
        assert outcome.results[op] == "CorruptCheckpointError", (op, outcome.results)


@pytest.mark.parametrize(
    "bad",
    [
        "../data-00000.safetensors",
        "/etc/passwd",
        "manifest.json",
        ".hidden",
        "a/b",
        "",
        "..",
        "data-00000.safetensors\x00x",
        "x" * 202,
        7,
        None,
    ],
)
def test_hostile_file_names_are_refused(harness, bad):
    def edit(body):
        old = body["files"][0]["path"]
        body["files"][0]["path"] = bad
        for t in body["tensors"].values():
            for c in t["chunks"]:
                if c["file"] == old:
                    c["file"] = bad

    case = _sealed(harness, edit)
    outcome = harness.run_case(case)
    assert outcome.violations == []
    assert outcome.results["load"] == outcome.results["open"] == "CorruptCheckpointError"


@pytest.mark.parametrize("transforms", [None, [{"name": "zstd"}]])
@pytest.mark.parametrize("dtype", ["U8", "F32", "C128"])
def test_a_2_pow_40_element_tensor_fails_before_allocating(harness, dtype, transforms):
    def edit(body):
        n = 2**40
        c = body["tensors"]["w"]["chunks"][0]
        body["tensors"]["w"].update(dtype=dtype, shape=[n])
        c.update(shape=[n], offset=[0])
        if transforms:
            c["transforms"] = transforms

    outcome = harness.run_case(_sealed(harness, edit))
    assert outcome.violations == []
    assert outcome.results["load"] in ("CorruptCheckpointError", "FormatVersionError")
    assert outcome.results["read"] in ("CorruptCheckpointError", "FormatVersionError")
    assert outcome.peak < 1 << 20  # nothing near the claimed size was allocated


def test_a_huge_header_length_is_refused_without_allocating(harness):
    name = harness.base.data_files[0]
    data = bytearray(harness.base.files[name])
    data[:8] = (2**64 - 1).to_bytes(8, "little")
    case = fuzz.Case("headers", {**harness.base.files, name: bytes(data)}, ["N = 2^64-1"], must_fail_verify=True)
    outcome = harness.run_case(case)
    assert outcome.violations == []
    assert outcome.results["verify"] == "CorruptCheckpointError"
    assert outcome.peak < 1 << 20


# ------------------------------------------------------------------------------------------------
# violations the fuzzer found, fixed in the reader; one minimal repro each stays as a regression test


def _repro(harness, edit, ops=None, checker=None) -> None:
    case = _sealed(harness, edit, ops)
    path = harness.write(case.files)
    try:
        outcome = (checker or harness.checker).check(path, case)
    finally:
        shutil.rmtree(path, ignore_errors=True)
    assert outcome.violations == [], "\n".join(map(str, outcome.violations))


@pytest.mark.parametrize("where", ["entry", "chunk"])
def test_fixed_lazy_validation_missing_field(harness, where):
    def edit(body):
        if where == "entry":
            del body["tensors"]["b"]["kind"]
        else:
            del body["tensors"]["b"]["chunks"][0]["offset"]

    _repro(harness, edit)


@pytest.mark.parametrize("transforms", [None, 5, [{"name": []}]])
def test_fixed_lazy_validation_bad_transforms(harness, transforms):
    _repro(harness, lambda body: body["tensors"]["b"]["chunks"][0].__setitem__("transforms", transforms))


@pytest.mark.parametrize("shape", [[0, 2**63], [0, 2**62], [0] * 65, [10] + [1] * 64])
def test_fixed_shape_beyond_numpy(harness, shape):
    def edit(body):
        t = body["tensors"]["e" if 0 in shape else "b"]
        t["shape"] = list(shape)
        t["chunks"][0].update(shape=list(shape), offset=[0] * len(shape))

    _repro(harness, edit)


def test_fixed_huge_created(harness):
    _repro(harness, lambda body: body.__setitem__("created", 10**400))


def test_fixed_long_format_version(harness):
    _repro(harness, lambda body: body.__setitem__("format_version", "1" * 5000 + ".0"))


def test_fixed_shared_bytes_tiled_chunks(harness):
    def edit(body):
        t = body["tensors"]["w"]
        c = t["chunks"][0]
        t["shape"] = [128 * 300, 128]
        t["chunks"] = [dict(c, offset=[128 * i, 0]) for i in range(300)]

    _repro(harness, edit, {"tile"})


def test_fixed_shared_bytes_aliased_tensors(harness):
    def edit(body):
        for i in range(300):
            body["tensors"][f"w{i}"] = body["tensors"]["w"]
            body["tree"]["v"].append([f"w{i}", {"t": "tensor", "name": f"w{i}"}])

    _repro(harness, edit, {"alias"})


def test_fixed_quadratic_chunk_check(harness):
    def edit(body):
        t = body["tensors"]["b"]
        c = t["chunks"][0]
        begin = c["byte_range"][0]
        t["shape"] = [4000]
        t["chunks"] = [dict(c, byte_range=[begin, begin + 8], offset=[i], shape=[1]) for i in range(4000)]

    _repro(harness, edit, checker=fuzz.Checker(harness.base, slow_after=2.0, hang_after=2.0))
