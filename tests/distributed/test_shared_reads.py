"""Each byte read once per job: a collective load on real gloo ranks reads what the ranks hold in common once,
spread over the ranks, and sends it to the others (issue 27). Read amplification = the data bytes every rank
read from storage, summed / the tensor bytes of the checkpoint; a counting storage measures it."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed")

import dist_workers_share as workers  # noqa: E402
import ranks  # noqa: E402
import trainstate  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is missing")
WORLD = 4


def _amplification(results: list[dict], what: str) -> float:
    ratio = sum(r["read"] for r in results) / workers.tensor_bytes()
    print(f"read amplification, {WORLD} ranks, {what}: {ratio:.3f}")
    return ratio


def _all_equal(results: list[dict]) -> None:
    want = workers.as_arrays(workers.replicas())
    for r in results:
        assert r["step"] == 3
        for k, v in want.items():
            assert r["values"][k].tobytes() == v.tobytes(), k  # bit for bit


@pytest.mark.parametrize("saved_by", ["one process", "a collective save"])
def test_ddp_replicas_are_read_once_spread_over_the_ranks_and_every_rank_gets_them_bit_for_bit(tmp_path, saved_by):
    path = str(tmp_path / "c")
    if saved_by == "one process":
        trainstate.save(path, {"model": workers.replicas(), "step": 3})
    else:
        ranks.ok(ranks.run(WORLD, workers.save_replicas, path, None))
    shared = ranks.ok(ranks.run(WORLD, workers.load_replicas, path, None, None))
    _all_equal(shared)
    assert _amplification(shared, f"local, shared ({saved_by})") <= 1.05
    total = workers.tensor_bytes()
    assert all(r["read"] < 0.5 * total for r in shared), [r["read"] for r in shared]  # spread, not one reader
    alone = ranks.ok(ranks.run(WORLD, workers.load_replicas, path, None, False))
    _all_equal(alone)
    assert _amplification(alone, f"local, collective=False ({saved_by})") >= WORLD - 0.05


def test_a_load_without_a_target_shares_its_reads_too(tmp_path):
    path = str(tmp_path / "c")
    trainstate.save(path, {"model": workers.replicas(), "step": 3})
    got = ranks.ok(ranks.run(WORLD, workers.load_without_target, path))
    _all_equal(got)
    assert _amplification(got, "local, no target") <= 1.05


def test_fsdp_boxes_share_nothing_replicated_boxes_are_read_once_and_each_rank_gets_its_own(tmp_path):
    path = str(tmp_path / "c")
    trainstate.save(path, {"model": workers.replicas(), "step": 3})
    got = ranks.ok(ranks.run(WORLD, workers.load_boxes, path, True))
    assert all(all(r["ok"].values()) for r in got), got
    alone = ranks.ok(ranks.run(WORLD, workers.load_boxes, path, False))
    assert all(all(r["ok"].values()) for r in alone), alone
    # A box is read (and checked) through the chunks that cover it, the same with or without sharing (each
    # of these chunks is under a piece: read whole). The replicated tensor is read once instead of 4 times,
    # the HSDP tensor's two boxes twice instead of 4 times.
    full = workers.replicas()
    saved = 3 * full["w00"].numel() * 4 + 2 * full["w10"].numel() * 4
    assert sum(r["read"] for r in alone) - sum(r["read"] for r in got) == saved


def test_a_damaged_byte_in_a_shared_tensor_fails_every_rank_and_reaches_no_rank(tmp_path):
    path = tmp_path / "c"
    trainstate.save(path, {"model": workers.replicas(), "step": 3})
    body = json.loads((path / "manifest.json").read_bytes())
    damaged = "model.w05"
    chunk = body["tensors"][damaged]["chunks"][0]
    begin, end = chunk["byte_range"]
    data = path / chunk["file"]
    raw = bytearray(data.read_bytes())
    raw[(begin + end) // 2] ^= 0xFF  # the manifest's byte ranges are the file's offsets
    data.write_bytes(bytes(raw))
    results = ranks.ok(ranks.run(WORLD, workers.load_damaged, str(path), "w05"))
    for rank, r in enumerate(results):
        assert r["kind"] == "CorruptCheckpointError", (rank, r)
        assert "w05" in r["message"], (rank, r["message"][:300])
        assert r["untouched"], rank  # the owner wrote no byte that failed its checksum; the others got nothing


@pytest.mark.parametrize("unverified", [0, 1])
def test_a_rank_that_verifies_never_takes_bytes_a_rank_read_with_verify_false(tmp_path, unverified):
    # w19 is the biggest tensor: with 2 ranks its owner would be rank 0. Whichever rank skips the checksums,
    # the other one checks its own copy: it raises, and its live state keeps its values.
    path = tmp_path / "c"
    trainstate.save(path, {"model": workers.replicas(), "step": 3})
    chunk = json.loads((path / "manifest.json").read_bytes())["tensors"]["model.w19"]["chunks"][0]
    data = path / chunk["file"]
    raw = bytearray(data.read_bytes())
    raw[sum(chunk["byte_range"]) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    got = ranks.ok(ranks.run(2, workers.load_damaged_unverified_elsewhere, str(path), "w19", unverified))
    checking = got[1 - unverified]
    assert checking["kind"] == "CorruptCheckpointError", got
    assert checking["untouched"], got


def test_a_state_that_does_not_fit_on_one_rank_fails_every_rank_before_any_byte_is_read(tmp_path):
    path = str(tmp_path / "c")
    trainstate.save(path, {"model": workers.replicas(), "step": 3})
    got = ranks.ok(ranks.run(2, workers.load_mismatched_on_rank_1, path))
    assert got[1]["kind"] == "StateMismatchError" and "w03" in got[1]["message"], got[1]
    assert got[0]["kind"] == "DistributedError" and "rank 1" in got[0]["message"], got[0]
    assert "StateMismatchError" in got[0]["message"] and "w03" in got[0]["message"]
    assert all(r["read"] < 4096 for r in got), got  # the data files' headers (checked at open), no tensor


def test_a_rank_told_of_another_ranks_mismatch_leaves_its_fresh_optimizer_as_it_was(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 8)).sum().backward()
    optim.step()
    trainstate.save(tmp_path / "c", {"model": model, "optim": optim, "step": 1})
    got = ranks.ok(ranks.run(2, workers.load_optimizer_mismatched_on_rank_1, str(tmp_path / "c")))
    assert [r["kind"] for r in got] == ["DistributedError", "StateMismatchError"], got
    assert [r["optim_state"] for r in got] == [0, 0]


def test_owners_are_chosen_biggest_first_by_bytes_with_ties_to_the_lowest_rank():
    from trainstate._restore.shared import Key, assign

    big, mid, small, own = (Key(c, c, None, n) for c, n in (("big", 100), ("mid", 60), ("small", 50), ("own", 30)))
    listed = [[big, mid, small], [big, mid, small, own], [big, small]]
    owners = assign(listed)
    assert own not in owners  # one holder: read by it, nothing sent
    # rank 1 starts with 30 bytes of its own: big -> 0 (ties 0 and 2 at 0 bytes), mid -> 1 (30 < 100),
    # small -> 2 (0 bytes so far)
    assert owners == {big: (0, (0, 1, 2)), mid: (1, (0, 1)), small: (2, (0, 1, 2))}
    assert assign([list(reversed(keys)) for keys in listed]) == owners  # the order a rank lists in is no matter


def test_collective_takes_a_bool(tmp_path):
    trainstate.save(tmp_path / "c", {"w": np.ones(3)})
    with pytest.raises(trainstate.InvalidArgumentError, match="collective must be True or False"):
        trainstate.load(tmp_path / "c", collective="yes")
    assert trainstate.load(tmp_path / "c", collective=True)["w"].tolist() == [1.0, 1.0, 1.0]  # no group: alone


@pytest.mark.parametrize("again", [False, True], ids=["first load", "after a load"])
def test_a_rank_that_does_not_load_makes_the_others_raise_a_distributed_error_not_hang(tmp_path, again):
    path = str(tmp_path / "c")
    trainstate.save(path, {"model": workers.replicas(), "step": 3})
    results = ranks.run(2, workers.load_on_rank_0_only, path, again, timeout=120)
    assert results[1] == "skipped" and isinstance(results[0], ranks.RankError), results
    assert results[0].kind == "DistributedError", results[0]
    assert "collective=False" in results[0].message if not again else "within 5 s" in results[0].message


def test_the_managers_restore_latest_shares_its_reads(tmp_path):
    got = ranks.ok(ranks.run(WORLD, workers.manager_save_and_restore, str(tmp_path / "run")))
    assert all(r["same"] and r["start"] == 5 for r in got), got
    assert _amplification([{"read": r["read"]} for r in got], "local, CheckpointManager.restore_latest") <= 1.05


# -- the same against S3 (moto on loopback, through s3fs) ----------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    from tools.s3_server import AWS_ISOLATION, MotoServer

    mp = pytest.MonkeyPatch()
    for k, v in AWS_ISOLATION.items():  # the spawned ranks inherit these: boto looks nowhere real
        mp.setenv(k, v)
    try:
        with MotoServer(tmp_path_factory.mktemp("moto") / "server.log") as s:
            s.create_bucket("trainstate-shared-reads")
            yield s
    finally:
        mp.undo()


def test_on_s3_ddp_replicas_are_read_once(server):
    url = f"s3://trainstate-shared-reads/{uuid.uuid4().hex[:12]}/step_3"
    endpoint = server.endpoint  # type: ignore[attr-defined]
    ranks.ok(ranks.run(WORLD, workers.save_replicas, url, endpoint))
    _read_once_shared_and_world_times_alone("s3", workers.load_replicas, url, endpoint)


def _read_once_shared_and_world_times_alone(label: str, load: Any, *args: Any) -> None:
    """``load(rank, world, *args, collective, ...)`` on every rank: each byte read once with sharing (the
    default), WORLD times with ``collective=False``; every rank's values the same, bit for bit."""
    shared = ranks.ok(ranks.run(WORLD, load, *args, None))
    _all_equal(shared)
    assert _amplification(shared, f"{label}, shared") <= 1.05
    alone = ranks.ok(ranks.run(WORLD, load, *args, False))
    _all_equal(alone)
    assert _amplification(alone, f"{label}, collective=False") >= WORLD - 0.05


def test_no_rank_shares_with_a_rank_that_loads_another_checkpoint(tmp_path):
    """Per-rank checkpoints with the same names, loaded collectively: parts match by content, not by name."""
    for rank in range(2):
        trainstate.save(tmp_path / f"c{rank}", {"model": {"w": np.full((64, 8), float(rank), np.float32)}, "step": 3})
    got = ranks.ok(ranks.run(2, workers.load_own, str(tmp_path)))
    assert got == [0.0, 1.0]


def test_accelerator_targets_are_read_once_and_cross_in_pieces_through_host_buffers(tmp_path):
    """The GPU path's sharing, run with CPU tensors standing in for accelerator ones (ring + pieces)."""
    path = str(tmp_path / "c")
    trainstate.save(path, {"model": workers.replicas(), "step": 3})
    _read_once_shared_and_world_times_alone("accelerator targets", workers.load_replicas_on_devices, path)


def test_an_accelerator_part_held_twice_on_a_rank_gets_its_bytes_in_both_places(tmp_path):
    path = str(tmp_path / "c")
    model = workers.replicas()
    trainstate.save(path, {"model": model, "step": 3, "copy_of_w03": model["w03"]})  # tied: stored once
    results = ranks.ok(ranks.run(WORLD, workers.load_replicas_on_devices, path, None, True))
    for r in results:
        assert r["values"]["copy_of_w03"].tobytes() == model["w03"].numpy().tobytes()
        assert r["values"]["w03"].tobytes() == model["w03"].numpy().tobytes()
    assert _amplification(results, "accelerator targets, one part twice per rank") <= 1.05


def test_a_damaged_byte_in_a_shared_accelerator_tensor_reaches_no_rank(tmp_path):
    path = tmp_path / "c"
    trainstate.save(path, {"model": workers.replicas(), "step": 3})
    body = json.loads((path / "manifest.json").read_bytes())
    chunk = body["tensors"]["model.w05"]["chunks"][0]
    begin, end = chunk["byte_range"]
    data = path / chunk["file"]
    raw = bytearray(data.read_bytes())
    raw[(begin + end) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    results = ranks.ok(ranks.run(WORLD, workers.load_damaged_on_devices, str(path), "w05"))
    for rank, r in enumerate(results):
        assert r["kind"] == "CorruptCheckpointError", (rank, r)
        assert r["untouched"], rank


def test_a_rank_that_dies_after_it_came_is_named_within_seconds_not_waited_for(tmp_path):
    """torch's new_group waits for a rank that died after it arrived for as long as the store allows (half an
    hour and more): the others watch its heartbeat from a store connection of their own and raise."""
    path = str(tmp_path / "c")
    trainstate.save(path, {"model": workers.replicas(), "step": 3})
    results = ranks.run(3, workers.load_with_rank_dying_after_it_came, path, timeout=150)
    assert not isinstance(results[2], dict), results[2]  # it died
    for r in results[:2]:
        assert isinstance(r, dict), r
        assert r["message"] != "loaded" and r["seconds"] < 60, r
        assert "could not be made" in r["message"], r["message"]
