"""keep_best naming a metric that saves do not pass: a warning at the first save without it, and retention
never deletes the best checkpoint because others lack the metric."""

from __future__ import annotations

import logging

import numpy as np

import trainstate


def _state(step: int) -> dict[str, np.ndarray]:
    return {"x": np.full(4, step, dtype=np.float32)}


def test_a_metric_no_save_passes_is_warned_about_once(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="trainstate"):
        with trainstate.CheckpointManager(tmp_path, keep_last=1, keep_best=("val_loss", "min", 1)) as mgr:
            for step in (1, 2, 3):
                mgr.save(step, _state(step), metrics={"eval_loss": 1.0 / step}, force=True)
    warnings = [r.getMessage() for r in caplog.records if "val_loss" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "eval_loss" in warnings[0]  # names the metrics the save did pass


def test_the_best_survives_saves_without_the_metric(tmp_path):
    with trainstate.CheckpointManager(tmp_path, keep_last=1, keep_best=("val_loss", "min", 1)) as mgr:
        mgr.save(1, _state(1), metrics={"val_loss": 0.5}, force=True)
        mgr.save(2, _state(2), metrics={"val_loss": 0.1}, force=True)  # the best
        for step in range(3, 7):
            mgr.save(step, _state(step), force=True)  # no metrics: evaluation runs less often than saves
        mgr.save(7, _state(7), metrics={"val_loss": 0.3}, force=True)
        mgr.save(8, _state(8), force=True)
        assert [c.step for c in mgr.list()] == [2, 8]
        best = mgr.best()
        assert best is not None and best.step == 2


def test_a_run_that_passes_the_metric_is_not_warned_about_its_final_save(tmp_path, caplog):
    """close(step, state) saves without metrics; a run whose saves pass the metric is not told it lacks it,
    nor is a resumed run whose first save comes before its next evaluation."""
    with caplog.at_level(logging.WARNING, logger="trainstate"):
        with trainstate.CheckpointManager(tmp_path, every_steps=2, keep_best=("val_loss", "min", 1)) as mgr:
            for step in range(5):
                mgr.save(step, _state(step), metrics={"val_loss": 1.0 / (step + 1)})
            mgr.close(4, _state(4))
        with trainstate.CheckpointManager(tmp_path, keep_best=("val_loss", "min", 1)) as mgr:
            mgr.restore_latest(_state(0))
            mgr.save(5, _state(5), force=True)  # before the resumed run's first evaluation
    assert [r.getMessage() for r in caplog.records if "val_loss" in r.getMessage()] == []
