"""Attacks on the local tier under a process group (gloo, CPU; "nodes" simulated by LOCAL_WORLD_SIZE and a path
of their own). Each is a strict xfail: a defect found, not fixed here."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed")

import dist_workers_tier_attacks as workers  # noqa: E402
import ranks  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is missing")


def test_keep_1_a_kill_with_one_ranks_save_in_flight_still_resumes_from_a_local_step(tmp_path):
    for phase in ("train", "lose"):
        ranks.ok(ranks.run(2, workers.keep_one, str(tmp_path), phase, timeout=120))
    resumed = ranks.ok(ranks.run(2, workers.keep_one, str(tmp_path), "resume", timeout=120))
    # rank 0 committed step 5, rank 1's 5 was in flight: step 4 (committed by both) is what a resume should get;
    # the local tier promises at most every_steps steps lost, not the whole run (no durable checkpoint yet)
    assert resumed == [(5, 4), (5, 4)], resumed


def test_the_room_check_counts_every_rank_of_the_node_sharing_the_local_path(tmp_path):
    results = ranks.ok(ranks.run(2, workers.shared_node_room, str(tmp_path), timeout=120))
    # the node's filesystem has room for 3 checkpoints of one rank; the two ranks (keep=1) need 4
    assert all(r[0] == "refused" for r in results), results


def test_ranks_with_different_every_steps_are_told_so_not_left_to_time_out(tmp_path):
    results = ranks.ok(ranks.run(2, workers.mismatched_config, str(tmp_path), "every_steps", (2, 3), timeout=120))
    assert not any("lost contact" in str(r) for r in results), results
    assert all(r[0] == "raised" and "every_steps" in r[2] for r in results) or results[0] == results[1], results


def test_ranks_with_different_replicas_are_told_so_not_left_to_time_out(tmp_path):
    results = ranks.ok(ranks.run(2, workers.mismatched_config, str(tmp_path), "replicas", (1, 0), timeout=120))
    assert not any("lost contact" in str(r) for r in results), results
    assert all(r[0] == "raised" and "replicas" in r[2] for r in results) or results[0] == results[1], results


def test_a_copy_staging_folder_left_by_a_kill_mid_unpack_is_swept(tmp_path):
    ranks.ok(ranks.run(2, workers.plain_run, str(tmp_path), 5, timeout=120))
    for folder, name in (
        ("node1/w2/rank00000", ".step_00000006.copy-deadbeef"),  # a copy from rank 0
        ("node0/w2/rank00000", ".step_00000004.copy-cafef00d"),
    ):  # a restore's fetch, own folder
        staging = tmp_path / folder / name
        staging.mkdir()
        (staging / "data").write_bytes(b"x" * 100_000)
    held = ranks.ok(ranks.run(2, workers.plain_run, str(tmp_path), 9, timeout=120))
    left = [n for node in held for names in node.values() for n in names if ".copy-" in n]
    assert not left, held
    assert not list(Path(tmp_path).glob("node*/w2/rank*/.step_*.copy-*"))


def test_a_restore_fetch_that_cannot_be_written_is_agreed_by_every_rank_not_left_to_time_out(tmp_path):
    import shutil

    ranks.ok(ranks.run(2, workers.plain_run, str(tmp_path), 5, timeout=120))
    shutil.rmtree(tmp_path / "node1")  # node 1 replaced: rank 1 is sent its step 5 from node 0, and has no room
    results = ranks.ok(ranks.run(2, workers.fetch_without_room, str(tmp_path), timeout=120))
    assert not any("lost contact" in str(r) for r in results), results
    assert results[0][:2] == results[1][:2], results  # the same outcome everywhere: a fallback, or one error


def test_a_misplaced_copy_of_another_rank_is_passed_for_the_good_copy_on_the_other_node(tmp_path):
    import os

    ranks.ok(ranks.run(2, workers.plain_run, str(tmp_path), 5, timeout=120))
    own, copy = tmp_path / "node0/w2/rank00000/step_00000005", tmp_path / "node0/w2/rank00001/step_00000005"
    os.rename(own, tmp_path / "swap")  # node 0's step 5 of rank 0 and its copy of rank 1's: swapped
    os.rename(copy, own)
    os.rename(tmp_path / "swap", copy)
    results = ranks.ok(ranks.run(2, workers.resume_only, str(tmp_path), timeout=120))
    # node 1 holds a good rank 0 step 5 (its copy) and rank 1's own: step 5 restores on both ranks
    assert results == [("resumed", 6, 5), ("resumed", 6, 5)], results


def test_a_changed_parallel_layout_at_the_same_world_size_resumes_from_the_durable_tier(tmp_path):
    ranks.ok(ranks.run(2, workers.layout, str(tmp_path), True, 6, timeout=120))  # durable 0; local 4, 5
    results = ranks.ok(ranks.run(2, workers.layout, str(tmp_path), False, 8, timeout=120))
    assert results == [("resumed", 1), ("resumed", 1)], results


def test_loading_a_ranks_local_checkpoint_by_itself_does_not_pass_its_shards_off_as_whole_tensors(tmp_path):
    import trainstate

    ranks.ok(ranks.run(2, workers.layout, str(tmp_path), True, 6, timeout=120))  # Linear(8,16), Linear(16,4)
    local = tmp_path / "node0" / "w2" / "rank00000" / "step_00000005"
    try:
        loaded = trainstate.load(local)
    except trainstate.CheckpointError:
        return  # refused: a rank's own view is not a checkpoint of the whole state
    shapes = {k: tuple(v.shape) for k, v in loaded["model"].items()}
    assert shapes["0.weight"] == (16, 8) and shapes["1.weight"] == (4, 16), shapes


def test_a_local_save_failing_on_one_rank_is_agreed_by_every_rank_not_left_to_time_out(tmp_path):
    results = ranks.ok(ranks.run(2, workers.local_write_fails, str(tmp_path), timeout=120))
    assert not any("lost contact" in str(r) for r in results), results
    # as a collective save's failure: the rank that failed raises its own error, every other rank one naming it,
    # at the next save (not after the timeout)
    assert results[1][:2] == ("raised", "OSError") and results[0][:2] == ("raised", "DistributedError"), results
    assert "rank 1" in results[0][2] and "No space left" in results[0][2], results
    assert all(r[-1] < 10 for r in results), results


def test_a_damaged_newest_durable_checkpoint_is_passed_for_a_local_step_older_than_it_under_a_group(tmp_path):
    ranks.ok(ranks.run(2, workers.durable_every_5, str(tmp_path), 10, timeout=120))  # durable 5, 10; local 7-9
    data = max((tmp_path / "durable" / "step_00000010").glob("data*"), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    data.write_bytes(bytes(raw))
    results = ranks.ok(ranks.run(2, workers.durable_every_5, str(tmp_path), 10, timeout=120))
    assert results == [(10, 9), (10, 9)], results  # local step 9, not durable step 5
