"""Save and retention policies are pure functions: tables in, decisions out."""

from __future__ import annotations

import pytest

from trainstate._manager.policies import (
    AtSteps,
    CheckpointInfo,
    EverySeconds,
    EverySteps,
    KeepBest,
    KeepEveryMinutes,
    KeepEverySteps,
    KeepLast,
    plan_retention,
    reason_to_save,
)


def ck(step: int, minute: float = 0.0, pinned: bool = False, **metrics: float) -> CheckpointInfo:
    return CheckpointInfo(name=f"step_{step:08d}", step=step, created=minute * 60, metrics=metrics, pinned=pinned)


@pytest.mark.parametrize(
    "policies, step, now, last, expected",
    [
        ([EverySteps(500)], 1000, 0, 0, "every 500 steps"),
        ([EverySteps(500)], 999, 0, 0, None),
        ([EverySeconds(60)], 7, 100.0, 30.0, "every 60 s"),
        ([EverySeconds(60)], 7, 80.0, 30.0, None),
        ([AtSteps(frozenset({3, 9}))], 9, 0, 0, "at step"),
        ([EverySteps(500), EverySeconds(60)], 7, 100.0, 0.0, "every 60 s"),  # they compose
        ([], 500, 1e9, 0, None),
    ],
)
def test_save_policies(policies, step, now, last, expected):
    assert reason_to_save(policies, step, now, last) == expected


def names(plan_list):
    return sorted(f"{int(n[5:])}" for n in plan_list)


@pytest.mark.parametrize(
    "checkpoints, policies, deleted",
    [
        # keep_last
        ([ck(1), ck(2), ck(3), ck(4)], [KeepLast(2)], ["1", "2"]),
        # every Nth step, union with keep_last
        ([ck(s) for s in range(0, 60, 10)], [KeepLast(1), KeepEverySteps(20)], ["10", "30"]),
        # one per N minutes of wall time: minutes 0, 4, 11 kept; 12 is the newest
        ([ck(1, 0), ck(2, 2), ck(3, 4), ck(4, 6), ck(5, 11), ck(6, 12)], [KeepEveryMinutes(4)], ["2", "4"]),
        # best K (min); checkpoints without the metric get no vote from keep_best
        (
            [ck(1, loss=0.5), ck(2, loss=0.2), ck(3), ck(4, loss=0.9), ck(5, loss=0.7)],
            [KeepBest("loss", "min", 2)],
            ["4"],
        ),
        ([ck(1, acc=0.5), ck(2, acc=0.9), ck(3, acc=0.1)], [KeepBest("acc", "max", 1)], ["1"]),
        # a tie: the first to reach the value is the best, as Lightning's top-k and the HF Trainer take it (a new
        # best must be strictly better); the later one of the tie goes
        (
            [ck(1, loss=0.5), ck(2, loss=0.2), ck(3, loss=0.2), ck(4, loss=0.9)],
            [KeepBest("loss", "min", 1)],
            ["1", "3"],
        ),
        ([ck(1, acc=0.9), ck(2, acc=0.9), ck(3, acc=0.1)], [KeepBest("acc", "max", 1)], ["2"]),
        # ... but another policy may release them
        ([ck(1), ck(2, loss=0.1), ck(3), ck(4)], [KeepBest("loss", "min", 1), KeepLast(1)], ["1", "3"]),
        # pinned and newest are always kept
        ([ck(1, pinned=True), ck(2), ck(3)], [KeepLast(1)], ["2"]),
        ([ck(1, loss=0.1), ck(2, loss=0.5)], [KeepBest("loss", "min", 1)], []),  # 2 is the newest
        # no retention policy: keep everything
        ([ck(1), ck(2)], [], []),
    ],
)
def test_retention_table(checkpoints, policies, deleted):
    plan = plan_retention(checkpoints, policies)
    assert names(plan.delete) == deleted
    kept = {c.name for c in checkpoints} - set(plan.delete)
    assert set(plan.keep) == kept  # every kept checkpoint has a reason


def test_one_per_minutes_window():
    plan = plan_retention([ck(1, 0), ck(2, 2), ck(3, 4), ck(4, 6), ck(5, 11), ck(6, 12)], [KeepEveryMinutes(4)])
    assert names(plan.keep) == ["1", "3", "5", "6"] and names(plan.delete) == ["2", "4"]


@pytest.mark.parametrize("n", range(1, 6))
def test_newest_is_never_deleted_whatever_the_policies(n):
    cps = [ck(s, s, loss=float(10 - s)) for s in range(8)]
    for policies in ([KeepLast(n)], [KeepBest("loss", "max", n)], [KeepEverySteps(n + 3)], [KeepEveryMinutes(n)]):
        plan = plan_retention(cps, policies)
        assert "step_00000007" not in plan.delete
        assert "newest" in plan.keep["step_00000007"]


def test_bad_mode_is_refused():
    with pytest.raises(ValueError, match="min"):
        KeepBest("loss", "lowest", 1)


def test_public_policy_objects_drive_a_manager_and_refuse_bad_settings(tmp_path):
    import numpy as np

    import trainstate

    mgr = trainstate.CheckpointManager(
        tmp_path,
        save_policies=[trainstate.EverySteps(np.int64(2))],
        retention_policies=[trainstate.KeepLast(1), trainstate.KeepBest("loss", "min", 1)],
        fsync=False,
    )
    for step, loss in [(2, 0.5), (4, 0.9), (6, 0.7), (7, 0.1)]:
        mgr.save(step, {"x": np.arange(3)}, metrics={"loss": loss})
    mgr.close()
    assert [c.step for c in trainstate.CheckpointManager(tmp_path, read_only=True).list()] == [2, 6]
    for bad in (
        lambda: trainstate.KeepLast(0),
        lambda: trainstate.EverySteps("5"),
        lambda: trainstate.KeepBest("loss", "avg"),
        lambda: trainstate.KeepEveryMinutes(-1),
        lambda: trainstate.AtSteps(frozenset({-3})),
    ):
        with pytest.raises(trainstate.InvalidArgumentError):
            bad()


def sq(step: int, pinned: bool = False, **metrics: float) -> CheckpointInfo:
    return CheckpointInfo(f"step_{step:08d}", step, created=0.0, metrics=metrics, pinned=pinned, seq=step)


@pytest.mark.parametrize(
    "intact, damaged, policies, deleted",
    [
        # a damaged checkpoint falls out as the oldest: its commit order cannot be read
        ([sq(1), sq(3), sq(4)], [ck(2)], [KeepLast(2)], ["1", "2"]),
        ([sq(3), sq(4)], [ck(9)], [KeepLast(2)], ["9"]),
        # ... and never takes a readable checkpoint's place
        ([sq(3)], [ck(9)], [KeepLast(2)], []),
        ([sq(1), sq(3)], [ck(2, pinned=True)], [KeepLast(1)], ["1"]),
        ([sq(4)], [ck(2)], [KeepEverySteps(2)], []),
        # as a checkpoint saved without the metric: KeepBest alone does not let it go, KeepLast does
        ([sq(1, loss=0.1), sq(2, loss=0.5)], [ck(3)], [KeepBest("loss", "min", 1)], []),
        ([sq(1, loss=0.1), sq(2, loss=0.5)], [ck(3)], [KeepBest("loss", "min", 1), KeepLast(1)], ["3"]),
        ([], [ck(2), ck(3)], [KeepLast(1)], ["2"]),  # none readable: the highest step is taken as the newest
        ([sq(1)], [ck(2)], [], []),  # no retention policy: keep everything
    ],
)
def test_retention_of_damaged_checkpoints(intact, damaged, policies, deleted):
    plan = plan_retention(intact, policies, damaged)
    assert names(plan.delete) == deleted
    assert plan_retention(intact, policies).delete == [n for n in plan.delete if n in {c.name for c in intact}]
    for c in damaged:
        assert c.name in plan.delete or plan.keep[c.name][-1] == "damaged manifest"
