"""CheckpointManager(incremental=True): unchanged tensors are not written again, every checkpoint still loads
on its own, and retention never takes bytes a kept checkpoint uses (trainstate._incremental)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import trainstate
from helpers import assert_same, cli

BASE = np.random.default_rng(0).standard_normal((300, 1000)).astype(np.float32)  # 1.2 MB: pieces, and frozen


def state(step: int, base: np.ndarray = BASE) -> dict:
    """A frozen base, a small adapter trained every step, and a counter."""
    return {"base": base, "adapter": np.full((8, 8), step, dtype=np.float32), "step": step}


def manager(root: Path, **kwargs) -> trainstate.CheckpointManager:
    kwargs = {
        "every_steps": 1,
        "fsync": False,
        "capture_rng": False,
        "incremental": True,
        "collective": False,
        **kwargs,
    }
    return trainstate.CheckpointManager(root, **kwargs)


def pool(root: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in (root / "_shared").iterdir()}


def named(root: Path) -> set[str]:
    """The pool files the committed manifests of the run name."""
    out: set[str] = set()
    for m in root.glob("*/manifest.json"):
        out |= {f["path"] for f in json.loads(m.read_bytes())["files"] if f.get("pool")}
    return out


def check_all(root: Path, expected: dict[int, dict]) -> None:
    """Every checkpoint of the run loads alone (plain trainstate.load), equals what was saved, and verifies."""
    steps = sorted(int(p.name[5:]) for p in root.glob("step_*"))
    assert steps == sorted(expected)
    for step in steps:
        path = root / f"step_{step:08d}"
        assert_same(expected[step], trainstate.load(path))
        with trainstate.open(path) as ck:
            ck.verify()


def test_an_unchanged_tensor_is_not_written_again_and_a_changed_one_is(tmp_path):
    with manager(tmp_path) as mgr:
        mgr.save(1, state(1))
        first = pool(tmp_path)
        assert sum(first.values()) > BASE.nbytes
        mgr.save(2, state(2))
        grown = {n: s for n, s in pool(tmp_path).items() if n not in first}
        assert len(grown) == 1 and sum(grown.values()) < 2000  # the adapter and a header: not the base
        assert mgr.history()[-1].nbytes < 5000  # what the save wrote, manifest included
        mgr.save(3, state(3, BASE + 1))  # the base changed too: written again
        assert sum(pool(tmp_path).values()) > sum(first.values()) + BASE.nbytes
    check_all(tmp_path, {1: state(1), 2: state(2), 3: state(3, BASE + 1)})
    step2 = json.loads((tmp_path / "step_00000002" / "manifest.json").read_bytes())
    step1 = json.loads((tmp_path / "step_00000001" / "manifest.json").read_bytes())
    assert step2["format_version"] == "1.4"
    assert step2["tensors"]["base"]["chunks"] == step1["tensors"]["base"]["chunks"]  # copied verbatim
    assert [p.name for p in (tmp_path / "step_00000002").iterdir()] == ["manifest.json"]


def test_retention_deletes_old_checkpoints_and_the_pool_keeps_what_the_rest_use(tmp_path):
    with manager(tmp_path, keep_last=2) as mgr:
        for step in range(1, 6):
            mgr.save(step, state(step))
            assert set(pool(tmp_path)) == named(tmp_path)  # nothing unreferenced stays behind
    assert [c.step for c in mgr.list()] == [4, 5]
    assert len(pool(tmp_path)) <= 4  # step 1's files (the base), and the two adapters
    check_all(tmp_path, {4: state(4), 5: state(5)})
    with manager(tmp_path, read_only=True) as ro:
        info = ro.list()[-1]
    assert info.shared > BASE.nbytes and info.nbytes - info.shared < 5000


@pytest.mark.parametrize("keeper", ["pinned", "best"])
def test_a_checkpoint_kept_by_a_pin_or_keep_best_keeps_its_bytes(tmp_path, keeper):
    old = BASE * 2
    kwargs = {"keep_last": 1} if keeper == "pinned" else {"keep_best": ("loss", "min", 1)}
    with manager(tmp_path, **kwargs) as mgr:
        mgr.save(1, state(1, old), metrics={"loss": 0.1})  # the only checkpoint with this base
        if keeper == "pinned":
            assert mgr.pin(1, "keep")
        mgr.save(2, state(2), metrics={"loss": 0.5})
        mgr.save(3, state(3), metrics={"loss": 0.6})
        assert [c.step for c in mgr.list()] == [1, 3]
        check_all(tmp_path, {1: state(1, old), 3: state(3)})
        if keeper == "pinned":  # once it goes, so do the bytes only it used
            mgr.unpin(1)
            mgr.prune()
            assert [c.step for c in mgr.list()] == [3]
            assert set(pool(tmp_path)) == named(tmp_path)
            assert sum(pool(tmp_path).values()) < 2 * BASE.nbytes


def test_after_a_restart_the_next_save_dedupes_against_the_newest_checkpoint(tmp_path):
    with manager(tmp_path) as mgr:
        mgr.save(1, state(1))
        mgr.save(2, state(2))
    before = sum(pool(tmp_path).values())
    with manager(tmp_path) as mgr:
        target = state(0, np.zeros_like(BASE))
        assert mgr.restore_latest(target) == 3
        assert_same(state(2), target)
        mgr.save(3, state(3))
        assert mgr.history()[-1].nbytes < 5000
    assert sum(pool(tmp_path).values()) - before < 2000
    check_all(tmp_path, {1: state(1), 2: state(2), 3: state(3)})


def test_async_saves_share_bytes_too(tmp_path):
    with manager(tmp_path, async_save=True, max_in_flight=2, keep_last=2) as mgr:
        for step in range(1, 6):
            mgr.save(step, state(step))
        mgr.wait()
        assert all(r.error is None for r in mgr.history())
        assert [r.nbytes < 5000 for r in mgr.history()] == [False, True, True, True, True]
    check_all(tmp_path, {4: state(4), 5: state(5)})
    assert set(pool(tmp_path)) == named(tmp_path)


def test_a_damaged_shared_byte_fails_verify_of_every_checkpoint_that_uses_it(tmp_path):
    with manager(tmp_path) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state(step))
    with trainstate.open(tmp_path / "step_00000003") as ck:
        chunk = ck.manifest.tensors["base"].chunks[0]
    data = tmp_path / "_shared" / chunk.file
    raw = bytearray(data.read_bytes())
    raw[chunk.byte_range[0] + 5000] ^= 0x10
    data.write_bytes(bytes(raw))
    for step in (1, 2, 3):
        with trainstate.open(tmp_path / f"step_{step:08d}") as ck:
            with pytest.raises(trainstate.CorruptCheckpointError, match="base"):
                ck.verify()
        proc = cli("verify", str(tmp_path / f"step_{step:08d}"), code=None)
        assert proc.returncode != 0 and "base" in proc.stdout + proc.stderr


def test_a_checkpoint_copied_without_its_pool_says_how_to_copy_it_and_consolidate_makes_it_whole(tmp_path):
    run = tmp_path / "run"
    with manager(run) as mgr:
        mgr.save(1, state(1))
        mgr.save(2, state(2))
    shutil.copytree(run / "step_00000002", tmp_path / "copied")
    with pytest.raises(trainstate.CorruptCheckpointError, match="incremental.*consolidate"):
        trainstate.load(tmp_path / "copied")
    with pytest.raises(trainstate.InvalidArgumentError, match="consolidate"):
        trainstate.pack(run / "step_00000002")
    trainstate.consolidate(run / "step_00000002", tmp_path / "whole")
    cli("consolidate", str(run / "step_00000001"), str(tmp_path / "whole1"))
    for name in ("whole", "whole1"):
        manifest = json.loads((tmp_path / name / "manifest.json").read_bytes())
        assert not any(f.get("pool") for f in manifest["files"]) and manifest["format_version"] != "1.4"
    shutil.rmtree(run)  # the copies stand alone
    assert_same(state(2), trainstate.load(tmp_path / "whole"))
    assert_same(state(1), trainstate.load(tmp_path / "whole1"))
    trainstate.pack(tmp_path / "whole")


def test_export_writes_weights_that_stand_alone(tmp_path):
    run = tmp_path / "run"
    with manager(run) as mgr:
        mgr.save(1, state(1))
        mgr.save(2, state(2))
    trainstate.export(run / "step_00000002", tmp_path / "w.safetensors", select="*", format="safetensors")
    shutil.rmtree(run)
    from safetensors.numpy import load_file

    weights = load_file(str(tmp_path / "w.safetensors"))
    assert np.array_equal(weights["base"], BASE) and np.array_equal(weights["adapter"], state(2)["adapter"])


def test_ls_and_inspect_show_what_a_save_wrote_beside_what_it_uses(tmp_path):
    with manager(tmp_path) as mgr:
        mgr.save(1, state(1))
        mgr.save(2, state(2))
    listing = json.loads(cli("ls", str(tmp_path), "--json").stdout)
    rows = {r["step"]: r for r in listing["checkpoints"]}
    assert rows[1]["shared_nbytes"] == 0 and rows[2]["shared_nbytes"] > BASE.nbytes
    assert listing["pool_nbytes"] == sum(pool(tmp_path).values())
    assert "shared pool" in cli("ls", str(tmp_path)).stdout
    shown = cli("inspect", str(tmp_path / "step_00000002")).stdout
    assert "shared with earlier checkpoints" in shown and "1.4" in shown
    head = json.loads(cli("inspect", str(tmp_path / "step_00000002"), "--json").stdout)
    assert head["nbytes"] - head["shared_nbytes"] < 2000


def test_a_lora_fine_tune_with_adamw_resumes_exactly(tmp_path):
    """The way a user would run it: a frozen torch base, a trained low-rank adapter, AdamW on the adapter."""
    torch = pytest.importorskip("torch")

    def build(seed: int) -> dict:
        torch.manual_seed(seed)
        base = torch.nn.Linear(64, 64)
        base.requires_grad_(False)
        lora = torch.nn.Sequential(torch.nn.Linear(64, 4, bias=False), torch.nn.Linear(4, 64, bias=False))
        return {"base": base, "lora": lora, "optim": torch.optim.AdamW(lora.parameters(), lr=1e-2)}

    def train(s: dict, steps: int) -> None:
        for _ in range(steps):
            x = torch.randn(16, 64)
            loss = (s["base"](x) + s["lora"](x)).pow(2).mean()
            s["optim"].zero_grad()
            loss.backward()
            s["optim"].step()

    live = build(0)
    with trainstate.CheckpointManager(tmp_path, every_steps=1, keep_last=2, incremental=True) as mgr:
        for step in range(1, 4):
            train(live, 1)
            mgr.save(step, live)
        assert all(r.nbytes < 40000 for r in mgr.history()[1:])  # the base (16 kB) is written once
    resumed = build(1)
    with trainstate.CheckpointManager(tmp_path, incremental=True) as mgr:
        assert mgr.restore_latest(resumed) == 4
    for key in ("base", "lora"):
        for a, b in zip(live[key].state_dict().values(), resumed[key].state_dict().values()):
            assert torch.equal(a, b)
    torch.manual_seed(5)
    train(live, 1)
    torch.manual_seed(5)
    train(resumed, 1)
    assert torch.equal(live["lora"][0].weight, resumed["lora"][0].weight)


def test_a_manifest_whose_pool_flag_is_not_a_boolean_is_corrupt(tmp_path):
    from helpers import reseal_manifest

    with manager(tmp_path) as mgr:
        mgr.save(1, state(1))
    reseal_manifest(tmp_path / "step_00000001", lambda b: b["files"][0].update(pool="yes"))
    with pytest.raises(trainstate.CorruptCheckpointError, match="pool"):
        trainstate.load(tmp_path / "step_00000001")


def test_a_plain_manager_on_an_incremental_run_still_collects_its_pool(tmp_path):
    with manager(tmp_path) as mgr:
        mgr.save(1, state(1))
        mgr.save(2, state(2))
    with trainstate.CheckpointManager(tmp_path, every_steps=1, keep_last=1, capture_rng=False) as mgr:
        mgr.save(3, state(3))  # a full checkpoint: retention then leaves no manifest naming the pool
    assert pool(tmp_path) == {}
    check_all(tmp_path, {3: state(3)})


def test_a_save_that_fails_after_writing_its_pool_file_leaves_nothing_behind(tmp_path):
    import errno

    from trainstate._storage.faulty import FaultyStorage

    disk = FaultyStorage("create", at=10**9, error=errno.ENOSPC)
    with manager(tmp_path, storage=disk) as mgr:
        mgr.save(1, state(1))
        disk.at = disk.calls["create"] + 2  # save 2 creates its pool file, then fails creating its manifest
        with pytest.raises(trainstate.StorageError):
            mgr.save(2, state(2))
        assert set(pool(tmp_path)) == named(tmp_path)  # the failed save's pool file went with it
        assert mgr.save(2, state(2))  # and the step saves again, sharing the base
        assert mgr.history()[-1].nbytes < 5000
    check_all(tmp_path, {1: state(1), 2: state(2)})


def test_prune_reports_what_it_freed_not_what_the_deleted_checkpoints_referred_to(tmp_path):
    with manager(tmp_path) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state(step))
    before = sum(pool(tmp_path).values())
    manifests = sum((tmp_path / f"step_{s:08d}" / "manifest.json").stat().st_size for s in (1, 2))
    out = json.loads(cli("prune", str(tmp_path), "--keep-last", "1", "--json").stdout)
    assert out["delete"] == ["step_00000001", "step_00000002"]
    freed_from_pool = before - sum(pool(tmp_path).values())
    assert 0 < freed_from_pool < 5000  # two adapters, not the base
    assert out["freed_bytes"] == freed_from_pool + manifests  # and the deleted checkpoints' manifests
    check_all(tmp_path, {3: state(3)})
