"""Every crash state of every recorded commit path, judged: ``python -m tools.crashstates``.

    python -m tools.crashstates               # every state of every workload (about an hour on 2 cores)
    python -m tools.crashstates --sample 100  # that many states of each workload, drawn at random
    python -m tools.crashstates --only "object store"   # the workloads whose name holds this

Prints one row per workload (recorded operations, crash states generated, checked, failures) as a Markdown table
for docs/reliability.md, then each failure with its crash point and how the state was made. Exits 1 on a failure.
"""

from __future__ import annotations

import argparse
import sys
import time

from .campaign import EVERY, run


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.crashstates")
    ap.add_argument("--sample", type=int, help="check this many states of each workload (default: all)")
    ap.add_argument("--only", default="", help="run the workloads whose name holds this text")
    ap.add_argument("--no-others", action="store_true", help="skip DCP's and torch.save's table")
    args = ap.parse_args()
    start = time.perf_counter()
    results = []
    for w in EVERY:
        if args.only in w.name:
            results.append(run(w, sample=args.sample))
            r = results[-1]
            print(f"  {r.workload}: {r.checked} states, {len(r.failures)} failures", file=sys.stderr, flush=True)
    print("| path | recorded operations | crash states | checked | failures |")
    print("|---|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r.workload} | {r.operations} | {r.states} | {r.checked} | {len(r.failures)} |")
    if not args.no_others:
        from . import others

        print("\nThe same crash states for the alternatives (tools/crashstates/others.py says what each must hold):\n")
        print("| tool | recorded operations | crash states | checked | lost a returned save | loaded torn or raised |")
        print("|---|---:|---:|---:|---:|---:|")
        for name, work, judge in others.TOOLS:
            r = others.run(name, work, judge)
            lost = sum("older than" in f or "though step" in f for f in r.failures)
            print(f"| {name} | {r.operations} | {r.states} | {r.checked} | {lost} | {len(r.failures) - lost} |")
    total = sum(r.checked for r in results)
    failures = [f"{r.workload}: {f}" for r in results for f in r.failures]
    print(f"\n{total} crash states checked, {len(failures)} failures, {time.perf_counter() - start:.0f} s")
    for f in failures:
        print(f"  {f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
