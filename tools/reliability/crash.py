"""SIGKILL at random moments: a child process saves in a loop (sync or async) and is killed, again and again.

After each kill a new manager opens the directory (sweeping leftovers), and: nothing incomplete is listed,
the newest listed checkpoint restores and holds exactly the state saved at its step, every other listed
checkpoint restores too, and no staging leftovers remain. The next child continues from the newest step.

Each campaign runs for a flavor (common.FLAVORS: plain, zstd, encrypted, incremental, all three): the child
and the checking manager get the flavor's arguments. An incremental run's state has a frozen tensor its
checkpoints share through the pool; there every pool file must also be named by a listed checkpoint once
the new manager has started (its collection removes what a killed save left).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import tempfile
import time
from pathlib import Path

import trainstate
from trainstate._format.run_dir import is_staging_name

from .common import FLAVORS, PLAIN, Flavor, Row, check_numpy_state, print_rows, spawn

CHILD = r"""
import sys
import trainstate
from tools.reliability.common import FLAVORS, numpy_state

root, mode, flavor = sys.argv[1], sys.argv[2], FLAVORS[sys.argv[3]]
mgr = trainstate.CheckpointManager(
    root, every_steps=1, keep_last=3, async_save=(mode == "async"), **flavor.manager_kwargs()
)
latest = mgr.latest()
step = latest.step + 1 if latest else 0
print("ready", flush=True)
while True:
    mgr.save(step, numpy_state(step, size=1 << 20, frozen=flavor.incremental))
    step += 1
"""


def _unnamed_pool_files(root: Path, flavor: Flavor) -> list[str]:
    """Pool files no manifest of the run names: what a killed save may leave, and a start must collect."""
    pool = root / "_shared"
    if not flavor.incremental or not pool.is_dir():
        return []
    named = set()
    for manifest in root.glob("*/manifest.json"):
        with trainstate.open(manifest.parent, **flavor.open_kwargs()) as ck:
            named.update(f.path for f in ck.manifest.files if f.pool)
    return sorted(p.name for p in pool.iterdir() if p.name not in named)


def kill_once(root: Path, mode: str, rnd: random.Random, flavor: Flavor = PLAIN) -> tuple[list[str], int]:
    """One child, one SIGKILL; returns (problems found, leftovers swept on the next start)."""
    proc, first = spawn(CHILD, str(root), mode, flavor.name)
    ready = first
    time.sleep(rnd.uniform(0.0, 0.4))
    proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate()
    problems = []
    if ready.strip() != "ready":
        problems.append(f"child did not start: {err[-500:]}")
    elif proc.returncode != -signal.SIGKILL:
        problems.append(f"child died on its own (exit {proc.returncode}): {err[-500:]}")
    with trainstate.CheckpointManager(root, **flavor.manager_kwargs()) as mgr:
        swept = len(mgr.swept)
        infos = mgr.list()
        leftovers = [p.name for p in root.iterdir() if is_staging_name(p.name)]
        if leftovers:
            problems.append(f"leftovers after start: {leftovers}")
        try:
            unnamed = _unnamed_pool_files(root, flavor)
        except Exception as e:  # noqa: BLE001 - any failure is a finding
            problems.append(f"a listed checkpoint does not open: {e!r}")
        else:
            if unnamed:
                problems.append(f"pool files no checkpoint names, after start: {unnamed}")
        for info in infos:
            try:
                check_numpy_state(trainstate.load(root / info.name, **flavor.open_kwargs()), info.step)
            except Exception as e:  # noqa: BLE001 - any failure is a finding
                problems.append(f"{info.name} is listed but does not restore exactly: {e!r}")
        if not infos and root.exists() and any(n.startswith("step_") for n in os.listdir(root)):
            problems.append("checkpoints exist but none is listed")
    return problems, swept


def campaign(mode: str, kills: int, seed: int = 0, flavor: Flavor = PLAIN) -> Row:
    rnd = random.Random(seed)
    root = Path(tempfile.mkdtemp(prefix=f"trainstate-crash-{mode}-"))
    row = Row(f"SIGKILL at a random moment, {mode} save loop{flavor.label}", 0, 0, "survived")
    interrupted = 0
    try:
        for i in range(kills):
            problems, swept = kill_once(root / "run", mode, rnd, flavor)
            row.trials += 1
            interrupted += swept > 0
            if problems:
                row.notes.append(f"kill {i}: {'; '.join(problems)}")
            else:
                row.passed += 1
        with trainstate.CheckpointManager(root / "run", **flavor.manager_kwargs()) as mgr:
            last = mgr.latest()
        row.notes.insert(
            0,
            f"{interrupted} of {kills} kills landed mid-save (a staging directory was swept "
            f"on the next start); the run reached step {last.step if last else None}",
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return row


def run(kills: int = 100, seed: int = 0, flavor: Flavor = PLAIN) -> list[Row]:
    return [campaign("sync", kills, seed, flavor), campaign("async", kills, seed + 1, flavor)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=100, help="per mode (sync and async)")
    ap.add_argument("--flavor", choices=sorted(FLAVORS), default="plain")
    args = ap.parse_args()
    print_rows(run(args.kills, flavor=FLAVORS[args.flavor]))


if __name__ == "__main__":
    main()
