"""The ring that restores accelerator targets (``_restore/ring.py``), driven on the CPU.

No accelerator runs here, so the ring's device side is played by an adapter whose copies are *deferred*:
each queued copy reads its host buffer only when the ring waits for it, as a CUDA copy on a stream of its
own may. A ring that refilled a slot before waiting for its copies would hand the device the next round's
bytes, and the restored values would differ. tests/gpu/test_cuda.py runs the same paths on CUDA.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import trainstate
from trainstate._frameworks import torch as torch_adapter
from trainstate._restore import ring
from trainstate._restore.read import read_views
from trainstate.errors import CorruptCheckpointError

MIB = 1 << 20


class Deferred:
    """The torch adapter, except that copies happen when waited for (a device that has not run them yet)."""

    def __init__(self) -> None:
        self.allocated: list[int] = []
        self.queued = 0
        self.waited = 0

    def staging(self, nbytes: int, like: Any) -> np.ndarray:
        self.allocated.append(nbytes)
        return torch_adapter.staging(nbytes, like)

    def cuttable(self, value: Any) -> bool:
        return torch_adapter.cuttable(value)

    def copy_in_async(self, pairs: list[tuple[Any, int | None, np.ndarray]]) -> Callable[[], list[Any]]:
        self.queued += 1

        def wait() -> list[Any]:
            self.waited += 1
            return torch_adapter.copy_in_async(pairs)()

        return wait


def _staged(ck: Any, adapter: Any, targets: dict[str, torch.Tensor]) -> list[ring.Staged]:
    return [ring.Staged(k, adapter, t, None, t.nbytes, adapter.cuttable(t)) for k, t in targets.items()]


def _saved(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    saved = {
        "big": torch.randn(5 * MIB // 4 + 3),  # 5 MiB and a bit: cut into parts across rounds
        "odd": torch.randn(70_001),
        "bf16": torch.randn(123_457).to(torch.bfloat16),
        "tiny": torch.randn(3),
        "matrix": torch.randn(700, 900),  # 2.4 MiB
    }
    for i in range(6):
        saved[f"layer{i}"] = torch.randn(300_000 + i)
    trainstate.save(tmp_path / "c", saved)
    return tmp_path / "c", saved


def test_every_byte_lands_through_a_ring_smaller_than_the_state(tmp_path: Path) -> None:
    path, saved = _saved(tmp_path)
    adapter = Deferred()
    targets = {k: torch.zeros_like(v) for k, v in saved.items()}
    with trainstate.open(path) as ck:
        whole = partial(read_views, ck, verify=True, threads=2)
        allocated = ring.read_to_device(ck, _staged(ck, adapter, targets), whole, verify=True, threads=2, size=2 * MIB)
    for k, v in saved.items():
        assert torch.equal(targets[k], v), k
    state_bytes = sum(v.nbytes for v in saved.values())
    assert state_bytes > 6 * 2 * MIB  # the state is several times the ring
    assert allocated == sum(adapter.allocated) == ring.SLOTS * 2 * MIB  # three slots, nothing else
    assert adapter.queued == adapter.waited >= 6  # every round's copies waited for, many rounds


def test_a_target_that_cannot_be_cut_gets_a_buffer_of_its_own(tmp_path: Path) -> None:
    path, saved = _saved(tmp_path)
    adapter = Deferred()
    targets = {"big": torch.zeros(saved["big"].numel(), 2)[:, 0], "tiny": torch.zeros(3)}  # not contiguous
    assert not targets["big"].is_contiguous()
    with trainstate.open(path) as ck:
        whole = partial(read_views, ck, verify=True, threads=2)
        allocated = ring.read_to_device(ck, _staged(ck, adapter, targets), whole, verify=True, threads=2, size=2 * MIB)
    assert torch.equal(targets["big"], saved["big"]) and torch.equal(targets["tiny"], saved["tiny"])
    assert sorted(adapter.allocated) == sorted([2 * MIB, -(-saved["big"].nbytes // 64) * 64])
    assert allocated == sum(adapter.allocated)


def test_one_stored_tensor_lands_in_two_targets_in_one_round(tmp_path: Path) -> None:
    # A tied tensor (GPT-2's embedding and head) restored into a state that holds it twice: two staged reads of
    # one name, each its own array, in the same round. Parts were matched with ==, elementwise on arrays.
    w = torch.randn(64, 8)
    trainstate.save(tmp_path / "c", {"emb": w, "head": w})
    adapter = Deferred()
    emb, head = torch.zeros(64, 8), torch.zeros(64, 8)
    with trainstate.open(tmp_path / "c") as ck:
        staged = [ring.Staged("emb", adapter, t, None, t.nbytes, True) for t in (emb, head)]
        whole = partial(read_views, ck, verify=True, threads=2)
        ring.read_to_device(ck, staged, whole, verify=True, threads=2, size=2 * MIB)
    assert torch.equal(emb, w) and torch.equal(head, w)


def test_a_tied_module_restores_into_accelerator_targets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The same through trainstate.load, CPU tensors standing for accelerator ones (the ring path).
    monkeypatch.setattr(torch_adapter, "on_accelerator", lambda value: isinstance(value, torch.Tensor))

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(10, 4)
            self.head = torch.nn.Linear(4, 10, bias=False)
            self.head.weight = self.emb.weight

    torch.manual_seed(0)
    saved = Tied()
    trainstate.save(tmp_path / "c", {"model": saved})
    model = Tied()
    trainstate.load(tmp_path / "c", {"model": model})
    assert torch.equal(model.emb.weight, saved.emb.weight) and model.head.weight is model.emb.weight


def test_an_empty_chunk_listed_with_pieces_reads_as_on_the_host(tmp_path: Path) -> None:
    # The parser takes an empty chunk with "pieces" (no checksum covers no byte); the ring indexed its spans.
    from helpers import reseal_manifest

    trainstate.save(tmp_path / "c", {"e": torch.zeros(0, 3), "x": torch.ones(5)})

    def pieced(body: dict) -> None:
        body["tensors"]["e"]["chunks"][0]["pieces"] = {"bytes": MIB, "checksums": []}
        body["format_version"] = "1.1"

    reseal_manifest(tmp_path / "c", pieced, layout=True)
    adapter = Deferred()
    targets = {"e": torch.zeros(0, 3), "x": torch.zeros(5)}
    with trainstate.open(tmp_path / "c") as ck:
        whole = partial(read_views, ck, verify=True, threads=2)
        ring.read_to_device(ck, _staged(ck, adapter, targets), whole, verify=True, threads=2, size=2 * MIB)
    assert torch.equal(targets["x"], torch.ones(5))


def _byte_offset(path: Path, name: str, at: int) -> tuple[Path, int]:
    entry = json.loads((path / "manifest.json").read_text())["tensors"][name]["chunks"][0]
    return path / entry["file"], entry["byte_range"][0] + at


def test_a_damaged_piece_never_reaches_the_target(tmp_path: Path) -> None:
    path, saved = _saved(tmp_path)
    file, offset = _byte_offset(path, "big", 3 * MIB + 10)  # in the fourth piece of "big"
    with open(file, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))
    adapter = Deferred()
    targets = {k: torch.full_like(v, 7) for k, v in saved.items()}
    with trainstate.open(path) as ck:
        whole = partial(read_views, ck, verify=True, threads=2)
        with pytest.raises(CorruptCheckpointError, match="piece 4 of"):
            ring.read_to_device(ck, _staged(ck, adapter, targets), whole, verify=True, threads=2, size=2 * MIB)
    assert adapter.queued == adapter.waited  # copies queued before the failure landed before the error
    big = targets["big"].view(torch.uint8)
    damaged = big[2 * MIB : 4 * MIB]  # the round holding the damaged piece (parts of 2 MiB)
    assert torch.equal(damaged, torch.full((2 * MIB // 4,), 7.0).view(torch.uint8)), "no byte of that round landed"
    assert torch.equal(big[: 2 * MIB], saved["big"].view(torch.uint8)[: 2 * MIB])  # rounds before it: restored


def test_slot_size_follows_the_threads() -> None:
    assert ring.slot_bytes(1) == ring.MIN_SLOT_BYTES
    assert ring.slot_bytes(32) == 32 * ring.LANE_BYTES > ring.MIN_SLOT_BYTES


def test_numpy_adapter_fills_byte_ranges() -> None:
    from trainstate._frameworks import numpy as numpy_adapter

    target = np.zeros(10, np.float32)
    numpy_adapter.copy_in_async([(target, 8, np.arange(8, dtype=np.uint8))])()
    assert bytes(target.view(np.uint8)[8:16]) == bytes(range(8)) and not target.view(np.uint8)[:8].any()
