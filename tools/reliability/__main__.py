"""Run every reliability campaign at full size and write docs/reliability.md.

    python -m tools.reliability                 # ~5 minutes on 2 cores; writes docs/reliability.md
    python -m tools.reliability --quick --print # a smaller run, printed only
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import time
from pathlib import Path

import trainstate

from . import concurrency, corruption, crash, faults, fuzz
from .common import Row

DOC = Path(__file__).resolve().parents[2] / "docs" / "reliability.md"

INTRO = """# Reliability, measured

A checkpoint library exists for the bad day. Each figure below comes from running the campaign, not
from reading the code: processes SIGKILLed mid-save, every write / fsync / rename of a save failing in
turn, a real filesystem filling up, bytes flipped at random, hostile manifests and headers, and readers
racing a writer. Regenerate this page with `python -m tools.reliability` (the tests in
`tests/reliability/` run the same code at a smaller size on every CI run).
"""

EXPLAIN = """## What each campaign checks

- **SIGKILL**: a child process saves in a loop (sync, or async with a background writer) and is killed
  at a random moment; then a new manager opens the directory. Survived means: nothing incomplete is
  listed, every listed checkpoint (the newest included) restores to exactly the state saved at its
  step, and the leftovers of the interrupted save were swept. The next child resumes the numbering.
- **Injected faults**: a storage backend (`trainstate.storage.faulty.FaultyStorage`) fails the Nth
  create / write / fsync / rename of a save with ENOSPC or EIO, for every N the save reaches. Clean
  means: a `StorageError` with the errno, the earlier checkpoints restore exactly, no staging directory
  is left, and the new checkpoint is absent or complete. Async saves must raise on the next call.
- **Real disk full**: a 6 MB tmpfs is mounted and a manager saves ~1 MB checkpoints until it is full.
- **Corruption**: one byte of a data file or of `manifest.json` is flipped (a single bit, or xor with a
  random byte); detected means `load()` or `verify()` raised a `CheckpointError` and nothing else.
  Every byte is covered by a checksum: tensor bytes by their chunk checksum, data-file headers by the
  header checksum in the manifest (checked by `load()` as well), the manifest by its own checksum.
- **Hostile checkpoints**: manifests and data-file headers mutated structurally and byte by byte, the
  manifest re-sealed with a valid checksum so the parser has to cope. Clean means only trainstate
  errors came out, nothing outside the checkpoint was opened (audit hook), allocation stayed within
  the files' size (tracemalloc), and every example finished in time.
- **Concurrency**: a second manager on a directory another process is using is refused; a reader
  listing and restoring while a writer saves with retention only ever sees whole checkpoints (a
  checkpoint deleted between listing and opening gives a clean `CheckpointNotFoundError`).
"""


def collect(quick: bool) -> list[tuple[str, list[Row], float]]:
    sections = []
    for title, fn in [
        ("Crashes", lambda: crash.run(kills=20 if quick else 100)),
        ("Disk full and I/O errors", lambda: faults.run(quick=quick)),
        ("Corruption", lambda: corruption.run(trials=1000 if quick else 5000)),
        ("Hostile checkpoints", lambda: fuzz.run(examples=300 if quick else 2000)),
        ("Concurrency", lambda: concurrency.run(saves=100 if quick else 300, restarts=3 if quick else 10)),
    ]:
        start = time.perf_counter()
        rows = fn()
        sections.append((title, rows, time.perf_counter() - start))
        print(f"{title}: done in {time.perf_counter() - start:.0f}s", flush=True)
    return sections


def render(sections: list[tuple[str, list[Row], float]]) -> str:
    lines = [INTRO, "## Results", "",
             f"Run on {datetime.date.today()}, trainstate {trainstate.__version__}, Python "
             f"{platform.python_version()}, {platform.system()} {platform.release()}, {os.cpu_count()} cores.", "",
             "| area | campaign | result | rate |", "|---|---|---|---:|"]
    for title, rows, _ in sections:
        for row in rows:
            lines.append(f"| {title} | {row.campaign} | {row.passed} / {row.trials} {row.measure} | {row.rate} |")
    lines += ["", "### Notes", ""]
    for title, rows, seconds in sections:
        lines.append(f"- **{title}** ({seconds:.0f} s)")
        for row in rows:
            for note in row.notes[:8]:
                lines.append(f"  - {row.campaign}: {note}")
            if len(row.notes) > 8:
                lines.append(f"  - {row.campaign}: ... {len(row.notes) - 8} more")
    return "\n".join(lines) + "\n\n" + EXPLAIN


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller campaigns")
    ap.add_argument("--print", dest="print_only", action="store_true", help="print instead of writing the doc")
    args = ap.parse_args()
    text = render(collect(args.quick))
    if args.print_only:
        print(text)
    else:
        DOC.write_text(text)
        print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
