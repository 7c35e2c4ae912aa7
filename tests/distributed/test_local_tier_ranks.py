"""The local tier under a process group (gloo, CPU): "nodes" simulated on one machine, each a group of ranks with
a local path of its own, each node's local checkpoints copied to the next node.

One job, FSDP2 with AdamW and per-rank dropout, a durable checkpoint every 10 steps and a local one every step:
(a) the whole job is SIGKILLed between two durable saves and resumes from the newest local step; (b) it is killed
again and one node's local path deleted (the node lost and replaced): its ranks fetch their checkpoints from the
copies on the other node; (c) a rank's own copy is damaged: it falls back to the copy on the other node. The run
ends bit-identical to one that was never interrupted. Kills land with local saves and copies in flight: nothing
torn or mixed is ever restored."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed")

import dist_workers_tier as workers  # noqa: E402
import ranks  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is missing")


def _flip_a_byte(checkpoint: Path) -> None:
    data = max((p for p in checkpoint.iterdir() if p.name.startswith("data")), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    data.write_bytes(bytes(raw))


def _steps(folder: Path) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in folder.glob("step_*") if (p / "manifest.json").exists())


def _starts(run: Path, rank: int) -> list[int]:
    return [int(line) for line in (run / f"starts.r{rank}").read_text().split()]


def test_two_nodes_killed_then_a_node_lost_then_a_copy_damaged_resume_bit_identically(tmp_path):
    world, per_node = 2, 1  # two "nodes" of one rank each
    reference = ranks.ok(ranks.run(world, workers.train, str(tmp_path / "reference"), per_node, None, timeout=180))
    run = tmp_path / "run"
    node0, node1 = run / "node0" / "w2", run / "node1" / "w2"

    # (a) the whole job killed after step 13 (durable: 0 and 10): each node holds its own and the other's copies
    killed = ranks.run(world, workers.train, str(run), per_node, 13, timeout=180)
    assert all(k == "exit code -9" for k in killed), killed
    assert _steps(node0 / "rank00000")[-1] >= 12 and _steps(node1 / "rank00001")[-1] >= 12
    assert _steps(node1 / "rank00000")[-1] >= 12 and _steps(node0 / "rank00001")[-1] >= 12
    # resumed from the newest local step every rank has (13's save may have been in flight at the kill)
    killed = ranks.run(world, workers.train, str(run), per_node, 17, timeout=180)
    assert all(k == "exit code -9" for k in killed), killed
    assert _starts(run, 0)[-1] == _starts(run, 1)[-1] in (13, 14)

    # (b) node 1 lost: its processes killed (above) and its local path gone; rank 1 resumes from its copy on node 0
    shutil.rmtree(run / "node1")
    killed = ranks.run(world, workers.train, str(run), per_node, 23, True, timeout=180)  # killed once all is saved
    assert all(k == "exit code -9" for k in killed), killed
    assert _starts(run, 0)[-1] == _starts(run, 1)[-1] in (17, 18)
    assert _steps(node0 / "rank00000")[-1] == _steps(node1 / "rank00000")[-1] == 23  # its own and its copy

    # (c) rank 0's own copy of step 23 damaged: it falls back to its copy on node 1, at the same step
    _flip_a_byte(node0 / "rank00000" / "step_00000023")
    final = ranks.ok(ranks.run(world, workers.train, str(run), per_node, None, timeout=180))
    assert _starts(run, 0)[-1] == _starts(run, 1)[-1] == 24
    assert _steps(node0 / "rank00000")[-1] >= 23  # the damaged copy was replaced by the good one, fetched
    for (_, got, draw), (_, want, want_draw) in zip(final, reference):
        assert workers.weights_equal(got, want)  # bit-identical to the uninterrupted run
        assert draw == want_draw  # and each rank's generator where the uninterrupted run's is


def test_four_ranks_on_two_nodes_lose_a_node_and_resume_from_the_copies(tmp_path):
    """Two ranks a node (LOCAL_WORLD_SIZE=2): each rank's copies go to the rank at its place on the next node."""
    world, per_node = 4, 2
    reference = ranks.ok(ranks.run(world, workers.train, str(tmp_path / "reference"), per_node, None, timeout=240))
    run = tmp_path / "run"
    killed = ranks.run(world, workers.train, str(run), per_node, 16, True, timeout=240)
    assert all(k == "exit code -9" for k in killed), killed
    node0, node1 = run / "node0" / "w4", run / "node1" / "w4"
    assert sorted(p.name for p in node0.iterdir()) == [f"rank{r:05d}" for r in range(4)]  # own 0, 1; copies 2, 3
    shutil.rmtree(run / "node1")
    final = ranks.ok(ranks.run(world, workers.train, str(run), per_node, None, timeout=240))
    assert [_starts(run, r)[-1] for r in range(world)] == [17] * world
    assert sorted(p.name for p in node1.iterdir()) == [f"rank{r:05d}" for r in range(4)]  # fetched, then copies again
    for (_, got, draw), (_, want, want_draw) in zip(final, reference):
        assert workers.weights_equal(got, want) and draw == want_draw


def test_another_number_of_ranks_resumes_from_the_durable_tier(tmp_path):
    """A 2-rank job's local checkpoints are its own ranks' views: resumed on 1 process, the durable tier serves."""
    run = tmp_path / "run"
    killed = ranks.run(2, workers.train, str(run), 1, 13, True, timeout=180)
    assert all(k == "exit code -9" for k in killed), killed
    ((start, _, _),) = ranks.ok(ranks.run(1, workers.train, str(run), 1, None, timeout=180))  # one process
    assert start == 11  # the durable checkpoint of step 10, resharded for 1 rank; not the local steps 11-13
    # back on 2 ranks: the 1-process run's durable step 20 came after the 2-rank local steps 11-13 were written
    ranks.ok(ranks.run(2, workers.train, str(run), 1, None, timeout=180))
    assert _starts(run, 0)[-1] == _starts(run, 1)[-1] == 21


def test_no_room_on_one_node_raises_on_every_rank_at_the_first_local_save(tmp_path):
    out = ranks.ok(ranks.run(2, workers.no_room_on_one_node, str(tmp_path), timeout=120))
    assert out[1][0] == "StorageError" and "budget_bytes of 1,000" in out[1][1], out
    assert out[0][0] == "DistributedError" and "rank 1" in out[0][1], out


def test_one_local_path_shared_by_two_nodes_is_refused_on_every_rank(tmp_path):
    out = ranks.ok(ranks.run(2, workers.one_path_for_two_nodes, str(tmp_path), timeout=120))
    assert all(kind == "InvalidArgumentError" and "shared by nodes 0, 1" in why for kind, why in out), out
