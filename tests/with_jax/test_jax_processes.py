"""Multi-process JAX (``jax.distributed``): every process writes the shards it addresses, one manifest is
committed, and any process count restores -- without torch.distributed.

Each job is real processes on this machine's CPU (``jax_processes.py``), with a coordination service on a
loopback port: two processes of four devices save, four of two restore, and this test's own process (one
of eight devices) reads and writes the same checkpoints.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("flax")  # with_jax/: the suite's JAX environment

import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import trainstate  # noqa: E402
from ranks import free_port  # noqa: E402

WORKER = Path(__file__).with_name("jax_processes.py")
ROOT = Path(__file__).resolve().parents[2]


def run_job(scenario: str, processes: int, devices: int, directory: Path) -> list[dict[str, Any]]:
    """Run ``scenario`` on ``processes`` JAX processes of ``devices`` CPU devices each; each one's result."""
    port = str(free_port())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), scenario, str(p), str(processes), str(devices), port, str(directory)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for p in range(processes)
    ]
    outs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=240)
            assert proc.returncode == 0, err[-3000:]
            outs.append(out)
    finally:
        for proc in procs:
            proc.kill()
    return [json.loads(out.split("RESULT ", 1)[1]) for out in outs]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """Two processes of four devices: a save on a 4x2 mesh, refusals, a manager run, and restores of that save
    and of one by this process (jax_processes.save)."""
    from jax_processes import state_on

    directory = tmp_path_factory.mktemp("jax-processes")
    single = state_on(jax.make_mesh((4, 2), ("x", "y")), P("x", "y"))  # one process of eight devices
    trainstate.save(directory / "single", single)
    return directory, run_job("save", processes=2, devices=4, directory=directory)


def expected() -> dict[str, np.ndarray]:
    from jax_processes import expected as values

    return values(0)


def test_each_process_writes_the_shards_it_addresses_and_one_manifest_commits(saved) -> None:
    directory, results = saved
    assert [r["fully_addressable"] for r in results] == [False, False]  # arrays spread over both processes
    files = sorted(p.name for p in (directory / "one").iterdir())
    assert {f.split("-")[1] for f in files if f.startswith("data-")} == {"r00000", "r00001"}
    assert files.count("manifest.json") == 1
    with trainstate.open(directory / "one") as ck:
        chunks = {name: ck.info(name).chunks for name in ck}
        assert ck.world_size == 2
    assert chunks["params.w"] == 2 and chunks["opt.m"] == 2  # a box per process, replicas within it once
    assert chunks["params.b"] == 1 and chunks["step"] == 1  # held whole by both: written once

    plain = trainstate.load(directory / "one")  # one process, NumPy: the whole arrays
    want = expected()
    for got, name in ((plain["params"]["w"], "w"), (plain["params"]["b"], "b"), (plain["opt"]["m"], "m")):
        assert got.dtype == want[name].dtype and np.array_equal(got, want[name]), name
    assert plain["step"] == 0 and np.array_equal(plain["key"], want["key"]) and plain["note"] == "hi"


def test_a_compressed_save_by_two_processes_restores_in_one(saved) -> None:
    pytest.importorskip("zstandard")
    from jax_processes import check, state_on, zeros_like

    directory, results = saved
    path = directory / "zstd"
    body = json.loads((path / "manifest.json").read_bytes())
    chunks = body["tensors"]["big"]["chunks"]
    assert body["world_size"] == 2 and len(chunks) >= 2
    assert all(c["transforms"][0]["name"] == "zstd" for c in chunks)
    assert {c["file"].split("-")[1] for c in chunks} == {"r00000", "r00001"}  # each process compressed its own
    with trainstate.open(path) as ck:
        ck.verify()
        assert np.array_equal(ck.read("big"), np.tile(np.arange(64, dtype=np.float32), (512, 1)))
    target = zeros_like(state_on(jax.make_mesh((2, 4), ("x", "y")), P("y", "x")))
    target["big"] = np.zeros((512, 64), np.float32)
    restored = trainstate.load(path, target)
    assert check(restored) == [] and np.array_equal(restored["big"], np.tile(np.arange(64, dtype=np.float32), (512, 1)))


def test_an_encrypted_save_by_two_processes_has_unique_nonces_and_restores_in_one(saved) -> None:
    pytest.importorskip("cryptography")
    pytest.importorskip("zstandard")
    from jax_processes import KEY, check, state_on, zeros_like

    directory, results = saved
    path = directory / "sealed"
    body = json.loads((path / "manifest.json").read_bytes())
    chunks = [c for t in body["tensors"].values() for c in t["chunks"]]
    assert body["world_size"] == 2 and "encryption" in body
    assert all(c["transforms"][-1]["name"] == "aes-256-gcm" for c in chunks)
    assert {c["file"].split("-")[1] for c in chunks} == {"r00000", "r00001"}  # each process encrypted its own
    nonces = [c["transforms"][-1]["nonce"] for c in chunks]
    assert len(set(nonces)) == len(nonces)
    with trainstate.open(path, key=KEY) as ck:
        ck.verify()
        assert np.array_equal(ck.read("big"), np.tile(np.arange(64, dtype=np.float32), (512, 1)))
    target = zeros_like(state_on(jax.make_mesh((2, 4), ("x", "y")), P("y", "x")))
    target["big"] = np.zeros((512, 64), np.float32)
    restored = trainstate.load(path, target, key=KEY)
    assert check(restored) == [] and np.array_equal(restored["big"], np.tile(np.arange(64, dtype=np.float32), (512, 1)))
    with pytest.raises(trainstate.KeyRequiredError):
        trainstate.load(path, zeros_like(state_on(jax.make_mesh((2, 4), ("x", "y")), P("y", "x"))))


def test_an_incremental_run_of_two_processes_shares_the_frozen_shards_and_restores_in_one(saved) -> None:
    pytest.importorskip("zstandard")
    directory, results = saved
    for got in results:
        written = {int(step): n for step, n in got["inc_written"].items()}  # JSON's keys are strings
        assert sorted(written) == [0, 1, 2] and all(written[s] < 0.5 * written[0] for s in (1, 2)), written
    newest = directory / "inc" / "step_00000002"
    body = json.loads((newest / "manifest.json").read_bytes())
    assert body["world_size"] == 2 and all(f["pool"] for f in body["files"])
    big = {c["file"] for c in body["tensors"]["big"]["chunks"]}
    assert {n.split("-")[2] for n in big} == {"r00000", "r00001"}  # each process wrote (once) its own shards
    first = json.loads((directory / "inc" / "step_00000001" / "manifest.json").read_bytes())
    assert big == {c["file"] for c in first["tensors"]["big"]["chunks"]}  # and later saves share them
    with trainstate.open(newest) as ck:
        ck.verify()
        assert np.array_equal(ck.read("big"), np.tile(np.arange(64, dtype=np.float32), (512, 1)))
        assert np.array_equal(ck.read("moving"), np.full((64, 8), 2.0, np.float32))


def test_a_global_sample_stream_two_processes_took_part_of_continues_in_one(saved) -> None:
    from trainstate._sample_stream import SampleStream

    directory, results = saved
    one = trainstate.GlobalBatches(60, global_batch_size=12, seed=4, world_size=1, micro_batches=4)
    trainstate.load(directory / "stream", {"data": one, "step": 0})
    assert one.state_dict()["batches"] == 3 and one.state_dict()["world_size"] == 1
    rest = [i for part in one for i in part.tolist()]
    order = SampleStream(60, 12, seed=4).order(0).tolist()
    # what the two processes took, global batch by global batch (process 0's slice, then process 1's)
    taken = [[i for r in (0, 1) for m in results[r]["stream_taken"][2 * b : 2 * b + 2] for i in m] for b in range(3)]
    assert [i for batch in taken for i in batch] + rest == order  # each sample once, in the global order


def test_one_process_restores_them_onto_one_device_and_onto_its_own_mesh(saved) -> None:
    from jax_processes import check, state_on, zeros_like

    directory, _ = saved
    for mesh, spec in (
        (jax.make_mesh((1, 1), ("x", "y"), devices=jax.devices()[:1]), P()),
        (jax.make_mesh((2, 4), ("x", "y")), P("y", "x")),
    ):
        restored = trainstate.load(directory / "one", zeros_like(state_on(mesh, spec)))
        assert check(restored) == []
        assert restored["params"]["w"].sharding.mesh == mesh


def test_one_process_resumes_the_managers_run_of_two_re_deriving_its_rng(saved, caplog) -> None:
    import logging
    import random

    from jax_processes import check, state_on, zeros_like

    caplog.set_level(logging.INFO, "trainstate")
    target = zeros_like(state_on(jax.make_mesh((4, 2), ("x", "y")), P("x", "y")))
    with trainstate.CheckpointManager(saved[0] / "run", read_only=True) as mgr:
        assert mgr.restore_latest(target) == 4
    got = random.random()
    assert check(target, step=3) == []
    assert "_rng: restoring on 1 process(es) a checkpoint 2 process(es) saved: rank 0's generators are re-derived" in (
        caplog.text
    )
    trainstate.RNGState().rederive(rank=0, step=3)  # the documented rule, seed 0: the same draws
    assert random.random() == got


def test_processes_that_pass_different_paths_are_refused(saved) -> None:
    for r in saved[1]:
        assert r["paths"].startswith("DistributedError: checkpoint save of ")
        assert "rank 1 saves to" in r["paths"] and "every rank passes the same path" in r["paths"]
    assert not [p for p in saved[0].iterdir() if p.name.startswith("path")]


def test_a_save_of_part_of_an_array_from_one_process_alone_is_refused(saved) -> None:
    _, results = saved
    for r in results:
        assert r["solo"].startswith("UnsupportedValueError: params.w: this process holds only part of it")
        assert "collective=False" in r["solo"]
        assert "do not form one box" in r["interleaved"] and "jax.make_mesh" in r["interleaved"]
    assert not [p for p in saved[0].iterdir() if p.name.startswith(("solo", "apart"))]  # nothing committed


def test_the_coordination_keys_are_deleted_as_the_processes_move_on(saved) -> None:
    _, results = saved
    exchanges, keys = results[0]["exchanges"], results[0]["store_keys"]
    assert exchanges > 60  # eleven saves and three managers' steps, each several exchanges
    left: dict[str, set[str]] = {}
    for key in keys:  # trainstate/<channel>/<exchange>/<process>, and trainstate/alive/<process>
        _, channel, *rest = key.split("/")
        if channel != "alive":
            left.setdefault(channel, set()).add(rest[0])
    assert len(left) == 6 and all(len(kept) <= 2 for kept in left.values()), keys  # the last exchange or two each


def test_a_process_that_never_comes_makes_the_save_time_out_not_hang(saved) -> None:
    directory, results = saved
    assert results[0]["alone"].startswith("DistributedError: checkpoint save (planning): process 0 of 2 lost contact")
    assert "within 3 s" in results[0]["alone"]
    assert not (directory / "alone").exists()
    # the process that came late is told, instead of pairing its save with whatever process 0 calls next
    assert results[1]["late"].startswith("DistributedError: checkpoint save (planning): the JAX processes are out")
    assert "process 0 gave up waiting in checkpoint save (planning) after 3 s" in results[1]["late"]
    assert not (directory / "late").exists()


def test_the_manager_saves_async_and_restores_latest_across_processes(saved) -> None:
    _, results = saved
    for r in results:
        assert r["restored_step"] == 4  # the step after the newest checkpoint, 3
        assert r["kept"] == [2, 3]  # keep_last=2, applied once (by process 0) for the job
        assert r["restored_bad"] == []  # every shard of every process holds step 3's values
        assert r["restored_sharding"] == "P('x', None)"  # the target's sharding, not the saver's


def test_any_process_count_restores(saved) -> None:
    _, results = saved  # two processes restore what two and what one saved (above: one restores two's)
    for r in results:
        assert r["one"] == [] and r["single"] == [] and r["abstract"] == [] and r["ring"] == []
        assert r["one_fully_addressable"] is False


def test_each_process_reads_only_its_own_devices_parts(saved) -> None:
    """Onto a 2x4 mesh with w and m split over "x" (one row of the mesh per process), each process reads
    its half of their columns, not the whole -- on the host path and through the restore ring alike;
    the arrays whole on each process (b over "y", the replicated step and key) are read whole."""
    _, results = saved
    for p, r in enumerate(results):
        for parts in (r["one_parts"], r["single_parts"], r["ring_parts"]):
            assert parts["params.w"] == parts["opt.m"] == [[0, 3 * p], [8, 3]], parts
            for name, shape in (("params.b", [8]), ("step", []), ("key", [2])):  # key: its key data's shape
                assert parts[name] in (None, [[0] * len(shape), shape]), parts
        assert r["one_parts"]["ring"] == [] and {"params.w", "opt.m", "key"} <= set(r["ring_parts"]["ring"])


@pytest.mark.slow  # four more processes; the two-process job above restores across process counts too
def test_four_processes_restore_what_two_and_one_saved(saved) -> None:
    results = run_job("load", processes=4, devices=2, directory=saved[0])
    for r in results:
        assert r["one"] == [] and r["single"] == [] and r["abstract"] == []
        assert r["one_fully_addressable"] is False
