"""Attacks on the global sample stream and re-derived generators on real gloo ranks (issue 29)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed")

import dist_workers_sample_stream_attacks as workers  # noqa: E402
import ranks  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is missing")


def test_a_rank_one_batch_ahead_is_refused_and_the_error_says_the_ranks_are_out_of_step(tmp_path):
    out = ranks.run(2, workers.save_one_rank_ahead, str(tmp_path / "c"))
    for message in out:
        assert "differs from rank 0's under 'sampler'" in message, out
        assert "out of step" in message, out  # not only "wrap it in PerRank", which would break the resume
    assert not (tmp_path / "c").exists()


def test_another_global_batch_size_is_refused_on_every_rank_as_state_mismatch(tmp_path):
    ranks.ok(ranks.run(2, workers.save_position, str(tmp_path / "c")))
    out = ranks.run(2, workers.load_with_another_global_batch, str(tmp_path / "c"))
    for message in out:
        assert "sampler.global_batch_size: target has global_batch_size=4, checkpoint has global_batch_size=8" in (
            message
        ), out
    assert out[0].startswith("StateMismatchError"), out


def test_named_generators_are_rederived_per_rank_and_the_same_in_every_resume(tmp_path):
    run = str(tmp_path / "run")
    ranks.ok(ranks.run(2, workers.save_rng, run))
    same = ranks.ok(ranks.run(2, workers.restore_rng, run))
    assert same == ranks.ok(ranks.run(2, workers.restore_rng, run))  # restored exactly at the same world size
    three = ranks.ok(ranks.run(3, workers.restore_rng, run))
    assert three == ranks.ok(ranks.run(3, workers.restore_rng, run))  # re-derived by a fixed rule
    for column in range(5):  # Python's, NumPy's, torch's, the named NumPy and torch generators
        assert len({draws[column] for draws in three}) == 3, column  # each rank its own
    for r in range(2):  # the named ones were re-derived too, not left as restored or as built
        assert three[r][3:] != same[r][3:], r
    assert ranks.ok(ranks.run(1, workers.restore_rng, run)) == [three[0]]  # rank 0's rule does not depend on R


def test_a_per_rank_sampler_checkpoint_and_a_global_one_are_told_apart_on_two_ranks(tmp_path):
    """Switching between ResumableSampler() and ResumableSampler(global_batch_size=) across a resume: the
    global position saved by 2 ranks was described as 'one value saved by one process' (with a hint about a
    change of world size that did not happen)."""
    for saved_global in (False, True):
        path = str(tmp_path / f"c{saved_global}")
        ranks.ok(ranks.run(2, workers.save_either, path, saved_global))
        out = ranks.run(2, workers.load_either, path, not saved_global)
        for message in out:
            assert message.startswith("StateMismatchError"), out
            if saved_global:
                assert "one value for every rank (saved so by 2 ranks" in message, out
                assert "world size" not in message, out
            else:
                assert "ResumableSampler (one value for every rank), checkpoint has values saved per rank" in message
