"""Every crash state of every recorded commit path, judged: ``python -m tools.crashstates``.

    python -m tools.crashstates --list                  # the workloads
    python -m tools.crashstates                         # every state of every workload (1-2 hours on 2 cores)
    python -m tools.crashstates --sample 100 --seed 3   # that many states of each workload, drawn at random
    python -m tools.crashstates --only "object store"   # the workloads whose name holds this
    python -m tools.crashstates --keep-failures out/    # each failing state written out, with why it failed

Prints one row per workload (recorded operations or requests, distinct crash states, checked, failures) as a
Markdown table for docs/reliability.md, then (unless ``--only`` or ``--no-others``) the same for DCP and
``torch.save``, then each failure with its crash point and how the state was made. Exits 1 on a failure.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .campaign import EVERY, run


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {value}")
    return value


def main() -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tools.crashstates",
        description="Record trainstate's commit paths and judge every state a crash may leave "
        "(docs/reliability.md, 'Crash states, enumerated').",
    )
    ap.add_argument("--list", action="store_true", help="list the workloads and exit")
    ap.add_argument("--sample", type=_positive, help="check this many states of each workload (default: all)")
    ap.add_argument("--seed", type=int, default=0, help="of --sample's draw (default 0)")
    ap.add_argument("--only", default="", help="run the workloads whose name holds this text")
    ap.add_argument("--no-others", action="store_true", help="skip DCP's and torch.save's table")
    ap.add_argument("--keep-failures", type=Path, metavar="DIR", help="write each failing state into DIR")
    args = ap.parse_args()
    chosen = [w for w in EVERY if args.only in w.name]
    if args.list:
        print("\n".join(w.name for w in EVERY))
        return 0
    if not chosen:
        ap.error(f"no workload's name holds {args.only!r} (--list shows them)")
    start = time.perf_counter()
    results = []
    for w in chosen:
        keep = args.keep_failures / w.name.replace("/", "_").replace(" ", "_") if args.keep_failures else None
        results.append(run(w, sample=args.sample, seed=args.seed, keep=keep))
        r = results[-1]
        print(f"  {r.workload}: {r.checked} states, {len(r.failures)} failures", file=sys.stderr, flush=True)
    print("| path | recorded operations | distinct crash states | checked | failures |")
    print("|---|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r.workload} | {r.operations} | {r.states} | {r.checked} | {len(r.failures)} |")
    if not args.no_others and not args.only:
        from . import others

        print("\nThe same crash states for the alternatives (tools/crashstates/others.py says what each must hold):\n")
        print(
            "| tool | recorded operations | distinct crash states | checked | lost a returned save | loaded torn or raised |"
        )
        print("|---|---:|---:|---:|---:|---:|")
        for name, work, judge in others.TOOLS:
            o = others.run(name, work, judge, sample=args.sample, seed=args.seed)
            lost = sum("older than" in f or "though step" in f for f in o.failures)
            print(f"| {name} | {o.operations} | {o.states} | {o.checked} | {lost} | {len(o.failures) - lost} |")
    total = sum(r.checked for r in results)
    failures = [f"{r.workload}: {f}" for r in results for f in r.failures]
    print(f"\n{total} crash states checked, {len(failures)} failures, {time.perf_counter() - start:.0f} s")
    for f in failures:
        print(f"  {f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
