"""The default thread count: this process's share of the cores it may use (trainstate._cores)."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import pytest

import trainstate
from trainstate import _cores


@pytest.mark.parametrize(
    ("environ", "cores", "expected"),
    [
        ({}, 16, 16),  # one process on a 16-core host: every core
        ({"LOCAL_WORLD_SIZE": "8"}, 64, 8),  # 8 ranks on 64 cores: 8 each
        ({"LOCAL_WORLD_SIZE": "8"}, 4, 1),  # more ranks than cores: still one thread each
        ({}, 128, _cores.MAX_DEFAULT),  # more cores than a checkpoint keeps busy
        ({"TRAINSTATE_THREADS": "3", "LOCAL_WORLD_SIZE": "8"}, 64, 3),  # set outright
        ({"TRAINSTATE_THREADS": "zero", "LOCAL_WORLD_SIZE": "-2"}, 16, 16),  # nonsense is ignored, never fatal
        ({"TRAINSTATE_THREADS": "0"}, 2, 2),
    ],
)
def test_the_default_is_this_process_s_share_of_its_cores(environ, cores, expected):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _cores.default_threads(environ, cores) == expected
    bad = environ.get("TRAINSTATE_THREADS") in ("zero", "0")
    assert [str(w.message)[:18] for w in caught] == (["TRAINSTATE_THREADS"] if bad else [])  # said, not fatal


def test_usable_cores_are_the_affinity_mask_not_the_machine_s_count():
    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("no sched_getaffinity here")
    assert _cores.usable_cores() == len(os.sched_getaffinity(0))


def test_every_entry_point_defaults_to_it():
    for fn in (trainstate.save, trainstate.load, trainstate.CheckpointManager):
        assert inspect.signature(fn).parameters["threads"].default == _cores.DEFAULT_THREADS, fn


def test_a_process_pinned_to_one_core_or_launched_beside_others_defaults_to_its_share():
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no sched_setaffinity here")
    code = "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
    code += "from trainstate import _cores; print(_cores.default_threads())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "1"
    env = {**os.environ, "TRAINSTATE_THREADS": "5"}
    code = "from trainstate import _cores; print(_cores.DEFAULT_THREADS)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    assert out.strip() == "5"


def test_verify_and_open_default_to_it_too():
    from trainstate._restore.checkpoint import Checkpoint

    assert inspect.signature(Checkpoint.verify).parameters["threads"].default == _cores.DEFAULT_THREADS
    assert inspect.signature(Checkpoint.read_many).parameters["threads"].default == _cores.DEFAULT_THREADS


def test_consolidate_takes_fewer_threads_where_tensors_would_not_fit_in_memory():
    assert inspect.signature(trainstate.consolidate).parameters["threads"].default is None  # decided per source
    gib = 1 << 30
    assert _cores.threads_within(gib, threads=16, available=64 * gib) == 16  # 16 GiB of 64: fits
    assert _cores.threads_within(gib, threads=16, available=8 * gib) == 2  # a quarter of 8 GiB: two tensors
    assert _cores.threads_within(40 * gib, threads=16, available=8 * gib) == 1  # never fewer than one
    assert _cores.threads_within(gib, threads=16, available=0) == 16  # unknown memory: the core count


def test_verify_on_many_lanes_finds_a_damaged_byte_in_the_last_lane(tmp_path):
    import json

    import numpy as np

    state = {f"t{i}": np.arange(300_000, dtype=np.float32) + i for i in range(8)}
    trainstate.save(tmp_path / "c", state)
    with trainstate.open(tmp_path / "c") as ck:
        ck.verify(threads=4)
    body = json.loads((tmp_path / "c" / "manifest.json").read_text())
    chunks = sorted((c["file"], c["byte_range"][1]) for t in body["tensors"].values() for c in t["chunks"])
    file, end = chunks[-1]  # the last bytes of the last file: the last lane reads them
    with open(tmp_path / "c" / file, "r+b") as f:
        f.seek(end - 3)
        b = f.read(1)
        f.seek(end - 3)
        f.write(bytes([b[0] ^ 1]))
    with trainstate.open(tmp_path / "c") as ck, pytest.raises(trainstate.CorruptCheckpointError):
        ck.verify(threads=4)
