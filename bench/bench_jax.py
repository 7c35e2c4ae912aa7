"""A Flax NNX training state, trainstate beside Orbax: save, restore into a target, async save, in one run.

State: a GPT-2-small-shaped Flax NNX transformer (bench_core's shape: 12 layers, d=768, vocab 50257, 1024
positions, the LM head tied to the token embedding: 124M float32 parameters) and its ``nnx.Optimizer`` with
``optax.adamw`` after one step on random gradients, so the moments are not zeros: 1.49 GB, the torch
benches' size. Random values, nothing downloaded. Both libraries save the same pure pytree
``{"model": nnx.state(model), "optim": nnx.state(optimizer)}`` (nnx.State of Variables, Optax's NamedTuples
inside), as Flax's checkpointing guide saves ``nnx.state(model)`` with Orbax.

Every method runs once per round, in interleaved rounds (the order rotated each round) after one untimed
warm-up round; the table shows medians and, for ratios, the median [min-max] of the per-round ratios, so a
busy machine slows every method of a round alike. Every save starts with no dirty pages left by the one
before (os.sync, untimed).

- trainstate: ``trainstate.save(path, state, fsync=..., compression=None | "zstd:3")`` (threads=2, its
  default); restore ``trainstate.load(path, target)``.
- Orbax, as users call it: ``ocp.StandardCheckpointer().save(path, state)`` then ``wait_until_finished()``
  (StandardCheckpointer is an AsyncCheckpointer: save() returns before the bytes are written; that time is
  printed too); restore ``.restore(path, abstract)``. Its defaults: OCDBT + zarr3, each array compressed with
  zstd level 3 (StandardCheckpointer has no option to turn that off).
- Orbax uncompressed: ``ocp.AsyncCheckpointer(ocp.PyTreeCheckpointHandler(use_compression=False))``, the
  handler StandardCheckpointHandler wraps, so that both sides write raw bytes.
- restore targets: trainstate and Orbax both restore into ``jax.tree.map(ocp.utils.to_shape_dtype_struct,
  state)``, the abstract target (ShapeDtypeStructs with each array's sharding) Orbax documents: nothing is
  allocated before the restore, and a new tree is built with the target's treedef, dtypes and shardings. The
  floor restores into a fresh tree of zeros (a new one each time, untimed) for its treedef. Warm page
  cache (dropping it would slow everyone else on this shared machine). Every restored tree is asserted
  identical to the saved state, every round: same treedef, dtypes and bytes.
- async: each library's manager, one kept for the whole run, 2 checkpoints kept:
  ``trainstate.CheckpointManager(dir, keep_last=2, async_save=True, fsync=True)`` and
  ``ocp.CheckpointManager(dir, options=CheckpointManagerOptions(max_to_keep=2,
  enable_async_checkpointing=True))`` with ``args=ocp.args.StandardSave(state)``. "blocked" is the wall time
  of ``save()`` (the training loop's pause); "until durable" runs from that call until ``mgr.wait()`` /
  ``wait_until_finished()`` returns. Each manager's last checkpoint is restored and checked at the end.
- the torch path, for the same bytes: torch tensors of the arrays' shapes and bytes, on the device the JAX
  arrays are on (CUDA when JAX is on a GPU; rows left out if torch is not importable or has no such device):
  ``trainstate.save(path, tensors, fsync=True)``, ``trainstate.load(path, tensors_on_the_device)`` (restored in
  place) and the same async manager. The "accelerator path" table sets the JAX rows beside them: async save's
  time blocked (and as a share of the same library's synchronous save), restore onto the device, save.
- on an accelerator every save is given fresh device arrays (``jax.device_put(x, may_alias=False)``, untimed):
  JAX keeps an array's host copy once it was read (``np.asarray``, ``copy_to_host_async``), and a second save
  of the same arrays would time no device-to-host transfer at all. On the CPU reading an array copies nothing.
- floor: one file of the arrays' raw bytes, unbuffered os.write (with fsync: file, directory and parent, as
  trainstate does); read back as a user would by hand: readinto fresh NumPy arrays, then ``jax.device_put``
  (a second copy) and ``tree_unflatten`` with the target's treedef -- a floor for saves, a plain baseline
  for restores (trainstate's restore can beat it).

fsync, as strace shows on this machine (orbax-checkpoint 0.12.8, tensorstore 0.1.86): trainstate with
fsync=True fsyncs every data file, the manifest and the temporary directory, renames it, then fsyncs the
parent (the commit is durable); fsync=False calls no fsync. Orbax by default fsyncs what TensorStore writes
(the OCDBT data files, manifests and their directories: TensorStore's ``file_io_sync`` defaults to true) but
not the JSON files Orbax writes itself (_METADATA, _CHECKPOINT_METADATA, commit_success.txt,
array_metadatas/) nor the parent after its final rename of ``*.orbax-checkpoint-tmp``: its data is durable,
its commit is not. "fsync" rows set that beside trainstate's fsync=True. For the "no fsync" row Orbax gets
``file_io_sync`` off, which it has no public option for: the bench sets it in Orbax's private TensorStore
context defaults around those saves only (strace: no fsync left).

Needs jax, flax, optax, orbax-checkpoint and zstandard (``pip install -e ".[bench,zstd]"``). Run from the repo root (full size: 12 minutes on 2 cores shared with a test run, 11 GB
peak memory, ~8 GB of disk under --dir at peak; --quick: under a minute):
    .venv/bin/python bench/bench_jax.py                     # the 1.49 GB state, 3 rounds
    .venv/bin/python bench/bench_jax.py --quick             # a 25 MB state: smoke run
    .venv/bin/python bench/bench_jax.py --rounds 5 --dir /data/tmp
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import logging
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

import trainstate

GB = 1e9
State = dict[str, Any]


@dataclass(frozen=True)
class Shape:
    n_layer: int
    vocab: int
    n_pos: int
    d: int = 768


FULL, QUICK = Shape(12, 50257, 1024), Shape(2, 2000, 128, d=256)  # FULL: bench_core's GPT-2 small


# -- the state ---------------------------------------------------------------------------------------


class Block(nnx.Module):
    """GPT-2's block: parameters only (the bench never runs the model)."""

    def __init__(self, d: int, rngs: nnx.Rngs) -> None:
        self.ln_1, self.ln_2 = nnx.LayerNorm(d, rngs=rngs), nnx.LayerNorm(d, rngs=rngs)
        self.c_attn, self.attn_proj = nnx.Linear(d, 3 * d, rngs=rngs), nnx.Linear(d, d, rngs=rngs)
        self.c_fc, self.mlp_proj = nnx.Linear(d, 4 * d, rngs=rngs), nnx.Linear(4 * d, d, rngs=rngs)


class GPT2(nnx.Module):
    def __init__(self, s: Shape, rngs: nnx.Rngs) -> None:
        self.wte, self.wpe = nnx.Embed(s.vocab, s.d, rngs=rngs), nnx.Embed(s.n_pos, s.d, rngs=rngs)
        self.h = nnx.List([Block(s.d, rngs) for _ in range(s.n_layer)])
        self.ln_f = nnx.LayerNorm(s.d, rngs=rngs)  # the LM head is wte.attend: no parameters of its own


def build_state(shape: Shape) -> State:
    """The model and its AdamW state after one step on random gradients, as one pure pytree.

    Values come from NumPy, not from the model's initializers: JAX's eager init compiles every op for
    every shape, over a minute on this machine for numbers that do not matter here.
    """
    rng = np.random.default_rng(0)

    def normal(like: Any, scale: float) -> jax.Array:
        return jnp.asarray(scale * rng.standard_normal(like.shape, np.float32))

    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: GPT2(shape, nnx.Rngs(0))))
    model = nnx.merge(graphdef, jax.tree.map(lambda x: normal(x, 0.02), abstract))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-4, weight_decay=0.01), wrt=nnx.Param)
    grads = jax.tree.map(lambda p: normal(p, 1e-3), nnx.state(model, nnx.Param))
    nnx.jit(lambda opt, m, g: opt.update(m, g))(optimizer, model, grads)
    return {"model": nnx.state(model), "optim": nnx.state(optimizer)}


def assert_same(restored: Any, state: State, who: str) -> None:
    """``restored`` has ``state``'s treedef, and every leaf its dtype, shape and bytes."""
    if jax.tree.structure(restored) != jax.tree.structure(state):
        raise AssertionError(f"{who}: the restored tree's structure differs from the saved state's")
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(restored), jax.tree.leaves(state)):
        if not isinstance(a, jax.Array) or a.dtype != b.dtype or not np.array_equal(np.asarray(a), np.asarray(b)):
            raise AssertionError(f"{who}: {jax.tree_util.keystr(path)} differs from the saved value")


# -- methods: save(path) -> seconds until the call returned (None: synchronous), restore(path, target) ---


@dataclass
class Method:
    name: str
    save: Callable[[Path], float | None]
    restore: Callable[[Path, State], Any] | None = None
    check: Callable[[Any], None] | None = None  # checks what restore returned (None: the JAX state's check)
    target: Callable[[], Any] | None = None  # makes the restore target, untimed (None: zeros like the state)


def torch_twin(state: State) -> tuple[dict[str, Any], Callable[[], dict[str, Any]], Callable[[Any], None]] | None:
    """Torch tensors of ``state``'s arrays' shapes and bytes on the device the JAX arrays are on, a function
    making zeroed tensors like them (a restore target), and a check of a restored dict; None without torch
    or without that device."""
    try:
        import torch
    except ImportError:
        return None
    platform = jax.devices()[0].platform
    if platform != "cpu" and not torch.cuda.is_available():
        return None
    device = "cpu" if platform == "cpu" else "cuda"
    hosts = [np.array(leaf) for leaf in jax.tree.leaves(state)]
    hosts = [h.view(np.int16) if h.dtype == ml_dtypes.bfloat16 else h for h in hosts]  # the same bytes
    tensors = {f"t{i}": torch.from_numpy(h).to(device) for i, h in enumerate(hosts)}

    def zeros() -> dict[str, Any]:
        return {k: torch.zeros_like(t) for k, t in tensors.items()}

    def check(restored: Any) -> None:
        for k, t in tensors.items():
            if not torch.equal(restored[k], t):
                raise AssertionError(f"torch path: {k} differs from the saved value")

    return tensors, zeros, check


def make_durable(path: Path) -> None:
    """What trainstate does when asked to fsync: every file, the directory, and its parent."""
    for p in [*sorted(path.rglob("*")), path, path.parent]:
        fd = os.open(p, os.O_RDONLY | (os.O_DIRECTORY if p.is_dir() else 0))
        os.fsync(fd)
        os.close(fd)


def raw_save(state: State, path: Path, fsync: bool) -> None:
    path.mkdir()
    with open(path / "raw.bin", "wb", buffering=0) as f:  # unbuffered: each write() is one os.write
        for leaf in jax.tree.leaves(state):
            view, pos = memoryview(np.asarray(leaf)).cast("B"), 0
            while pos < len(view):
                pos += f.write(view[pos:])
    if fsync:
        make_durable(path)


def raw_restore(path: Path, target: State) -> State:
    leaves, treedef = jax.tree.flatten(target)
    out = []
    with open(path / "raw.bin", "rb", buffering=0) as f:
        for leaf in leaves:
            host = np.empty(leaf.shape, leaf.dtype)
            if f.readinto(memoryview(host).cast("B")) != host.nbytes:
                raise EOFError(f"{path} is short")
            out.append(jax.device_put(host, leaf.sharding))
    return jax.tree.unflatten(treedef, out)


@contextlib.contextmanager
def orbax_without_fsync() -> Iterator[None]:
    """TensorStore's ``file_io_sync`` off for the Orbax saves inside (private defaults, restored after)."""
    contexts = (ts_utils._BASE_TS_CONTEXT, ts_utils._DEFAULT_OCDBT_TS_CONTEXT)
    for c in contexts:
        c["file_io_sync"] = False
    try:
        yield
    finally:
        for c in contexts:
            c.pop("file_io_sync", None)


def async_save(save: Callable[[], Any], wait: Callable[[], Any]) -> float:
    """Start a save, return the seconds until that call returned; the caller times the whole (until wait)."""
    t0 = time.perf_counter()
    save()
    returned = time.perf_counter() - t0
    wait()
    return returned


def methods(state: State, root: Path) -> tuple[list[Method], Callable[[], None]]:
    """The methods, and a function that checks each manager's last checkpoint and closes the managers."""
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    standard = ocp.StandardCheckpointer()
    uncompressed = ocp.AsyncCheckpointer(ocp.PyTreeCheckpointHandler(use_compression=False))
    restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)
    ts_manager = trainstate.CheckpointManager(
        root / "ts-manager", keep_last=2, async_save=True, fsync=True, collective=False
    )
    options = ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=True)
    orbax_manager = ocp.CheckpointManager(root / "orbax-manager", options=options)
    ts_steps, orbax_steps, torch_steps = itertools.count(), itertools.count(), itertools.count()
    twin = torch_twin(state)
    torch_manager = None
    if twin is not None:
        torch_manager = trainstate.CheckpointManager(
            root / "torch-manager", keep_last=2, async_save=True, fsync=True, collective=False
        )

    def ts(fsync: bool, compression: str | None = None) -> Callable[[Path], None]:
        def save(p: Path) -> None:
            trainstate.save(p, state, fsync=fsync, compression=compression)

        return save

    def orbax_uncompressed(p: Path) -> float:
        return async_save(
            lambda: uncompressed.save(p, args=ocp.args.PyTreeSave(state)), uncompressed.wait_until_finished
        )

    def orbax_uncompressed_nosync(p: Path) -> float:
        with orbax_without_fsync():
            return orbax_uncompressed(p)

    def ts_async(_: Path) -> float:
        step = next(ts_steps)
        return async_save(lambda: ts_manager.save(step, state), ts_manager.wait)

    def orbax_async(_: Path) -> float:
        step = next(orbax_steps)
        save = lambda: orbax_manager.save(step, args=ocp.args.StandardSave(state))  # noqa: E731
        return async_save(save, orbax_manager.wait_until_finished)

    def finish() -> None:
        ts_manager.wait()
        orbax_manager.wait_until_finished()
        ts_last, orbax_last = ts_manager.latest(), orbax_manager.latest_step()
        assert ts_last is not None and orbax_last is not None
        # trainstate.load on the manager's path: CheckpointManager.restore hands back its target, not the
        # tree a restore into immutable JAX containers builds (reported as a bug beside this bench)
        restored = trainstate.load(ts_manager.path_for(ts_last.step), abstract)
        assert_same(restored, state, "trainstate CheckpointManager's last checkpoint")
        restored = orbax_manager.restore(orbax_last, args=ocp.args.StandardRestore(abstract))
        assert_same(restored, state, "Orbax CheckpointManager's last checkpoint")
        for closing in (ts_manager, orbax_manager, standard, uncompressed):
            closing.close()
        if torch_manager is not None:
            torch_manager.close()

    found = [
        Method("floor", lambda p: raw_save(state, p, False)),
        Method("floor, fsync", lambda p: raw_save(state, p, True), raw_restore),
        Method("trainstate", ts(False)),
        Method("trainstate, fsync", ts(True), lambda p, _: trainstate.load(p, abstract)),
        Method("trainstate zstd:3, fsync", ts(True, "zstd:3"), lambda p, _: trainstate.load(p, abstract)),
        Method(
            "Orbax",
            lambda p: async_save(lambda: standard.save(p, state), standard.wait_until_finished),
            lambda p, _: standard.restore(p, abstract),
        ),
        Method(
            "Orbax uncompressed",
            orbax_uncompressed,
            lambda p, _: uncompressed.restore(p, args=ocp.args.PyTreeRestore(item=abstract, restore_args=restore_args)),
        ),
        Method("Orbax uncompressed, no fsync", orbax_uncompressed_nosync),
        Method("trainstate manager", ts_async),
        Method("Orbax manager", orbax_async),
    ]
    if twin is not None and torch_manager is not None:
        tensors, zeros, check = twin
        manager = torch_manager

        def torch_async(_: Path) -> float:
            step = next(torch_steps)
            return async_save(lambda: manager.save(step, tensors), manager.wait)

        found += [
            Method(
                "torch, fsync",
                lambda p: trainstate.save(p, tensors, fsync=True),
                trainstate.load,
                check,
                zeros,
            ),
            Method("torch manager", torch_async),
        ]
    return found, finish


def zeros_like(state: State) -> State:
    return jax.tree.map(jnp.zeros_like, state)


# -- harness -----------------------------------------------------------------------------------------


@dataclass
class Samples:
    save: dict[str, list[float]]
    returned: dict[str, list[float]]
    restore: dict[str, list[float]]
    stored: dict[str, int]


def run(state: State, root: Path, rounds: int) -> Samples:
    found, finish = methods(state, root)
    out = Samples({}, {}, {}, {})
    fresh = jax.devices()[0].platform != "cpu"
    try:
        for r in range(rounds + 1):  # round 0: warm-up (first-call costs: tracing, thread pools, buffers)
            for m in found[r % len(found) :] + found[: r % len(found)]:
                if fresh:  # new device arrays, with no host copy JAX kept from a read (untimed)
                    state.update(jax.tree.map(lambda x: jax.device_put(x, x.sharding, may_alias=False), dict(state)))
                path = root / "ckpt"
                shutil.rmtree(path, ignore_errors=True)
                os.sync()  # no dirty pages carried from one save into the next one's time
                t0 = time.perf_counter()
                returned = m.save(path)
                took = time.perf_counter() - t0
                if path.exists():
                    out.stored[m.name] = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
                restored, restore_took = None, 0.0
                if m.restore is not None:
                    target = zeros_like(state) if m.target is None else m.target()
                    t0 = time.perf_counter()
                    restored = m.restore(path, target)
                    restore_took = time.perf_counter() - t0
                    del target
                    if m.check is None:
                        assert_same(restored, state, f"{m.name} restore")
                    else:
                        m.check(restored)
                    del restored
                if r > 0:
                    out.save.setdefault(m.name, []).append(took)
                    if returned is not None:
                        out.returned.setdefault(m.name, []).append(returned)
                    if m.restore is not None:
                        out.restore.setdefault(m.name, []).append(restore_took)
            log(f"round {r}{' (warm-up)' if r == 0 else ''} done, 1-min load average {os.getloadavg()[0]:.1f}")
    finally:
        finish()
    return out


# -- report ------------------------------------------------------------------------------------------


def report(s: Samples, nbytes: int, leaves: int, load: tuple[float, float], shape: Shape, rounds: int) -> str:
    def cell(samples: dict[str, list[float]], name: str | None) -> float | None:
        return statistics.median(samples[name]) if name else None

    def fmt(x: float | None) -> str:
        return "—" if x is None else f"{x:.3f} s" if x < 1 else f"{x:.2f} s"

    def ratio(samples: dict[str, list[float]], a: str | None, base: str) -> str:
        if a is None:
            return "—"
        per_round = [x / y for x, y in zip(samples[a], samples[base])]
        return f"{statistics.median(per_round):.2f}x [{min(per_round):.2f}-{max(per_round):.2f}]"

    # (operation, samples, trainstate row, Orbax row, floor row)
    table: list[tuple[str, dict[str, list[float]], str, str, str | None]] = [
        (
            "save, defaults: trainstate fsync / Orbax (zstd-3, data fsync'd)",
            s.save,
            "trainstate, fsync",
            "Orbax",
            "floor, fsync",
        ),
        ("save, fsync, both uncompressed", s.save, "trainstate, fsync", "Orbax uncompressed", "floor, fsync"),
        ("save, fsync, both zstd level 3", s.save, "trainstate zstd:3, fsync", "Orbax", None),
        ("save, no fsync, both uncompressed", s.save, "trainstate", "Orbax uncompressed, no fsync", "floor"),
        (
            "restore into a target, defaults (trainstate raw / Orbax zstd-3)",
            s.restore,
            "trainstate, fsync",
            "Orbax",
            "floor, fsync",
        ),
        (
            "restore into a target, both uncompressed",
            s.restore,
            "trainstate, fsync",
            "Orbax uncompressed",
            "floor, fsync",
        ),
        ("restore into a target, both zstd level 3", s.restore, "trainstate zstd:3, fsync", "Orbax", None),
        ("async manager save: time blocked", s.returned, "trainstate manager", "Orbax manager", None),
        ("async manager save: until durable / finished", s.save, "trainstate manager", "Orbax manager", None),
    ]
    cpu = [x.split(":", 1)[1].strip() for x in Path("/proc/cpuinfo").read_text().splitlines() if "model name" in x]
    versions = ", ".join(f"{d} {version(d)}" for d in ("jax", "flax", "optax", "orbax-checkpoint", "tensorstore"))
    lines = [
        f"state: Flax NNX GPT-2 shape (n_layer={shape.n_layer}, d={shape.d}, vocab={shape.vocab}) + AdamW state: "
        f"{leaves} arrays, {nbytes / GB:.3f} GB",
        f"machine: {cpu[0] if cpu else platform.processor()}, {os.cpu_count()} cores, a shared and noisy VM "
        f"(1-min load average at start / end: {load[0]:.1f} / {load[1]:.1f})",
        f"versions: python {platform.python_version()}, {versions}, trainstate {trainstate.__version__}",
        "",
        f"{rounds} interleaved rounds after a warm-up, medians. Ratios: Orbax / trainstate and floor / trainstate, "
        "per round, median [min-max]; above 1 means trainstate is faster.",
        "",
        f"| operation ({nbytes / GB:.2f} GB) | trainstate | Orbax | Orbax / trainstate | floor (raw bytes) "
        "| floor / trainstate |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for op, samples, ts, orbax, floor in table:
        lines.append(
            f"| {op} | {fmt(cell(samples, ts))} | {fmt(cell(samples, orbax))} | {ratio(samples, orbax, ts)} "
            f"| {fmt(cell(samples, floor))} | {ratio(samples, floor, ts)} |"
        )
    lines += ["", *accelerator_table(s, nbytes)]
    stored = ("trainstate", "trainstate zstd:3, fsync", "Orbax", "Orbax uncompressed", "floor")
    sizes = ", ".join(f"{name.removesuffix(', fsync')} {s.stored[name] / GB:.3f} GB" for name in stored)
    lines += [
        "",
        f"- stored: {sizes}.",
        f"- StandardCheckpointer.save() returned after {fmt(cell(s.returned, 'Orbax'))} (it is asynchronous); the "
        "save rows include wait_until_finished(). trainstate.save is synchronous.",
        "- fsync: trainstate fsync=True syncs data files, manifest, directory and parent (a durable commit). Orbax "
        "by default syncs TensorStore's data files and directories, not its own metadata files nor the parent "
        "after its final rename (data durable, commit not). 'no fsync': trainstate fsync=False; Orbax with "
        "TensorStore's file_io_sync off (a private setting patched by the bench). Async rows: trainstate "
        "fsync=True, Orbax default.",
        "- restore: trainstate and Orbax into the same abstract ShapeDtypeStruct tree; the floor into a fresh zeros "
        "tree. Every restored tree was asserted identical to the saved state (treedef, "
        "dtypes, bytes); warm page cache. The restore 'floor' is a hand-written raw read plus jax.device_put (two "
        "copies), not a lower bound.",
    ]
    return "\n".join(lines)


def accelerator_table(s: Samples, nbytes: int) -> list[str]:
    """The JAX path beside the torch path (same bytes, same device) and Orbax: async save's time blocked, also
    as a share of each one's synchronous save, restore onto the device, and save."""

    def per_round(a: list[float], b: list[float]) -> list[float]:
        return [x / y for x, y in zip(a, b)]

    def med(xs: list[float] | None, pct: bool = False) -> str:
        if not xs:
            return "—"
        m = statistics.median(xs)
        return f"{100 * m:.1f}%" if pct else f"{m:.3f} s" if m < 1 else f"{m:.2f} s"

    def rel(xs: list[float] | None, base: list[float]) -> str:
        if not xs:
            return "—"
        r = per_round(xs, base)
        return f"{statistics.median(r):.2f}x [{min(r):.2f}-{max(r):.2f}]"

    torch = "torch manager" in s.returned
    rows = [  # (operation, JAX samples, torch samples, Orbax samples, whether shares of a save)
        ("async save: time blocked", s.returned["trainstate manager"], s.returned.get("torch manager"),
         s.returned["Orbax manager"], False),
        ("async save: time blocked, share of a sync save",
         per_round(s.returned["trainstate manager"], s.save["trainstate, fsync"]),
         per_round(s.returned["torch manager"], s.save["torch, fsync"]) if torch else None,
         per_round(s.returned["Orbax manager"], s.save["Orbax"]), True),
        ("restore onto the device (into a target)", s.restore["trainstate, fsync"], s.restore.get("torch, fsync"),
         s.restore["Orbax"], False),
        ("save, fsync (Orbax: its defaults)", s.save["trainstate, fsync"], s.save.get("torch, fsync"), s.save["Orbax"],
         False),
    ]  # fmt: skip
    lines = [
        f"Accelerator path, device {jax.devices()[0].platform} ({jax.devices()[0].device_kind}): trainstate JAX beside "
        f"trainstate torch (same {nbytes / GB:.2f} GB, same device{'' if torch else '; torch not importable here'}) "
        "and Orbax. Ratios: other / JAX per round, median [min-max] (above 1: JAX faster; for shares: lower).",
        "",
        "| operation | trainstate JAX | torch path | torch / JAX | Orbax | Orbax / JAX |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for op, jx, th, ob, pct in rows:
        lines.append(f"| {op} | {med(jx, pct)} | {med(th, pct)} | {rel(th, jx)} | {med(ob, pct)} | {rel(ob, jx)} |")
    return lines


def log(msg: str) -> None:
    print(f"  {msg}", file=sys.stderr, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a 25 MB state, for a smoke run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None, help="parent for the checkpoints (default: a temp dir)")
    args = ap.parse_args()
    logging.getLogger("absl").setLevel(logging.ERROR)  # Orbax logs every save
    shape = QUICK if args.quick else FULL
    t0, load = time.perf_counter(), os.getloadavg()[0]
    state = build_state(shape)
    leaves = jax.tree.leaves(state)
    nbytes = sum(x.nbytes for x in leaves)
    log(f"state: {len(leaves)} arrays, {nbytes / GB:.3f} GB, built in {time.perf_counter() - t0:.0f} s")
    root = Path(tempfile.mkdtemp(prefix="bench-jax-", dir=args.dir)).absolute()
    try:
        samples = run(state, root, args.rounds)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(report(samples, nbytes, len(leaves), (load, os.getloadavg()[0]), shape, args.rounds))
    print(f"\n(total {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
