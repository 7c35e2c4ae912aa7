"""Run every reliability campaign at full size and write docs/reliability.md.

python -m tools.reliability                 # ~15 minutes on 2 cores; writes docs/reliability.md
python -m tools.reliability --quick --print # a smaller run, printed only

The crash, corruption and hostile-checkpoint campaigns run once per flavor (common.FLAVORS): plain at the
sizes below, the other flavors (zstd, encrypted, incremental, all three) at FLAVOR_SIZES.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import trainstate

from . import concurrency, corruption, crash, faults, fuzz
from .common import FLAVORS, PLAIN, Row

DOC = Path(__file__).resolve().parents[2] / "docs" / "reliability.md"

INTRO = """# Reliability, measured

A checkpoint library exists for the bad day. Each figure below comes from running the campaign, not
from reading the code: processes SIGKILLed mid-save, every write / fsync / rename of a save failing in
turn, a real filesystem filling up, bytes flipped at random, hostile manifests and headers, and readers
racing a writer. Regenerate this page with `python -m tools.reliability` (the tests in
`tests/reliability/` run the same code at a smaller size on every CI run).

The crash, corruption and hostile-checkpoint campaigns run for every way trainstate stores bytes at
rest: **plain**, **zstd** (`compression="zstd"`), **encrypted** (`key=`, AES-256-GCM chunks and an
authenticated manifest), **incremental** (`CheckpointManager(incremental=True)`: data in the run's
shared pool) and all three at once. A row without a bracket is plain; `[zstd]` and so on name the
flavor. {sizes}
"""

EXPLAIN = """## What each campaign checks

- **SIGKILL**: a child process saves in a loop (sync, or async with a background writer) and is killed
  at a random moment; then a new manager opens the directory. Survived means: nothing incomplete is
  listed, every listed checkpoint (the newest included) restores to exactly the state saved at its
  step, and the leftovers of the interrupted save were swept. The next child resumes the numbering.
- **Injected faults**: a storage backend (`trainstate._storage.faulty.FaultyStorage`) fails the Nth
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
- **Flavors**: the same campaigns and the same checks, with the flavor's arguments on every save,
  manager and read. SIGKILL: the killed child saves with them and the state of an incremental run has
  a frozen tensor its checkpoints share; after each start no pool file may be left that no checkpoint
  names. Corruption: an encrypted checkpoint is also read with every checksum off (`load(verify=False)`),
  so a flip in a chunk's stored bytes must be caught by its AES-GCM tag alone; a flip that leaves an
  encrypted manifest well-formed must be reported by its MAC (`TamperedCheckpointError`), any other error
  class counts as a failure. An incremental run's pool files are flipped, each byte read through a
  checkpoint that uses it. Hostile checkpoints: an encrypted manifest is re-sealed with the key's MAC (an
  insider who holds the key: still only trainstate errors) or, a quarter of the structural and half the
  byte mutations, not re-sealed: then it must be refused, by the MAC whenever nothing before it objects.
  Flavors with chunk transforms also get mutated transforms (dropped, reordered, doubled, another chunk's
  nonce), incremental ones mutated `pool` flags; the reader may open the run's pool, nothing else.
- **Concurrency**: a second manager on a directory another process is using is refused; a reader
  listing and restoring while a writer saves with retention only ever sees whole checkpoints (a
  checkpoint deleted between listing and opening gives a clean `CheckpointNotFoundError`).
"""


DEFECTS = """## Defects found by using trainstate as its users do, and where each was fixed

Each row was a way to lose work, resume wrongly or get the wrong error; each has a regression test that
failed before its fix (the test named in the last column).

| # | defect | fixed at the root by | regression test |
|---|---|---|---|
| 1 | "newest" came from the wall clock: a host with a clock behind had its new saves deleted by keep_last | commit sequence numbers (highest + 1) order checkpoints; `every_seconds` uses a monotonic clock; a non-finite `created` is refused | `tests/manager/test_never_lose_work.py::test_a_host_whose_clock_is_behind_keeps_its_new_saves`, `::test_a_non_finite_created_time_is_refused` |
| 2 | a checkpoint from a newer trainstate was skipped as damage and later saved over | `FormatVersionError` is no longer a `CorruptCheckpointError`; the manager refuses to start beside one | `::test_a_checkpoint_from_a_newer_trainstate_stops_the_manager` |
| 3 | every checkpoint damaged: `restore_latest` returned None over a half-restored state; re-sealed hostile manifests raised raw TypeError / KeyError | one tree validator at manifest parse time (grammar and depth); `restore_latest` falls back past any `CheckpointError` and raises a list of each failure | `::test_restore_latest_falls_back_past_a_resealed_hostile_manifest`, `::test_when_every_checkpoint_is_damaged_restore_latest_says_so`, `::test_a_checkpoint_failing_mid_read_is_followed_by_a_complete_restore` |
| 4 | `restore_latest` skipped the data-file header checks `load` made | one load function (`restore.load_from`) for `load`, `open().load()` and the manager | `::test_load_and_restore_latest_check_data_file_headers_alike` |
| 5 | after ENOSPC, `save(step)` returned False and `close(step, state)` wrote nothing; a stale async error stopped the preemption save | a step counts as saved only once committed (a failed async save gives it back); preemption and final saves are written before an older error is raised | `::test_after_a_full_disk_the_same_step_saves_again`, `::test_close_writes_the_final_step_after_a_failed_save_of_it`, `::test_a_stale_async_error_does_not_stop_the_preemption_save`, `::test_a_failed_async_save_of_a_step_can_be_saved_again` |
| 6 | a pin reported as taken could be deleted by retention (25 of 1,667); an object-store reader beside retention crashed with StorageError(ENOENT) | retention hides a checkpoint (one rename, or un-committing its manifest) and then looks for a pin; a pin is reported only once the checkpoint is still committed; the reader turns a file gone mid-read into `CheckpointNotFoundError`, which `restore_latest` falls back past | `::test_a_pin_taken_after_the_retention_plan_wins`, `::test_pins_beside_a_pruning_job_are_never_lost`, campaign "pins taken beside a job pruning" below |
| 9 | a restart right after SIGKILL was refused while forked DataLoader workers held the lock (also after `close()`) | forked children close their copy of the lock descriptor at once (`os.register_at_fork`) | `tests/manager/test_lifecycle.py::test_a_restart_right_after_sigkill_is_not_refused_by_orphaned_workers`, `::test_close_with_persistent_workers_alive_frees_the_directory`, campaign "restart at once after SIGKILL" below |
| 10 | a dropped manager, a failing constructor or a full disk at the lock file left the lock held and the signal handlers installed (Ctrl-C swallowed); a raw OSError | arguments checked before anything is acquired; everything acquired is released on failure and by a finalizer; lock-file errors are `StorageError` | `::test_a_dropped_manager_gives_back_its_lock_and_signal_handlers`, `::test_a_constructor_that_fails_leaves_no_lock_and_no_handlers`, `::test_a_full_disk_while_writing_the_lock_is_a_storage_error` |
| 11 | a second Ctrl-C was swallowed while waiting for an async save | waiting catches only `Exception`; closed watchers forward signals to the previous handler | `::test_a_second_ctrl_c_interrupts_while_an_async_save_is_in_flight` |
| 12 | `np.float32` metrics, `np.int64` steps and `loss.detach()` were refused or stored wrongly; errors did not name the key | `manager/arguments.py` converts NumPy scalars and one-element tensors once and names the key in every error | `tests/manager/test_never_lose_work.py::test_numpy_and_torch_scalars_are_accepted_for_step_epoch_and_metrics`, `::test_bad_save_arguments_name_their_key` |
| 13 | a saved plain value replaced a live object (`"ema": None` over an `AveragedModel`) | the planner reports it as a mismatch | `tests/test_restore_rules.py::test_a_saved_plain_value_never_replaces_a_live_object` |
| 14 | `load(path, include=...)` without a target ignored the patterns | no-target loads go through the same planner | `::test_load_without_target_honours_include_and_exclude` |
| 15 | a 101-deep state saved, committed and never opened | one depth rule, counted the same by the writer and the validator | `::test_what_saves_also_opens_at_the_depth_limit`, `::test_a_stateful_chain_counts_levels_like_containers` |
| 16 | a user key `_rng` was overwritten by the manager's RNG capture | refused with what to do | `tests/manager/test_never_lose_work.py::test_a_user_key_named_rng_is_never_overwritten` |
| 21 | argument mistakes were plain ValueErrors; assorted wrong texts | `InvalidArgumentError` (a `CheckpointError`, `ValueError` and `TypeError`); see the list in the tests | `::test_bad_manager_arguments_are_checkpoint_errors_and_take_nothing`, `::test_a_bad_step_is_a_checkpoint_error`, `::test_configuration_is_fixed_after_construction`, `tests/test_optional_dependencies.py`, `tests/test_paths.py`, `tests/test_errors.py`, `tests/cli/test_cli.py::test_help_works_without_docstrings`, `::test_ls_shows_pin_reasons_and_a_second_pin_says_it_changed_nothing` |
| 22 | a plain checkpoint whose (re-sealed) manifest called a chunk `aes-256-gcm` raised `KeyRequiredError` ("pass key="): `restore_latest` stopped on it as on a user error instead of falling back (fuzz [zstd]) | only an authenticated manifest can say a chunk is encrypted: such a chunk in a plain manifest is `CorruptCheckpointError` (`_restore/transformed.py`; docs/format.md §12.2) | `tests/reliability/test_flavor_findings.py::test_a_plain_manifest_claiming_an_encrypted_chunk_is_damage_not_a_missing_key` |
| 23 | one flipped byte in the salt or key check of an encrypted manifest read as another key's (`WrongKeyError`): the manager refused to start the run, telling the user their key was wrong (corruption [encrypted]: 6 of 979 manifest flips) | the chunk key needs no salt: when a chunk of the checkpoint decrypts with the key, the key is right and the manifest damaged (`TamperedCheckpointError`, skipped like damage; `_restore/key_or_damage.py`, docs/format.md §12.3) | `::test_a_damaged_salt_or_key_check_is_damage_when_the_key_decrypts_the_checkpoint`, `::test_a_checkpoint_of_another_key_still_stops_the_manager` |
"""


FLAVOR_SIZES = {"kills": 15, "trials": 2000, "examples": 300}  # per flavor other than plain (--quick: a quarter)


def _sizes(quick: bool) -> dict[str, int]:
    return {k: max(2, v // 4) if quick else v for k, v in FLAVOR_SIZES.items()}


def _flavored(run: Callable[..., list[Row]], size: str, quick: bool, **plain: int) -> Callable[[], list[Row]]:
    """The campaign for plain at its own size, then for every other flavor at FLAVOR_SIZES."""

    def go() -> list[Row]:
        rows = run(**plain)
        for flavor in FLAVORS.values():
            if flavor is not PLAIN:
                rows += run(**{size: _sizes(quick)[size]}, flavor=flavor)
        return rows

    return go


def collect(quick: bool) -> list[tuple[str, list[Row], float]]:
    sections = []
    for title, fn in [
        ("Crashes", _flavored(crash.run, "kills", quick, kills=20 if quick else 100)),
        ("Disk full and I/O errors", lambda: faults.run(quick=quick)),
        ("Corruption", _flavored(corruption.run, "trials", quick, trials=1000 if quick else 5000)),
        ("Hostile checkpoints", _flavored(fuzz.run, "examples", quick, examples=300 if quick else 2000)),
        ("Concurrency", lambda: concurrency.run(saves=100 if quick else 300, restarts=3 if quick else 10)),
    ]:
        start = time.perf_counter()
        rows = fn()
        sections.append((title, rows, time.perf_counter() - start))
        print(f"{title}: done in {time.perf_counter() - start:.0f}s", flush=True)
    return sections


CRASH_HEADING = "## Crash states, enumerated (tools/crashstates)"


def crash_states_section() -> str:
    """The crash-state section as docs/reliability.md holds it (``python -m tools.crashstates`` measures it, and
    it is written by hand from that run): kept as it is when the campaigns' part is written again."""
    text = DOC.read_text() if DOC.exists() else ""
    start = text.find(CRASH_HEADING)
    if start < 0:
        return CRASH_HEADING + "\n\nRun `python -m tools.crashstates` and write its tables here.\n"
    end = text.find("\n## ", start + len(CRASH_HEADING))
    return text[start : end + 1 if end >= 0 else len(text)]


def render(sections: list[tuple[str, list[Row], float]], quick: bool = False) -> str:
    sizes = _sizes(quick)
    lines = [
        INTRO.format(
            sizes=f"Plain runs at the sizes of the rows; every other flavor at {sizes['kills']} SIGKILLs per save "
            f"mode, {sizes['trials']} byte flips and {sizes['examples']} hostile checkpoints per campaign, so that "
            "the whole page is regenerated in about a quarter of an hour on 2 cores."
        ),
        "## Results",
        "",
        f"Run on {datetime.date.today()}, trainstate {trainstate.__version__}, Python "
        f"{platform.python_version()}, {platform.system()} {platform.release()}, {os.cpu_count()} cores.",
        "",
        "| area | campaign | result | rate |",
        "|---|---|---|---:|",
    ]
    for title, rows, _ in sections:
        for row in rows:
            lines.append(f"| {title} | {row.campaign} | {row.passed} / {row.trials} {row.measure} | {row.rate} |")
    lines += ["", *by_flavor(sections), "", "### Notes", ""]
    for title, rows, seconds in sections:
        lines.append(f"- **{title}** ({seconds:.0f} s)")
        for row in rows:
            for note in row.notes[:8]:
                lines.append(f"  - {row.campaign}: {note}")
            if len(row.notes) > 8:
                lines.append(f"  - {row.campaign}: ... {len(row.notes) - 8} more")
    return "\n".join(lines) + "\n\n" + DEFECTS + "\n" + crash_states_section() + "\n" + EXPLAIN


def by_flavor(sections: list[tuple[str, list[Row], float]]) -> list[str]:
    """The flavored campaigns again, one line per flavor: passed / trials per campaign."""
    columns: dict[str, dict[str, Row]] = {}
    for _, rows, _ in sections:
        for row in rows:
            for flavor in FLAVORS.values():
                if flavor is PLAIN or not row.campaign.endswith(flavor.label):
                    continue
                column = row.campaign[: -len(flavor.label)].replace(" in pool files", " in data files")
                columns.setdefault(column, {})[flavor.name] = row
    columns = {c: by for c, by in columns.items() if by}
    if not columns:
        return []
    plain = {c: r for _, rows, _ in sections for r in rows if (c := r.campaign) in columns}
    short = {c: _SHORT.get(c, c) for c in columns}
    lines = [
        "### By flavor",
        "",
        "| flavor | " + " | ".join(short.values()) + " |",
        "|---|" + "---:|" * len(columns),
    ]
    for flavor in FLAVORS.values():
        cells = []
        for c in columns:
            row = plain.get(c) if flavor is PLAIN else columns[c].get(flavor.name)
            cells.append(f"{row.passed} / {row.trials}" if row is not None else "")
        lines.append(f"| {flavor.name} | " + " | ".join(cells) + " |")
    return lines


_SHORT = {
    "SIGKILL at a random moment, sync save loop": "SIGKILL, sync",
    "SIGKILL at a random moment, async save loop": "SIGKILL, async",
    "corruption: one flipped byte in data files": "flips: data (pool) files",
    "corruption: one flipped byte in manifest.json": "flips: manifest",
    "corruption: flipped stored tensor bytes, checksums off (AES-GCM tag)": "flips: GCM tag alone",
    "hostile manifests (structure)": "hostile manifests",
    "hostile bytes (manifest)": "hostile manifest bytes",
    "hostile data-file headers": "hostile headers",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller campaigns")
    ap.add_argument("--print", dest="print_only", action="store_true", help="print instead of writing the doc")
    args = ap.parse_args()
    text = render(collect(args.quick), args.quick)
    if args.print_only:
        print(text)
    else:
        DOC.write_text(text)
        print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
