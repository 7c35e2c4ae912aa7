"""``trainstate history DIR``: the table, --json, --metric, and --plot drawing a real training run's saves."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import trainstate
from helpers import cli

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real run: a small model trained 12 steps, saved every 3 (async), the last 2 kept; the loss is handed
    over as a tensor, the learning rate as a NumPy scalar."""
    run = tmp_path_factory.mktemp("history") / "run"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optim = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    state = {"model": model, "optim": optim}
    with trainstate.CheckpointManager(run, every_steps=3, keep_last=2, async_save=True) as mgr:
        for step in range(1, 13):
            loss = torch.nn.functional.mse_loss(model(x), y)
            optim.zero_grad()
            loss.backward()
            optim.step()
            mgr.save(step, state, metrics={"loss": loss.detach(), "lr": np.float64(0.05)})
    return run


def test_the_table_shows_every_save_with_its_timings_and_fate(trained: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINSTATE_NO_RICH", "1")  # plain text: columns are easy to check
    lines = cli("history", str(trained)).stdout.splitlines()
    assert lines[0] == f"saves in {trained}"
    assert lines[1].split() == [
        "step",
        "time",
        "wrote",
        "blocked",
        "s",
        "write",
        "s",
        "commit",
        "s",
        "metrics",
        "status",
    ]
    rows = [line.split() for line in lines[3:7]]
    assert [r[0] for r in rows] == ["3", "6", "9", "12"]
    for r in rows:
        assert r[3] == "kB" and all(float(x) >= 0 for x in r[4:7])  # wrote "N.N kB", then three timings
        assert r[7].startswith("loss=") and r[8] == "lr=0.05"
    assert rows[0][9:] == ["deleted:", "retention", "after", "step", "9"]
    assert rows[1][9:] == ["deleted:", "retention", "after", "step", "12"]
    assert [r[9] for r in rows[2:]] == ["kept", "kept"]
    assert lines[7].startswith("4 saves (2 kept, 2 deleted); training blocked ")

    only_loss = cli("history", str(trained), "--metric", "loss").stdout
    assert "loss=" in only_loss and "lr=" not in only_loss


def test_rich_output_and_json(trained: Path) -> None:
    out = cli("history", str(trained)).stdout
    assert "saves in" in out and "retention after step 9" in out and "blocked s" in out
    doc = json.loads(cli("history", str(trained), "--json").stdout)
    assert doc["path"] == str(trained) and doc["plot"] is None
    saves = doc["saves"]
    assert [(s["step"], s["status"]) for s in saves] == [(3, "deleted"), (6, "deleted"), (9, "kept"), (12, "kept")]
    assert all(s["background"] and s["write_seconds"] > 0 and s["nbytes"] > 0 for s in saves)
    assert saves[0]["metrics"]["lr"] == 0.05 and isinstance(saves[0]["metrics"]["loss"], float)


def _png_size(path: Path) -> tuple[int, int]:
    raw = path.read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n" and raw[12:16] == b"IHDR", raw[:16]
    return struct.unpack(">II", raw[16:24])


def test_plot_draws_the_runs_saves_into_a_real_png(trained: Path, tmp_path: Path) -> None:
    out = tmp_path / "run.png"
    proc = cli("history", str(trained), "--plot", str(out), "--metric", "loss")
    assert f"plot written to {out}" in proc.stdout
    width, height = _png_size(out)
    assert width > 100 and height > 100 and out.stat().st_size > 1000
    from PIL import Image  # matplotlib's own dependency: the file decodes as a whole

    with Image.open(out) as image:
        image.load()
        assert image.size == (width, height) and image.format == "PNG"
    # the Python API draws the same run into a figure: one panel for save times, one per metric
    figure = trainstate.plot_history(trained)
    assert len(figure.axes) == 3 and [ax.get_ylabel() for ax in figure.axes] == ["seconds per save", "loss", "lr"]


def test_wrong_paths_and_metrics_are_usage_errors(trained: Path, tmp_path: Path) -> None:
    assert "no save recorded the metric(s) acc" in cli("history", str(trained), "--metric", "acc", code=2).stderr
    assert "not a run directory" in cli("history", str(trained / "step_00000012"), code=2).stderr
    assert "no such directory" in cli("history", str(tmp_path / "missing"), code=3).stderr
    (tmp_path / "empty").mkdir()
    assert cli("history", str(tmp_path / "empty")).stdout.strip() == f"no saves in {tmp_path / 'empty'}"
    assert (
        "no saves to plot" in cli("history", str(tmp_path / "empty"), "--plot", str(tmp_path / "x.png"), code=3).stderr
    )
    assert not (tmp_path / "x.png").exists()


def test_a_directory_of_checkpoints_no_manager_saved_says_why_it_has_no_history(tmp_path: Path) -> None:
    """Lightning's plugin names its checkpoints itself (``last.ckpt``) and records no history."""
    trainstate.save(tmp_path / "last.ckpt", {"w": np.ones(2)})
    trainstate.save(tmp_path / "epoch=0-step=3.ckpt", {"w": np.ones(2)})
    (tmp_path / "notes").mkdir()
    proc = cli("history", str(tmp_path))
    assert proc.stdout.strip() == f"no saves in {tmp_path}"
    assert "holds 2 trainstate checkpoint(s) (epoch=0-step=3.ckpt, last.ckpt) that no CheckpointManager" in proc.stderr
    assert (
        "no CheckpointManager saved" in cli("history", str(tmp_path), "--plot", str(tmp_path / "x.png"), code=3).stderr
    )


NO_MATPLOTLIB = """
import sys

class _NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "matplotlib":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NotInstalled())
from trainstate._cli import main

assert main(["history", sys.argv[1]]) == 0  # the table needs no matplotlib
assert "matplotlib" not in sys.modules
sys.exit(main(["history", sys.argv[1], "--plot", sys.argv[2]]))
"""


def test_without_matplotlib_plot_names_the_extra_and_the_table_still_works(trained: Path, tmp_path: Path) -> None:
    out = tmp_path / "run.png"
    env = {**os.environ, "COLUMNS": "200", "TRAINSTATE_NO_RICH": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", NO_MATPLOTLIB, str(trained), str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 8, (proc.returncode, proc.stdout, proc.stderr)  # a missing optional dependency
    assert "saves in" in proc.stdout and "Traceback" not in proc.stderr
    assert 'pip install "trainstate[plot]"' in proc.stderr and "matplotlib" in proc.stderr
    assert not out.exists()
