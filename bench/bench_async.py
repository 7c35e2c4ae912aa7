"""Async-save benchmark: how long a checkpoint save blocks the training loop, trainstate next to DCP.

State: the GPT-2-small training state of bench_core.py (124M float32 parameters + AdamW moments, ~1.5 GB in
~600 tensors), held as {"model": model, "optim": opt, "step": 1}. Every number is the median of --repeats.

"blocking" is the wall time of the call the training loop makes; "background" is the wall time from that
call's return until the checkpoint is durable (the write and fsync, off the training thread).

1. trainstate.CheckpointManager(dir, every_steps=1, keep_last=2, fsync=True): save() with async_save=False
   (the baseline) and async_save=True. Async saves are timed three ways:
   - first save of a fresh manager (its staging buffer is allocated and first touched inside save());
   - a later save (staging buffer reused) with nothing in flight (mgr.wait() before it, untimed);
   - steady state: --work seconds of fake training (every tensor of the state updated in place, then
     matmuls) between saves, no wait() -- a save still in flight when the next one starts is waited for
     inside save(), so it counts as blocking.
   The history() records' write_seconds + commit_seconds are reported next to the measured background.
2. torch.distributed.checkpoint: dcp.save (baseline) and dcp.async_save -- with its default staging (the
   FileSystemWriter makes a fresh CPU copy every call), and with a reused DefaultStager (its cached
   staging storages are DCP's counterpart of trainstate's staging buffer), timed the same three ways.
   The state dict (get_state_dict) is built inside the timed region, as trainstate's save() does it too.
3. reference: a copy of every tensor into a preallocated / freshly allocated buffer (the floor for staging).

After each steady-state run the newest checkpoint is restored into the (since modified) live state and
compared with a fingerprint taken at save time, so a save that did not snapshot the state would fail.

Run from the repo root:
    .venv/bin/python bench/bench_async.py                   # ~1.5 GB state, ~3 min on 2 cores
    .venv/bin/python bench/bench_async.py --quick           # ~0.09 GB state, smoke run
    .venv/bin/python bench/bench_async.py --dir /data/tmp --repeats 5 --work 6 --json async.json
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist
from torch.distributed import checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict

import trainstate

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_core as core

State = dict[str, Any]
GB = 1e9
TARGET = 0.15  # async blocking <= 15% of a synchronous save
DCP_THREADS = 2  # FileSystemWriter writer threads, as trainstate's default threads=2


class Row:
    """One measured method: per-save samples of blocking / background seconds."""

    def __init__(self, lib: str, kind: str, name: str) -> None:
        self.lib, self.kind, self.name = lib, kind, name  # kind: sync | async | ref
        self.blocking: list[float] = []
        self.background: list[float] = []
        self.history_bg: list[float] = []  # trainstate: write_seconds + commit_seconds from history()
        self.work_rate: list[float] = []  # steady state: fake-work rate while a save is in flight
        self.note = ""

    def add(self, blocking: float, background: float | None = None, history_bg: float | None = None) -> None:
        self.blocking.append(blocking)
        if background is not None:
            self.background.append(background)
        if history_bg is not None:
            self.history_bg.append(history_bg)

    def as_dict(self) -> dict[str, Any]:
        return {
            "lib": self.lib,
            "kind": self.kind,
            "name": self.name,
            "blocking": self.blocking,
            "background": self.background,
            "history_bg": self.history_bg,
            "work_rate": self.work_rate,
            "note": self.note,
        }


def med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def log(msg: str) -> None:
    core.log(msg)


def live_tensors(state: State) -> list[torch.Tensor]:
    return list(core.flat_tensors(state).values())


# -- fake training between saves ---------------------------------------------------------------------


class Work:
    """--work seconds of "training": update every tensor of the state in place, then matmuls (or sleep).

    The in-place update is what makes async saving need a snapshot; the matmul rate while a background
    save is in flight, relative to the rate with nothing in flight, shows what the background write costs
    the training loop on this machine.
    """

    def __init__(self, seconds: float, kind: str) -> None:
        self.seconds, self.kind = seconds, kind
        self.a = torch.randn(512, 512)
        self.b = torch.randn(512, 512)

    def mutate(self, state: State, poll: Callable[[], None] = lambda: None) -> None:
        with torch.no_grad():
            for t in live_tensors(state):
                t.add_(1.0)
                poll()

    def run(
        self, state: State, in_flight: Callable[[], bool], t_returned: float | None
    ) -> tuple[float | None, float | None, float | None]:
        """One interval. Returns (matmuls/s while the last save was in flight, matmuls/s with nothing in
        flight, background seconds of the last save as seen by polling ``in_flight``, None if unseen)."""
        start = time.perf_counter()
        busy = t_returned is not None and in_flight()
        done_at = start if t_returned is not None and not busy else None

        def poll() -> None:
            nonlocal busy, done_at
            if busy and not in_flight():
                busy, done_at = False, time.perf_counter()

        self.mutate(state, poll)
        counts, spans = [0, 0], [0.0, 0.0]
        while (now := time.perf_counter()) - start < self.seconds:
            if self.kind == "matmul":
                torch.mm(self.a, self.b)
            else:
                time.sleep(0.005)
            i = 0 if busy else 1
            counts[i] += 1
            spans[i] += time.perf_counter() - now
            poll()
        rates = [c / s if s > 0.05 and self.kind == "matmul" else None for c, s in zip(counts, spans)]
        bg = None if done_at is None or t_returned is None else done_at - t_returned
        return rates[0], rates[1], bg


def relative_rates(free_rates: list[float], *rows: Row) -> float:
    """Turn the rows' matmul rates into fractions of the median rate with nothing in flight."""
    idle = statistics.median(free_rates) if free_rates else 0.0
    for row in rows:
        row.work_rate = [x / idle for x in row.work_rate] if idle else []
    return idle


# -- trainstate ----------------------------------------------------------------------------------------


def manager(path: Path, async_save: bool) -> trainstate.CheckpointManager:
    return trainstate.CheckpointManager(path, every_steps=1, keep_last=2, async_save=async_save, fsync=True)


def ts_sync(state: State, path: Path, repeats: int, steps: Any) -> Row:
    row = Row("trainstate", "sync", "trainstate CheckpointManager save(), async_save=False")
    with manager(path, False) as mgr:
        for _ in range(2):  # warm-up; from here on every save also deletes one (keep_last=2)
            mgr.save(next(steps), state)
        for _ in range(repeats):
            step = next(steps)
            t0 = time.perf_counter()
            if not mgr.save(step, state):
                raise AssertionError(f"step {step} was not saved")
            row.add(time.perf_counter() - t0)
            rec = mgr.history()[-1]
            row.history_bg.append(rec.write_seconds + rec.commit_seconds)
    log(f"trainstate sync: {med(row.blocking):.3f}s")
    return row


def ts_async_idle(state: State, path: Path, repeats: int, steps: Any) -> tuple[Row, Row]:
    first = Row("trainstate", "async", "trainstate async_save=True, first save (allocates staging buffer)")
    later = Row("trainstate", "async", "trainstate async_save=True, later save, nothing in flight")
    for _ in range(repeats):
        gc.collect()
        with manager(path, True) as mgr:
            for row in (first, later):
                mgr.wait()  # untimed: nothing in flight when the timed save starts
                step = next(steps)
                t0 = time.perf_counter()
                if not mgr.save(step, state):
                    raise AssertionError(f"step {step} was not saved")
                t1 = time.perf_counter()
                mgr.wait()
                t2 = time.perf_counter()
                rec = mgr.history()[-1]
                if rec.step != step or not rec.background:
                    raise AssertionError(f"unexpected history record {rec}")
                row.add(t1 - t0, t2 - t1, rec.write_seconds + rec.commit_seconds)
    log(f"trainstate async first: {med(first.blocking):.3f}s, later: {med(later.blocking):.3f}s")
    return first, later


def ts_async_steady(state: State, path: Path, repeats: int, steps: Any, work: Work) -> tuple[Row, Row, float]:
    first = Row("trainstate", "async", "trainstate async_save=True, steady state, first save")
    later = Row("trainstate", "async", "trainstate async_save=True, steady state, later saves")
    free_rates: list[float] = []
    with manager(path, True) as mgr:
        mgr.prepare(state)  # what restore_latest() does at the top of a real loop: the buffer is reserved
        saved: list[int] = []  # on a helper thread while the first steps train
        t_returned: float | None = None
        for i in range(repeats + 1):
            n_done = len(mgr.history())
            busy_rate, free_rate, bg = work.run(state, lambda n=n_done: len(mgr.history()) <= n, t_returned)
            if free_rate is not None:
                free_rates.append(free_rate)
            if i > 0:  # this interval followed save i-1
                if bg is not None:
                    (first if i == 1 else later).background.append(bg)
                if busy_rate is not None:
                    (first if i == 1 else later).work_rate.append(busy_rate)
            if i == repeats:
                reference = core.fingerprint(state)  # untimed; the state as the last save must store it
            step = next(steps)
            t0 = time.perf_counter()
            if not mgr.save(step, state):
                raise AssertionError(f"step {step} was not saved")
            t_returned = time.perf_counter()
            (first if i == 0 else later).blocking.append(t_returned - t0)
            saved.append(step)
        mgr.wait()
        by_step = {r.step: r for r in mgr.history()}
        for i, step in enumerate(saved):
            rec = by_step[step]
            (first if i == 0 else later).history_bg.append(rec.write_seconds + rec.commit_seconds)
        work.mutate(state)
        mgr.restore(saved[-1], state)
        if core.fingerprint(state) != reference:
            raise AssertionError("trainstate async checkpoint does not hold the state as of save()")
    log(
        f"trainstate async steady: first {med(first.blocking):.3f}s, later {med(later.blocking):.3f}s "
        "(restore verified)"
    )
    return first, later, relative_rates(free_rates, first, later)


# -- torch.distributed.checkpoint ----------------------------------------------------------------------


def dcp_state(state: State) -> dict[str, Any]:
    msd, osd = get_state_dict(state["model"], state["optim"])
    return {"model": msd, "optim": osd}


def writer(path: Path) -> dcp.FileSystemWriter:
    return dcp.FileSystemWriter(path, sync_files=True, thread_count=DCP_THREADS)


def dcp_sync(state: State, root: Path, repeats: int, dkw: dict[str, Any]) -> Row:
    row = Row("dcp", "sync", "dcp.save")
    dcp.save(dcp_state(state), storage_writer=writer(root / "warm"), **dkw)  # warm-up
    for i in range(repeats):
        clean(root)
        path = root / f"s{i}"
        t0 = time.perf_counter()
        dcp.save(dcp_state(state), storage_writer=writer(path), **dkw)
        row.add(time.perf_counter() - t0)
    clean(root)
    log(f"dcp sync: {med(row.blocking):.3f}s")
    return row


def dcp_async_default(state: State, root: Path, repeats: int, dkw: dict[str, Any]) -> Row:
    row = Row("dcp", "async", "dcp.async_save, default staging (fresh copy each save)")
    for i in range(repeats):
        clean(root)
        gc.collect()
        t0 = time.perf_counter()
        fut = dcp.async_save(dcp_state(state), storage_writer=writer(root / f"d{i}"), **dkw)
        t1 = time.perf_counter()
        fut.result()
        row.add(t1 - t0, time.perf_counter() - t1)
        del fut
    clean(root)
    log(f"dcp async default: {med(row.blocking):.3f}s")
    return row


def stager() -> DefaultStager:  # no pinned / shared memory, no async staging: all need an accelerator
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=False, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=False
        )
    )


def dcp_async_reused(state: State, root: Path, repeats: int, dkw: dict[str, Any]) -> tuple[Row, Row]:
    first = Row("dcp", "async", "dcp.async_save, reused DefaultStager, first save")
    later = Row("dcp", "async", "dcp.async_save, reused DefaultStager, later save, nothing in flight")
    for i in range(repeats):
        clean(root)
        gc.collect()
        st = stager()
        try:
            for j, row in enumerate((first, later)):
                t0 = time.perf_counter()
                fut = dcp.async_save(
                    dcp_state(state), storage_writer=writer(root / f"r{i}-{j}"), async_stager=st, **dkw
                )
                t1 = time.perf_counter()
                fut.result()
                row.add(t1 - t0, time.perf_counter() - t1)
        finally:
            st.close()
    clean(root)
    log(f"dcp async reused stager: first {med(first.blocking):.3f}s, later {med(later.blocking):.3f}s")
    return first, later


def dcp_async_steady(state: State, root: Path, repeats: int, dkw: dict[str, Any], work: Work) -> tuple[Row, Row, float]:
    first = Row("dcp", "async", "dcp.async_save, reused DefaultStager, steady state, first save")
    later = Row("dcp", "async", "dcp.async_save, reused DefaultStager, steady state, later saves")
    clean(root)
    st, fut, t_returned = stager(), None, None
    free_rates: list[float] = []
    paths: list[Path] = []
    try:
        for i in range(repeats + 1):
            for old in paths[:-2]:  # keep the last two, as trainstate's keep_last=2 (untimed)
                shutil.rmtree(old, ignore_errors=True)
            paths = paths[-2:]
            pending = fut
            busy_rate, free_rate, bg = work.run(state, lambda p=pending: p is not None and not p.done(), t_returned)
            if free_rate is not None:
                free_rates.append(free_rate)
            if i > 0:  # this interval followed save i-1
                if bg is not None:
                    (first if i == 1 else later).background.append(bg)
                if busy_rate is not None:
                    (first if i == 1 else later).work_rate.append(busy_rate)
            if i == repeats:
                reference = core.fingerprint(state)
            paths.append(root / f"t{i}")
            t0 = time.perf_counter()
            if fut is not None:
                fut.result()  # the documented pattern: one async save in flight at a time
            fut = dcp.async_save(dcp_state(state), storage_writer=writer(paths[-1]), async_stager=st, **dkw)
            t_returned = time.perf_counter()
            (first if i == 0 else later).blocking.append(t_returned - t0)
        assert fut is not None
        fut.result()
    finally:
        st.close()
    work.mutate(state)
    core.load_dcp(state, paths[-1])
    if core.fingerprint(state) != reference:
        raise AssertionError("dcp async checkpoint does not hold the state as of async_save()")
    clean(root)
    log(f"dcp async steady: first {med(first.blocking):.3f}s, later {med(later.blocking):.3f}s (restore verified)")
    return first, later, relative_rates(free_rates, first, later)


def probe_dcp(root: Path) -> list[str]:
    """What dcp.async_save needs in one CPU process without a process group, tried on a tiny state."""
    notes, sd = [], {"w": torch.randn(64, 64)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            dcp.async_save(sd, storage_writer=writer(root / "probe-a")).result()
            msg = next((str(w.message) for w in caught if "single process" in str(w.message)), "")
            notes.append(
                "dcp.async_save without a process group and without no_dist: works"
                + (f", warning {msg!r}" if msg else "")
            )
        except Exception as e:  # noqa: BLE001
            notes.append(f"dcp.async_save without a process group and without no_dist: {type(e).__name__}: {e}")
    try:
        w = dcp.FileSystemWriter(root / "probe-c", sync_files=True, cache_staged_state_dict=True)
        dcp.async_save(sd, storage_writer=w, no_dist=True).result()
        notes.append("FileSystemWriter(cache_staged_state_dict=True): works")
    except Exception as e:  # noqa: BLE001
        notes.append(
            f"FileSystemWriter(cache_staged_state_dict=True) fails on this build ({type(e).__name__}: "
            f"{e}) -- it pins its staging memory -- so the reused-staging rows use "
            "DefaultStager(StagingOptions(False, False, False, False)) passed as async_stager"
        )
    clean(root)
    return notes


# -- reference: the memory copy staging has to do ------------------------------------------------------


def memcpy_rows(state: State, repeats: int) -> tuple[Row, Row]:
    pre = Row("reference", "ref", "reference: copy_ every tensor into a preallocated buffer")
    fresh = Row("reference", "ref", "reference: copy_ every tensor into freshly allocated memory")
    tensors = [t.detach() for t in live_tensors(state)]
    buf = [torch.empty_like(t) for t in tensors]
    for dst, src in zip(buf, tensors):
        dst.copy_(src)
    for _ in range(repeats):
        t0 = time.perf_counter()
        for dst, src in zip(buf, tensors):
            dst.copy_(src)
        pre.add(time.perf_counter() - t0)
    del buf
    for _ in range(repeats):
        gc.collect()
        t0 = time.perf_counter()
        out = [t.clone() for t in tensors]
        fresh.add(time.perf_counter() - t0)
        del out
    log(f"memcpy: preallocated {med(pre.blocking):.3f}s, fresh {med(fresh.blocking):.3f}s")
    return pre, fresh


# -- harness / report ------------------------------------------------------------------------------------


def clean(root: Path) -> None:
    """Empty a scratch directory, then flush, so no earlier writeback lands inside a timed save."""
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    os.sync()


def fmt(x: float | None, spec: str = ".3f") -> str:
    return "—" if x is None else format(x, spec)


def ratio_of(row: Row, sync: dict[str, float]) -> float | None:
    b, base = med(row.blocking), sync.get(row.lib)
    return None if b is None or not base or row.kind != "async" else b / base


def table(rows: list[Row], sync: dict[str, float], nbytes: int) -> list[str]:
    out = [
        (
            "| method | saves | blocking s (median) | min–max | background s | history write+commit s "
            "| work rate during bg | blocking / own sync save | ≤15% |"
        ),
        "|---|---:|---:|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        b = med(r.blocking)
        ratio = ratio_of(r, sync)
        if r.kind == "sync":
            rtxt, ok = "1.00 (baseline)", "—"
        elif ratio is None:
            rtxt, ok = "—", "—"
        else:
            rtxt, ok = (
                f"{100 * ratio:.1f}%",
                ("PASS" if ratio <= TARGET else "MISS")
                if r.lib == "trainstate"
                else ("yes" if ratio <= TARGET else "no"),
            )
        if r.kind == "ref":
            rtxt = f"{100 * b / sync['trainstate']:.1f}% of trainstate sync" if b and sync.get("trainstate") else "—"
        rate = f"{100 * med(r.work_rate):.0f}%" if r.work_rate else "—"
        out.append(
            f"| {r.name} | {len(r.blocking)} | {fmt(b)} | {fmt(min(r.blocking))}–{fmt(max(r.blocking))} "
            f"| {fmt(med(r.background))} | {fmt(med(r.history_bg))} | {rate} | {rtxt} | {ok} |"
        )
    return out


def targets(rows: list[Row], sync: dict[str, float], sync_write: float | None) -> list[str]:
    lines = []
    for r in rows:
        ratio = ratio_of(r, sync)
        if r.lib != "trainstate" or ratio is None:
            continue
        head = "  <- the target case" if "steady state, later" in r.name else ""
        lines.append(
            f"- {'PASS' if ratio <= TARGET else 'MISS'}  {r.name}: blocks {med(r.blocking):.3f}s = "
            f"{100 * ratio:.1f}% of a synchronous save ({sync['trainstate']:.3f}s){head}"
        )
        if sync_write and "later" in r.name:
            lines.append(
                f"  - vs. the sync save's write+commit alone ({sync_write:.3f}s, i.e. without encoding "
                f"and retention): {100 * med(r.blocking) / sync_write:.1f}%"
            )
    for r in rows:
        ratio = ratio_of(r, sync)
        if r.lib == "dcp" and ratio is not None:
            lines.append(
                f"- (dcp)  {r.name}: {100 * ratio:.1f}% of dcp.save ({sync['dcp']:.3f}s)"
                f" -> {'within' if ratio <= TARGET else 'over'} 15%"
            )
    return lines


def busy_share(r: dict[str, Any]) -> float:
    return float(r["cpu_others"]) / max(1e-9, r["seconds"] * (r["machine"]["cores"] or 1))


def report(r: dict[str, Any], rows: list[Row]) -> str:
    m, n = r["machine"], r["state_bytes"]
    sync = {row.lib: med(row.blocking) for row in rows if row.kind == "sync"}
    sync_write = next((med(x.history_bg) for x in rows if x.lib == "trainstate" and x.kind == "sync"), None)
    kind = "quick" if r["quick"] else "full"
    lines = [
        f"# trainstate async-save benchmark ({kind} state, median of {r['repeats']})",
        "",
        f"- machine: {m['cpu']}, {m['cores']} cores, {m['ram_gib']} GiB RAM, Linux {m['kernel']}",
        f"- disk: {m['dir']} on {m['filesystem']}",
        (
            f"- versions: python {m['python']}, torch {m['torch']}, safetensors {m['safetensors']}, "
            f"trainstate {m['trainstate']}"
        ),
        f"- trainstate source: {r['source']}",
        f"- state: {r['tensors']} tensors, {n / GB:.3f} GB (GB = 1e9 B)",
        (
            f"- 1-min load average at start / end: {r['load'][0]:.2f} / {r['load'][1]:.2f} "
            "(other work on the machine skews every number)"
        ),
        (
            f"- CPU seconds during the run: this benchmark {r['cpu_self']:.0f}, kernel threads (writeback, "
            f"journal, ...) {r['cpu_kernel']:.0f}, other processes {r['cpu_others']:.0f}, stolen by the "
            f"hypervisor {r['cpu_steal']:.1f} "
            f"(of {r['seconds'] * (m['cores'] or 1):.0f} available)"
        ),
        *(
            [
                (
                    f"- WARNING: other processes used {100 * busy_share(r):.0f}% of the machine's CPU during this "
                    "run, so these numbers are skewed; rerun on an idle machine"
                )
            ]
            if busy_share(r) > 0.05
            else []
        ),
        (
            f"- steady state: {r['work']}s of fake training between saves ({r['work_kind']}; every state tensor "
            "updated in place first); its matmul rate with nothing in flight: "
            f"trainstate run {r['idle_rate']['trainstate']:.0f}/s, dcp run {r['idle_rate']['dcp']:.0f}/s"
        ),
        (
            "- trainstate: CheckpointManager(dir, every_steps=1, keep_last=2, fsync=True, threads=2); sync "
            "blocking includes deleting the oldest checkpoint (keep_last); async does that in the background"
        ),
        (
            f"- dcp: FileSystemWriter(sync_files=True, thread_count={DCP_THREADS}), {r['dcp_mode']}; "
            "checkpoints deleted between saves, untimed; get_state_dict() inside the timed region"
        ),
        *[f"- {note}" for note in r["dcp_notes"]],
        "",
    ]
    lines += [
        "### blocking time of a save (what the training loop waits for)",
        "",
        *table(rows, sync, n),
        "",
        (
            "- background s: from the call's return until durable (trainstate: mgr.wait() returns, which "
            "includes retention; dcp: future.result()); in steady state, first seen by polling between "
            "matmuls (history() / future.done()), '—' if still in flight when the next save began"
        ),
        (
            "- first save: includes allocating and first touching the staging memory, which costs anything "
            "from little (memory just freed by the previous manager) to about the 'freshly allocated' "
            "reference row (memory new to the process)"
        ),
        "- history write+commit s: SaveRecord.write_seconds + commit_seconds from mgr.history()",
        (
            "- work rate during bg: matmul rate while the background save was in flight, % of the rate with "
            "nothing in flight"
        ),
        "",
        "### targets (async blocking <= 15% of a synchronous save)",
        "",
        *targets(rows, sync, sync_write),
    ]
    return "\n".join(lines)


def cpu_snapshot() -> tuple[float, float, float, float]:
    """CPU seconds so far: (whole machine busy, this process, kernel threads, stolen by the hypervisor)."""
    t, me = psutil.cpu_times(), psutil.Process().cpu_times()
    kernel = 0.0
    for p in psutil.process_iter():
        try:
            if p.ppid() == 2 or p.pid == 2:  # children of kthreadd: kworkers, jbd2, ... (also do our I/O)
                c = p.cpu_times()
                kernel += c.user + c.system
        except psutil.Error:
            pass
    return (
        t.user + t.nice + t.system + t.irq + t.softirq,
        me.user + me.system + me.children_user + me.children_system,
        kernel,
        getattr(t, "steal", 0.0),
    )


def source_version() -> str:
    """The git revision of the trainstate being measured, and whether its sources had local changes."""
    src = Path(trainstate.__file__).resolve().parent
    try:
        rev = subprocess.run(
            ["git", "-C", str(src), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(src), "status", "--porcelain", "--", "."], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return f"{src} (not a git checkout)"
    return f"{src} at git {rev}" + (f", with uncommitted changes in {len(dirty.splitlines())} path(s)" if dirty else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", type=Path, help="parent for the checkpoints (default /tmp; not tmpfs)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="a ~1/17-size state, for a smoke run")
    ap.add_argument(
        "--work",
        type=float,
        default=None,
        help="seconds of fake training between steady-state saves (default 6, --quick 1)",
    )
    ap.add_argument("--work-kind", choices=["matmul", "sleep"], default="matmul")
    ap.add_argument(
        "--dcp-gloo",
        action="store_true",
        help="run dcp under a 1-rank gloo process group (file:// rendezvous) instead of no_dist=True",
    )
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    work_s = args.work if args.work is not None else (1.0 if args.quick else 6.0)

    root = Path(tempfile.mkdtemp(prefix="trainstate-async-", dir=args.dir or "/tmp"))
    r: dict[str, Any] = {
        "quick": args.quick,
        "repeats": args.repeats,
        "machine": core.machine(root),
        "load": os.getloadavg()[0],
        "work": work_s,
        "work_kind": args.work_kind,
        "source": source_version(),
    }
    if r["machine"]["filesystem"].startswith("tmpfs"):
        log(f"warning: {root} is on tmpfs, so nothing reaches a disk; pass --dir")
    t0, cpu0 = time.perf_counter(), cpu_snapshot()
    try:
        if args.dcp_gloo:
            dist.init_process_group("gloo", init_method=f"file://{root}/pg-rendezvous", rank=0, world_size=1)
            dkw: dict[str, Any] = {}
            r["dcp_mode"] = "under a 1-rank gloo process group (init_method file://, --dcp-gloo)"
            r["dcp_notes"] = []
        else:
            dkw = {"no_dist": True}
            r["dcp_mode"] = "no process group: no_dist=True"
            r["dcp_notes"] = probe_dcp(root / "probe")
        state = core.build_state(core.QUICK if args.quick else core.FULL)
        r["state_bytes"] = sum(t.nbytes for t in live_tensors(state))
        r["tensors"] = len(live_tensors(state))
        log(f"state: {r['tensors']} tensors, {r['state_bytes'] / GB:.2f} GB, built in {time.perf_counter() - t0:.1f}s")
        steps, work = itertools.count(1), Work(work_s, args.work_kind)
        ts_dir, dcp_dir = root / "trainstate", root / "dcp"
        refs = memcpy_rows(state, args.repeats)  # first, before any file is written or deleted
        rows: list[Row] = [ts_sync(state, ts_dir, args.repeats, steps)]
        rows += ts_async_idle(state, ts_dir, args.repeats, steps)
        *steady, ts_rate = ts_async_steady(state, ts_dir, args.repeats, steps, work)
        rows += steady
        shutil.rmtree(ts_dir, ignore_errors=True)
        rows.append(dcp_sync(state, dcp_dir, args.repeats, dkw))
        rows.append(dcp_async_default(state, dcp_dir, args.repeats, dkw))
        rows += dcp_async_reused(state, dcp_dir, args.repeats, dkw)
        *steady, dcp_rate = dcp_async_steady(state, dcp_dir, args.repeats, dkw, work)
        rows += [*steady, *refs]
        r["idle_rate"] = {"trainstate": ts_rate, "dcp": dcp_rate}
    finally:
        if args.dcp_gloo and dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(root, ignore_errors=True)
    r["seconds"], r["load"] = time.perf_counter() - t0, [r["load"], os.getloadavg()[0]]
    cpu1 = cpu_snapshot()
    r["cpu_self"], r["cpu_kernel"], r["cpu_steal"] = (cpu1[i] - cpu0[i] for i in (1, 2, 3))
    r["cpu_others"] = max(0.0, cpu1[0] - cpu0[0] - r["cpu_self"] - r["cpu_kernel"])
    print(report(r, rows) + f"\n\n(total {r['seconds']:.0f}s)")
    if args.json:
        args.json.write_text(json.dumps({**r, "rows": [x.as_dict() for x in rows]}, indent=2))


if __name__ == "__main__":
    main()
