"""A rank that is gone before a collective call: the others raise DistributedError naming it, soon.

Before: a rank that died before the coordination group was made kept the others waiting the whole 600 s
timeout, and one that died after it made them raise at once but without saying which rank was gone.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

import dist_workers_liveness as workers  # noqa: E402 - after importorskip
import ranks  # noqa: E402
from trainstate._distributed import group  # noqa: E402


def test_the_default_wait_for_a_missing_rank_is_60_seconds():
    assert group.ARRIVAL_TIMEOUT == 60.0


@pytest.mark.parametrize("how", ["before_manager", "after_manager"])
def test_a_rank_that_exited_is_named_by_the_rank_that_waits_for_it(tmp_path, how):
    out = ranks.run(2, workers.exits_before_the_save, str(tmp_path / "run"), how, timeout=60)
    assert out[1] == "exit code 0"
    assert out[0]["error"] == "DistributedError", out[0]
    assert "rank 1" in out[0]["message"] and "rank 0 of 2 lost" not in out[0]["message"], out[0]["message"]
    assert out[0]["seconds"] < 15, out[0]  # 3 s arrival timeout in the test (60 s by default)
