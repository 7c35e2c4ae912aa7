"""The ``trainstate`` command on checkpoints the library wrote: through ``main()`` in this process, and in a
subprocess where the process matters (the entry point, signals, environment, broken pipes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import trainstate
from helpers import cli

ENV = {**os.environ, "COLUMNS": "200"}


def cli_json(*args: str, code: int = 0) -> object:
    proc = cli(*args, "--json", code=code)
    return json.loads(proc.stdout)  # stdout holds JSON and nothing else


def state(scale: float = 1.0) -> dict[str, object]:
    return {
        "model": {"w": np.arange(12, dtype=np.float32).reshape(3, 4) * scale, "b": np.zeros(3)},
        "step": 7,
        "cfg": {"lr": 0.1, "betas": (0.9, 0.99)},
    }


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A manager directory: steps 0, 10, 20 committed, step 30 crashed, a staging leftover."""
    d = tmp_path / "run"
    mgr = trainstate.CheckpointManager(d, save_on_preemption=False, capture_rng=False)
    for step, loss in ((0, 3.0), (10, 1.0), (20, 2.0)):
        mgr.save(step, state(step + 1), metrics={"val_loss": loss}, force=True)
    mgr.close()
    (d / "step_00000030").mkdir()
    (d / "step_00000030" / "data-00000.safetensors").write_bytes(b"partial")
    (d / ".step_00000040.tmp-0123abcd").mkdir()
    return d


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    path = tmp_path / "ckpt"
    trainstate.save(path, state(), metadata={"run": "exp1"})
    return path


def test_help_documents_exit_codes() -> None:
    out = cli("--help").stdout
    assert "exit codes" in out and "5  corrupt" in out and "3  not found" in out
    for command in ("ls", "inspect", "verify", "diff", "prune", "pin", "unpin", "demo"):
        assert command in out


def _key_env_help(command: str) -> str:
    import argparse

    from trainstate._cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return next(a.help or "" for a in sub.choices[command]._actions if "--key-env" in a.option_strings)


@pytest.mark.parametrize(
    "command", ["ls", "history", "inspect", "verify", "diff", "export", "export-onnx", "prune", "pin", "unpin"]
)
def test_key_env_help_of_a_command_that_writes_no_checkpoint_says_nothing_of_writing(command: str) -> None:
    text = _key_env_help(command)
    assert "trainstate keygen" in text
    assert "writ" not in text and "encrypted with it" not in text, text


@pytest.mark.parametrize("command", ["consolidate", "import", "average", "pack"])
def test_key_env_help_of_a_command_that_writes_a_checkpoint_says_what_it_writes(command: str) -> None:
    assert "OUT" in _key_env_help(command) or "CKPT" in _key_env_help(command)


@pytest.mark.parametrize("args", [["--help"], ["verify", "--help"], ["demo", "--help"]])
def test_help_works_without_docstrings(args: list[str]) -> None:
    """``python -OO`` strips docstrings; help text (and every exit code in it) must not come from them."""
    from trainstate import _cli as cli_module

    proc = subprocess.run(
        [sys.executable, "-OO", "-m", "trainstate", *args],
        capture_output=True,
        text=True,
        check=False,
        env=ENV,
        timeout=60,
    )
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "usage: trainstate" in proc.stdout
    if args[0] != "demo":
        listed = {
            int(line.split()[0])
            for line in proc.stdout.split("exit codes:", 1)[1].splitlines()
            if line.strip()[:1].isdigit()
        }
        codes = {
            getattr(cli_module, name)
            for name in (
                "OK",
                "DIFFERENT",
                "USAGE",
                "NOT_FOUND",
                "INCOMPLETE",
                "CORRUPT",
                "MISMATCH",
                "STORAGE",
                "OTHER",
                "INTERNAL",
                "INTERRUPTED",
            )
        }
        assert listed == codes


def test_ls_table_shows_complete_and_incomplete(run_dir: Path) -> None:
    out = cli("ls", str(run_dir), env=ENV).stdout  # a real process: the entry point and its exit code
    for name in ("step_00000000", "step_00000010", "step_00000020", "step_00000030", ".step_00000040.tmp-0123abcd"):
        assert name in out
    assert "val_loss=1" in out and "incomplete" in out
    assert "3 complete, 2 incomplete" in out


def test_ls_json(run_dir: Path) -> None:
    doc = cli_json("ls", str(run_dir))
    rows = {r["name"]: r for r in doc["checkpoints"]}
    assert [rows[f"step_000000{s}"]["status"] for s in ("00", "10", "20", "30")] == [
        "complete",
        "complete",
        "complete",
        "incomplete",
    ]
    assert rows[".step_00000040.tmp-0123abcd"]["status"] == "incomplete"
    assert rows[".step_00000040.tmp-0123abcd"]["step"] == 40
    assert rows["step_00000010"]["metrics"] == {"val_loss": 1.0}
    assert rows["step_00000010"]["step"] == 10 and rows["step_00000010"]["nbytes"] > 0
    assert rows["step_00000010"]["created_iso"].startswith("20")
    one = cli_json("ls", str(run_dir / "step_00000020"))
    assert [(r["name"], r["step"], r["status"]) for r in one["checkpoints"]] == [("step_00000020", 20, "complete")]


def test_plain_text_without_rich(run_dir: Path) -> None:
    proc = cli("ls", str(run_dir), env={**ENV, "TRAINSTATE_NO_RICH": "1"})
    assert "trainstate[cli]" in proc.stderr and len(proc.stderr.splitlines()) == 1
    assert "step_00000020" in proc.stdout and "incomplete" in proc.stdout


def test_inspect_filter_and_json(ckpt: Path) -> None:
    out = cli("inspect", str(ckpt), "--filter", "model.*").stdout
    assert "model.w" in out and "F32" in out and "[3, 4]" in out and "2 of 2 tensors" in out
    doc = cli_json("inspect", str(ckpt), "--filter", "*.w")
    tensors = [(t["name"], t["dtype"], t["shape"], t["nbytes"]) for t in doc["tensors"]]
    assert tensors == [("model.w", "F32", [3, 4], 48)]
    assert doc["tensor_bytes"] == 48 and doc["tensor_count"] == 2
    assert doc["metadata"] == {"run": "exp1"} and doc["format_version"] == trainstate.FORMAT_VERSION
    everything = cli_json("inspect", str(ckpt))
    assert {v["path"]: v["value"] for v in everything["values"]} == {
        "step": 7,
        "cfg.lr": 0.1,
        "cfg.betas.0": 0.9,
        "cfg.betas.1": 0.99,
    }


def flip_byte(path: Path, tensor: str) -> None:
    with trainstate.open(path) as ck:
        chunk = ck.manifest.tensors[tensor].chunks[0]
    data_file = path / chunk.file
    raw = bytearray(data_file.read_bytes())
    raw[chunk.byte_range[0] + 1] ^= 0xFF
    data_file.write_bytes(raw)


def test_verify_ok_and_corrupt(ckpt: Path) -> None:
    assert "OK: 2 tensors" in cli("verify", str(ckpt)).stdout
    flip_byte(ckpt, "model.w")
    proc = cli("verify", str(ckpt), code=5, env=ENV)
    assert "model.w" in proc.stderr and len(proc.stderr.splitlines()) == 1
    doc = cli_json("verify", str(ckpt), code=5)
    assert doc["ok"] is False and [e["tensor"] for e in doc["errors"]] == ["model.w"]
    assert "checksum mismatch" in doc["errors"][0]["message"]


def test_diff(tmp_path: Path, ckpt: Path) -> None:
    same = tmp_path / "same"
    trainstate.save(same, state(), metadata={"run": "exp2"})
    assert "identical state" in cli("diff", str(ckpt), str(same)).stdout
    assert cli_json("diff", str(ckpt), str(same))["identical"] is True

    other = state()
    other["model"]["w"] = other["model"]["w"] + np.float32(0.25)
    other["model"]["w"][1, 2] -= 3
    del other["model"]["b"]
    other["model"]["extra"] = np.ones(2, np.int8)
    other["step"] = 8
    other["cfg"]["betas"] = (0.9, 0.999)
    changed = tmp_path / "changed"
    trainstate.save(changed, other)
    proc = cli("diff", str(ckpt), str(changed), code=1)
    assert "model.w" in proc.stdout and "max |a-b| = 2.75" in proc.stdout
    doc = cli_json("diff", str(ckpt), str(changed), code=1)
    assert doc["identical"] is False
    assert [t["name"] for t in doc["tensors"]["added"]] == ["model.extra"]
    assert [t["name"] for t in doc["tensors"]["removed"]] == ["model.b"]
    (w,) = doc["tensors"]["changed"]
    assert (w["name"], w["reasons"], w["different"], w["numel"], w["max_abs_diff"]) == (
        "model.w",
        ["values"],
        12,
        12,
        2.75,
    )
    assert {c["path"]: (c["a"], c["b"]) for c in doc["values"]["changed"]} == {
        "step": (7, 8),
        "cfg.betas.1": (0.99, 0.999),
    }


def test_diff_exclude_leaves_out_what_the_patterns_take(tmp_path: Path, ckpt: Path) -> None:
    """Two runs that differ only in what the user does not compare (a manager's captured ``_rng``, say)."""
    other = state()
    other["model"]["b"] = other["model"]["b"] + np.float32(1)
    other["step"] = 8
    changed = tmp_path / "changed"
    trainstate.save(changed, other)
    assert cli_json("diff", str(ckpt), str(changed), code=1)["identical"] is False
    doc = cli_json("diff", str(ckpt), str(changed), "--exclude", "model.b", code=1)
    assert doc["tensors"]["changed"] == [] and [c["path"] for c in doc["values"]["changed"]] == ["step"]
    proc = cli("diff", str(ckpt), str(changed), "--exclude", "model", "--exclude", "step")
    assert "identical state" in proc.stdout


def test_diff_dtype_shape_and_bfloat16(tmp_path: Path) -> None:
    import ml_dtypes

    a, b = tmp_path / "a", tmp_path / "b"
    trainstate.save(a, {"h": np.ones(4, ml_dtypes.bfloat16), "s": np.zeros(3), "i": np.arange(3)})
    trainstate.save(b, {"h": np.full(4, 1.5, ml_dtypes.bfloat16), "s": np.zeros(4), "i": np.arange(3, dtype=np.int32)})
    doc = cli_json("diff", str(a), str(b), code=1)
    changed = {c["name"]: c for c in doc["tensors"]["changed"]}
    assert changed["h"]["max_abs_diff"] == 0.5
    assert changed["s"]["reasons"] == ["shape"]
    assert changed["i"]["reasons"] == ["dtype"] and changed["i"]["different"] == 0


def names(run_dir: Path) -> list[str]:
    return sorted(p.name for p in run_dir.iterdir() if p.name.startswith("step_"))


def test_prune_dry_run_then_prune(run_dir: Path) -> None:
    before = sorted(p.name for p in run_dir.iterdir())
    doc = cli_json("prune", str(run_dir), "--keep-last", "1", "--keep-best", "val_loss:min:1", "--dry-run")
    assert doc["dry_run"] is True and doc["delete"] == ["step_00000000"]
    assert "best 1 val_loss (min)" in doc["keep"]["step_00000010"] and "newest" in doc["keep"]["step_00000020"]
    assert sorted(doc["would_sweep"]) == [".step_00000040.tmp-0123abcd", "step_00000030"]
    out = cli("prune", str(run_dir), "--keep-last", "1", "--keep-best", "val_loss:min:1", "--dry-run").stdout
    assert "would delete" in out and "dry run" in out
    assert sorted(p.name for p in run_dir.iterdir()) == before  # nothing deleted, nothing swept

    out = cli("prune", str(run_dir), "--keep-last", "1").stdout
    assert "deleted" in out and "step_00000030" in out  # the sweep of the crashed save is reported
    assert names(run_dir) == ["step_00000020"]


def test_prune_needs_a_policy(run_dir: Path) -> None:
    assert "at least one policy" in cli("prune", str(run_dir), code=2).stderr
    assert "METRIC:min|max" in cli("prune", str(run_dir), "--keep-best", "loss:avg", code=2).stderr


def test_pin_and_unpin_show_in_ls(run_dir: Path) -> None:
    cli("pin", str(run_dir), "10", "--reason", "best eval")
    pinned = {r["name"]: r["pinned"] for r in cli_json("ls", str(run_dir))["checkpoints"]}
    assert pinned["step_00000010"] is True and pinned["step_00000000"] is False
    assert "pinned" in cli_json("prune", str(run_dir), "--keep-last", "1")["keep"]["step_00000010"]
    assert names(run_dir) == ["step_00000010", "step_00000020"]
    cli("unpin", str(run_dir), "10")
    pinned = {r["name"]: r["pinned"] for r in cli_json("ls", str(run_dir))["checkpoints"]}
    assert pinned == {"step_00000010": False, "step_00000020": False}
    assert "step 99" in cli("pin", str(run_dir), "99", code=3).stderr


@pytest.mark.parametrize(
    "args",
    [
        ["ls", "{missing}"],
        ["inspect", "{missing}"],
        ["verify", "{missing}"],
        ["diff", "{ckpt}", "{missing}"],
        ["prune", "{missing}", "--keep-last", "1"],
    ],
)
def test_not_found_is_exit_3_and_one_line(tmp_path: Path, ckpt: Path, args: list[str]) -> None:
    missing = tmp_path / "nope"
    proc = cli(*(a.format(missing=missing, ckpt=ckpt) for a in args), code=3)
    assert proc.stdout == "" and len(proc.stderr.splitlines()) == 1 and "nope" in proc.stderr
    assert not missing.exists()  # prune did not create it


def test_incomplete_and_manager_dir_given_as_checkpoint(run_dir: Path) -> None:
    assert "never committed" in cli("inspect", str(run_dir / "step_00000030"), code=4).stderr
    assert "trainstate ls" in cli("verify", str(run_dir), code=2).stderr


def test_manager_dir_given_as_checkpoint_says_how_to_use_it(run_dir: Path) -> None:
    for command in ("inspect", "verify"):
        err = cli(command, str(run_dir), code=2).stderr
        assert "CheckpointManager" in err and "step_00000020" in err and f"trainstate ls {run_dir}" in err
        assert "never committed" not in err and len(err.splitlines()) == 1


def test_a_users_link_to_a_checkpoint_works_everywhere(run_dir: Path) -> None:
    latest = run_dir / "latest"
    os.symlink("step_00000020", latest)
    assert {"path": "step", "value": 7} in cli_json("inspect", str(latest))["values"]
    assert cli_json("verify", str(latest))["ok"] is True
    assert cli("diff", str(latest), str(run_dir / "step_00000020")).returncode == 0
    (row,) = cli_json("ls", str(latest))["checkpoints"]
    assert row["step"] == 20 and row["status"] == "complete" and row["metrics"] == {"val_loss": 2.0}
    assert "step_00000020" in cli("ls", str(run_dir)).stdout  # the run's listing is unchanged by the link


def test_torch_checkpoint_without_importing_torch(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    a, b = tmp_path / "a", tmp_path / "b"
    trainstate.save(a, {"model": model, "step": 1})
    with torch.no_grad():
        model.bias += 1
    trainstate.save(b, {"model": model, "step": 1})
    code = (
        "import sys; from trainstate._cli import main; rc = main(sys.argv[1:]); "
        "assert 'torch' not in sys.modules, 'the CLI imported torch'; sys.exit(rc)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, "diff", str(a), str(b), "--json"],
        capture_output=True,
        text=True,
        check=False,
        env=ENV,
        timeout=60,
    )
    assert proc.returncode == 1, proc.stderr
    (bias,) = json.loads(proc.stdout)["tensors"]["changed"]
    assert bias["name"] == "model.bias" and bias["max_abs_diff"] == pytest.approx(1.0)
    kinds = {t["name"]: t["kind"] for t in cli_json("inspect", str(a))["tensors"]}
    assert kinds == {"model.weight": "torch", "model.bias": "torch"}


def test_ls_shows_pin_reasons_and_a_second_pin_says_it_changed_nothing(tmp_path):
    with trainstate.CheckpointManager(tmp_path, every_steps=1) as mgr:
        mgr.save(1, {"x": np.arange(3)})
    first = cli("pin", str(tmp_path), "1", "--reason", "paper figure")
    assert "pinned step_00000001" in first.stdout
    again = cli("pin", str(tmp_path), "1", "--reason", "other")
    assert "already pinned" in again.stdout and "not changed" in again.stdout
    assert "paper figure" in cli("ls", str(tmp_path)).stdout


def test_ls_lists_the_checkpoints_no_manager_wrote(tmp_path):
    """A Lightning run's folder: TrainstateCheckpointIO writes one checkpoint per path Lightning names."""
    for name in ("epoch=0-step=10.ckpt", "epoch=1-step=20.ckpt", "last.ckpt"):
        trainstate.save(tmp_path / name, state())
    (tmp_path / "notes").mkdir()  # a folder that holds no checkpoint is not one
    (tmp_path / "notes" / "readme.txt").write_text("not a checkpoint")
    doc = cli_json("ls", str(tmp_path))
    rows = [(r["name"], r["step"], r["status"]) for r in doc["checkpoints"]]
    assert rows == [(n, None, "complete") for n in ("epoch=0-step=10.ckpt", "epoch=1-step=20.ckpt", "last.ckpt")]
    assert all(r["nbytes"] > 0 and r["path"] == str(tmp_path / r["name"]) for r in doc["checkpoints"])
    out = cli("ls", str(tmp_path)).stdout
    assert "no checkpoints" not in out and "last.ckpt" in out and "3 complete" in out


def test_ls_of_a_lightning_folder_shows_an_unfinished_save_and_orders_names_by_their_numbers(tmp_path):
    """A kill during a name's first async save leaves its reserved, empty folder: ls hid it; and epoch=10 was
    listed before epoch=2."""
    for name in ("epoch=2.ckpt", "epoch=10.ckpt"):
        trainstate.save(tmp_path / name, state())
    (tmp_path / "epoch=11.ckpt").mkdir()  # reserved by an async save that never committed
    rows = [(r["name"], r["status"]) for r in cli_json("ls", str(tmp_path))["checkpoints"]]
    assert rows == [("epoch=2.ckpt", "complete"), ("epoch=10.ckpt", "complete"), ("epoch=11.ckpt", "incomplete")]


def test_ls_inspect_and_history_agree_on_an_incremental_checkpoints_sizes(tmp_path):
    """Three numbers, each named: a checkpoint's size (its manifest and every data file it reads, shared ones
    included), what its save wrote (new data files and the manifest), and nothing else under those names."""
    from trainstate._cli._output import size

    base = np.random.default_rng(0).random(100_000, dtype=np.float32)  # frozen: written once, then shared
    with trainstate.CheckpointManager(tmp_path, every_steps=1, incremental=True) as mgr:
        for step in range(3):
            mgr.save(step, {"base": base, "head": np.full(1000, step, np.float32)})
    saves = {s["step"]: s["nbytes"] for s in cli_json("history", str(tmp_path))["saves"]}
    rows = {r["step"]: r for r in cli_json("ls", str(tmp_path))["checkpoints"]}
    manifest = (tmp_path / "step_00000002" / "manifest.json").stat().st_size
    for step in range(3):
        assert rows[step]["written_nbytes"] == saves[step]
        assert rows[step]["size_nbytes"] == rows[step]["nbytes"] + rows[step]["manifest_nbytes"]
    assert rows[2]["manifest_nbytes"] == manifest and saves[2] < rows[2]["size_nbytes"] / 10
    one = cli_json("inspect", str(tmp_path / "step_00000002"))
    assert (one["size_nbytes"], one["written_nbytes"]) == (rows[2]["size_nbytes"], saves[2])
    wrote, whole = size(saves[2]), size(rows[2]["size_nbytes"])
    ls_text = cli("ls", str(tmp_path)).stdout
    assert "wrote" in ls_text and wrote in ls_text and whole in ls_text and "size:" in ls_text
    inspect_text = cli("inspect", str(tmp_path / "step_00000002")).stdout
    assert f"this save wrote {wrote}" in inspect_text and whole in inspect_text
    history_text = cli("history", str(tmp_path)).stdout
    assert "wrote" in history_text and wrote in history_text
    # the manager's CheckpointInfo and prune say the same size as ls
    infos = {c.step: c for c in trainstate.CheckpointManager(tmp_path, read_only=True).list()}
    assert all(infos[s].nbytes + infos[s].manifest_nbytes == rows[s]["size_nbytes"] for s in range(3))
    assert whole in cli("prune", str(tmp_path), "--keep-last", "1", "--dry-run").stdout


def test_ls_shows_a_checkpoint_a_delete_moved_aside_as_deleting(run_dir: Path) -> None:
    """A local delete renames the checkpoint to ``.<name>.del-<random>`` first; killed then, it is being
    deleted, not an unfinished save."""
    os.rename(run_dir / "step_00000000", run_dir / ".step_00000000.del-0123abcd")
    rows = {r["name"]: r for r in cli_json("ls", str(run_dir))["checkpoints"]}
    assert rows[".step_00000000.del-0123abcd"]["status"] == "deleting"
    assert rows[".step_00000040.tmp-0123abcd"]["status"] == "incomplete"
    assert "2 complete, 2 incomplete, 1 deleting" in cli("ls", str(run_dir)).stdout


def test_ls_marks_a_checkpoint_from_a_newer_trainstate(tmp_path):
    from helpers import reseal_manifest

    with trainstate.CheckpointManager(tmp_path, every_steps=1) as mgr:
        mgr.save(1, {"x": np.arange(3)})
        mgr.save(2, {"x": np.arange(3)})
    reseal_manifest(tmp_path / "step_00000002", lambda b: b.update(format_version="2.0"))
    assert "newer format" in cli("ls", str(tmp_path)).stdout
    cli("inspect", str(tmp_path / "step_00000002"), code=5)


def test_diff_does_not_call_a_checkpoint_with_a_damaged_header_identical(tmp_path):
    trainstate.save(tmp_path / "a", {"x": np.arange(3)})
    trainstate.save(tmp_path / "b", {"x": np.arange(3)})
    data = next((tmp_path / "b").glob("*.safetensors"))
    raw = bytearray(data.read_bytes())
    raw[10] ^= 0x01  # inside the safetensors header
    data.write_bytes(bytes(raw))
    cli("diff", str(tmp_path / "a"), str(tmp_path / "b"), code=5)
