"""incremental=True under a process group: refused on every rank with a way out, before anything is taken."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed")

import dist_workers_manager as workers  # noqa: E402
import ranks  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is missing")


def test_an_incremental_manager_under_a_process_group_is_refused_on_every_rank(tmp_path):
    out = ranks.ok(ranks.run(2, workers.incremental_refused, str(tmp_path / "run")))
    for got in out:
        assert "not supported for collective saves" in got["refused"] and "collective=False" in got["refused"]
        assert "_shared" in got["own"] and "step_00000001" in got["own"]  # a directory per rank works
