"""A JAX process that is gone before a collective save: the others raise DistributedError naming it within
seconds, not after the 600 s timeout (or the JAX runtime's own heartbeat timeout, ~90 s)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax")
pytest.importorskip("flax")  # with_jax/: the suite's JAX environment

from ranks import free_port  # noqa: E402

WORKER = Path(__file__).with_name("jax_process_gone.py")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("how", ["before", "after"])
def test_a_process_gone_before_the_save_is_named_soon(tmp_path, how):
    port = str(free_port())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), how, str(p), port, str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for p in (0, 1)
    ]
    try:
        outs = [proc.communicate(timeout=90) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    results = [json.loads(out.split("RESULT ", 1)[1]) for out, _ in outs]
    assert results[1] == {"gone": True}
    got = results[0]
    assert got["error"] == "DistributedError", got
    assert "process 1" in got["message"] and "lost contact" not in got["message"], got["message"]
    assert got["seconds"] < 20, got  # 5 s arrival timeout in this test (60 s by default); a heartbeat: ~5 s
    assert not (tmp_path / "alone").exists()
