"""CUDA paths: tensors keep their device, CUDA RNG, async save's pinned staging, an NCCL process group.

Skipped where no CUDA device is present (the CI machine); run on a GPU machine with
``pytest tests/gpu``. Each test says which user path it covers.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import trainstate

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
HERE = Path(__file__).parent


def _trained(device: str, seed: int = 0, steps: int = 2) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Dropout(0.2), torch.nn.Linear(64, 8)
    ).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    for _ in range(steps):
        _step(model, opt, device)
        sched.step()
    return {"model": model, "optim": opt, "sched": sched, "step": steps, "rng": trainstate.RNGState()}


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, device: str) -> None:
    x = torch.randn(16, 32, device=device)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def _tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.detach().cpu().clone() for k, v in state["model"].state_dict().items()}
    for i, s in enumerate(state["optim"].state.values()):
        out.update({f"optim.{i}.{k}": v.detach().cpu().clone() for k, v in s.items() if torch.is_tensor(v)})
    return out


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_cuda_state_restores_onto_cuda_and_onto_cpu(tmp_path: Path) -> None:
    state = _trained("cuda")
    state["half"] = torch.randn(5, 7, device="cuda").to(torch.bfloat16)
    trainstate.save(tmp_path / "c", state)
    want = _tensors(state)

    fresh = _trained("cuda", seed=1, steps=0)
    fresh["half"] = torch.zeros(5, 7, device="cuda", dtype=torch.bfloat16)
    out = trainstate.load(tmp_path / "c", fresh)
    _assert_equal(_tensors(fresh), want)
    assert all(p.device.type == "cuda" for p in fresh["model"].parameters())
    assert all(v.device.type == "cuda" for s in fresh["optim"].state.values() for v in s.values() if v.dim())
    assert fresh["half"].device.type == "cuda" and torch.equal(fresh["half"].cpu(), state["half"].cpu())
    assert out["step"] == 2

    on_cpu = _trained("cpu", seed=1, steps=0)  # a GPU run's checkpoint, evaluated on a CPU box
    on_cpu["half"] = torch.zeros(5, 7, dtype=torch.bfloat16)
    trainstate.load(tmp_path / "c", on_cpu)
    _assert_equal(_tensors(on_cpu), want)


def test_restore_onto_cuda_in_rounds_through_a_small_host_buffer(tmp_path: Path, monkeypatch: Any) -> None:
    """Host staging smaller than the state: many rounds, one tensor larger than the buffer, odd sizes."""
    from trainstate._frameworks import torch as torch_adapter
    from trainstate._restore import ring

    monkeypatch.setattr(ring, "MIN_SLOT_BYTES", 1 << 20)
    monkeypatch.setattr(ring, "LANE_BYTES", 1 << 16)
    allocated: list[int] = []
    real = torch_adapter.staging
    monkeypatch.setattr(torch_adapter, "staging", lambda n, like: allocated.append(n) or real(n, like))
    torch.manual_seed(0)
    saved = {f"t{i}": torch.randn(n, device="cuda") for i, n in enumerate([3, 70_000, 1_000_000, 5, 262_145, 1])}
    saved["bf16"] = torch.randn(123_457, device="cuda").to(torch.bfloat16)
    trainstate.save(tmp_path / "c", saved)
    target = {k: torch.zeros_like(v) for k, v in saved.items()}
    trainstate.load(tmp_path / "c", target)
    for k, v in saved.items():
        assert target[k].device.type == "cuda" and torch.equal(target[k].cpu(), v.cpu()), k
    assert sum(allocated) <= ring.SLOTS * (1 << 20)  # the ring, nothing else: host memory bounded by it


def test_the_ring_overlaps_copies_without_overwriting_a_slot_in_flight(tmp_path: Path, monkeypatch: Any) -> None:
    """Many rounds through a small ring with the device kept busy, so a slot refilled before its copy ran
    would land the wrong bytes; the current stream's earlier work is ordered before the restore's copies."""
    from trainstate._restore import ring

    monkeypatch.setattr(ring, "MIN_SLOT_BYTES", 2 << 20)
    monkeypatch.setattr(ring, "LANE_BYTES", 1 << 16)
    torch.manual_seed(1)
    saved = {f"w{i}": torch.randn(1_500_000 + i, device="cuda") for i in range(24)}  # ~144 MB, 2 MiB slots
    trainstate.save(tmp_path / "c", saved)
    target = {k: torch.zeros_like(v) for k, v in saved.items()}
    busy = torch.randn(4096, 4096, device="cuda")
    for _ in range(8):
        busy = busy @ busy / 4096  # queued on the current stream before the restore
    target["w0"].fill_(3.0)  # queued too: the restore's copy of w0 must land after it
    trainstate.load(tmp_path / "c", target)
    for k, v in saved.items():
        assert torch.equal(target[k], v), k


def test_compressed_checkpoint_restores_onto_cuda_through_the_host_buffer(tmp_path: Path, monkeypatch: Any) -> None:
    """zstd chunks decoded into the host staging buffer, in rounds, then copied to the device."""
    pytest.importorskip("zstandard")
    import trainstate._transforms as transforms
    from trainstate._restore import ring

    monkeypatch.setattr(ring, "MIN_SLOT_BYTES", 1 << 20)
    monkeypatch.setattr(ring, "LANE_BYTES", 1 << 16)
    monkeypatch.setattr(transforms, "TRANSFORM_CHUNK_BYTES", 256 << 10)
    saved = {f"t{i}": torch.arange(n, device="cuda") % 7 for i, n in enumerate([3, 70_000, 1_000_000, 262_145])}
    saved["bf16"] = (torch.arange(123_457, device="cuda") % 5).to(torch.bfloat16)
    trainstate.save(tmp_path / "c", saved, compression="zstd")
    target = {k: torch.zeros_like(v) for k, v in saved.items()}
    trainstate.load(tmp_path / "c", target)
    for k, v in saved.items():
        assert target[k].device.type == "cuda" and torch.equal(target[k].cpu(), v.cpu()), k


def test_cpu_checkpoint_restores_onto_cuda(tmp_path: Path) -> None:
    state = _trained("cpu")
    trainstate.save(tmp_path / "c", state)
    target = _trained("cuda", seed=1, steps=0)
    trainstate.load(tmp_path / "c", target)
    _assert_equal(_tensors(target), _tensors(state))
    assert next(target["model"].parameters()).device.type == "cuda"


def test_cuda_rng_is_saved_and_restored(tmp_path: Path) -> None:
    torch.cuda.manual_seed_all(7)
    torch.rand(3, device="cuda")  # move the generator off its seed
    trainstate.save(tmp_path / "c", {"rng": trainstate.RNGState()})
    expected = torch.rand(1000, device="cuda").cpu()
    torch.cuda.manual_seed_all(99)
    trainstate.load(tmp_path / "c", {"rng": trainstate.RNGState()})
    assert torch.equal(torch.rand(1000, device="cuda").cpu(), expected)


def test_async_save_captures_cuda_tensors_before_training_changes_them(tmp_path: Path) -> None:
    """save() returns while the write goes on; the next in-place GPU updates must not reach the file."""
    big = torch.nn.Linear(2048, 2048).cuda()  # 16 MB: the copy is not instantaneous
    state = {"model": big, "step": 0}
    with trainstate.CheckpointManager(tmp_path / "run", every_steps=1, async_save=True) as mgr:
        for step in range(1, 4):
            expected = {k: v.detach().cpu().clone() for k, v in big.state_dict().items()}
            state["step"] = step
            mgr.save(step, state)
            with torch.no_grad():  # queued right behind the staging copies on the same stream
                for p in big.parameters():
                    p.mul_(-3.0).add_(1.0)
            mgr.wait()
            target = torch.nn.Linear(2048, 2048)
            trainstate.load(mgr.path_for(step), {"model": target, "step": 0})
            for k, v in target.state_dict().items():
                assert torch.equal(v, expected[k]), (step, k)


def test_exact_resume_on_cuda_with_dropout(tmp_path: Path) -> None:
    """Stop after step 6 (objects dropped, as in a crash), restore, run to 10: bit-identical on the GPU."""

    def run(stop_at: int | None, resume: bool) -> dict[str, torch.Tensor]:
        state = _trained("cuda", seed=3, steps=0)
        with trainstate.CheckpointManager(tmp_path / "run", every_steps=3, async_save=True) as mgr:
            start = mgr.restore_latest(state) if resume else None
            if start is None:
                torch.manual_seed(11)
            for step in range(start or 1, 11):  # restore_latest gives the step to continue from
                _step(state["model"], state["optim"], "cuda")
                state["sched"].step()
                state["step"] = step
                mgr.save(step, state)
                if step == stop_at:
                    break
        return _tensors(state)

    torch.use_deterministic_algorithms(True)
    try:
        reference = run(None, resume=False)
        shutil.rmtree(tmp_path / "run")
        run(6, resume=False)
        resumed = run(None, resume=True)
    finally:
        torch.use_deterministic_algorithms(False)
    _assert_equal(resumed, reference)


def test_fsdp2_on_an_nccl_group_with_the_manager(tmp_path: Path) -> None:
    """One rank on NCCL (the training backend on GPUs): FSDP2 on a CUDA mesh, async manager saves, whose
    coordination runs on trainstate's own gloo group; then the checkpoint loads in a plain CPU process."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parents[1] / "src"), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(HERE / "nccl_rank.py"), str(tmp_path / "run")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    saved = torch.load(tmp_path / "expected.pt", weights_only=True)

    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 16))
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    with trainstate.CheckpointManager(tmp_path / "run") as mgr:
        assert mgr.restore_latest({"model": plain, "optim": opt, "step": 0}) == 7  # step 6 done, 7 next
    for k, v in plain.state_dict().items():
        assert torch.equal(v, saved[k]), k
    assert opt.state_dict()["state"], "the AdamW moments came back"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
