"""The names in a run directory (docs/format.md §1 and §6a, as code): checkpoints ``step_00001200``
(zero-padded so names sort by step: only names this scheme produces are ever listed or deleted by a
manager), the shared pool ``_shared/``, the save records ``_history/``, the lock file, pin files, the
staging names of unfinished saves and deletes, and storage probes.
"""

from __future__ import annotations

import re
import uuid

_NAME = re.compile(r"^step_(\d{8,})$")
POOL_DIR = "_shared"  # an incremental run's pool files (docs/format.md §11): never a checkpoint or staging name
HISTORY_DIR = "_history"  # the run's save records: managers and sweeps skip it
LOCK_FILE = ".trainstate.lock"  # a local run directory's writer lock: never a leftover
PIN_FILE = "pinned.json"  # inside a checkpoint: retention keeps it
STAGING_TAGS = ("tmp", "old", "del")  # a save's staging; a replaced checkpoint; a delete's trash
# Where a checkpoint cannot be renamed aside to delete it (object stores), an empty object of this name in it
# says its delete has begun: written before the manifest goes, removed last (docs/format.md §1.1).
DELETE_MARKER = "deleting"
PROBE_PREFIX = ".trainstate-probe-"  # check_storage() writes and deletes one; a crash may leave it
_NAME_MAX = 255  # bytes in one path component on every filesystem we meet
_STAGED = re.compile(r"^\.trainstate-(tmp|old|del)-((?:[0-9a-f]{2})*)-[0-9a-z]+$")
_STAGED_BEFORE = re.compile(r"^\.(.+)\.(tmp|old|del)-[^/]*$")  # earlier versions (and names too long for hex)


def name_for(step: int) -> str:
    if step < 0:
        raise ValueError(f"step must be non-negative, got {step}")
    return f"step_{step:08d}"


def step_of(name: str) -> int | None:
    """The step a managed name stands for, or None for any other name."""
    m = _NAME.match(name)
    return int(m.group(1)) if m else None


def staging_name(name: str, tag: str) -> str:
    """The hidden sibling name under which ``name`` is staged (``tag`` "tmp"), moved aside while replaced
    ("old") or while deleted ("del"): ``.trainstate-<tag>-<name as hex>-<12 random hex digits>``.

    The target's name is spelled in hex so that a tool scanning a directory for names like its own
    checkpoints' (Lightning's SLURM auto-resume takes the digits after ``hpc_ckpt_`` in *any* name) never
    takes a leftover for a checkpoint, while the name can still be read back (:func:`staged_target`) to put
    a replaced or pinned checkpoint back. A name too long to spell so within one path component keeps the
    older form ``.<name>.<tag>-<random>``, which readers still understand.

    Example:
        >>> staging_name("hpc_ckpt_2.ckpt", "tmp")   # doctest: +SKIP
        '.trainstate-tmp-6870635f636b70745f322e636b7074-1a2b3c4d5e6f'
    """
    if tag not in STAGING_TAGS:
        raise ValueError(f"staging tag must be one of {STAGING_TAGS}, got {tag!r}")
    random = uuid.uuid4().hex[:12]
    spelled = f".trainstate-{tag}-{name.encode().hex()}-{random}"
    return spelled if len(spelled) <= _NAME_MAX else f".{name}.{tag}-{random}"


def staged_target(entry: str) -> tuple[str, str] | None:
    """``(name, tag)`` for a staging entry named by :func:`staging_name` (either form), else None.

    Example:
        >>> staged_target(staging_name("step_5", "old"))
        ('step_5', 'old')
    """
    m = _STAGED.match(entry)
    if m:
        try:
            return bytes.fromhex(m.group(2)).decode(), m.group(1)
        except UnicodeDecodeError:
            return None
    m = _STAGED_BEFORE.match(entry)
    return (m.group(1), m.group(2)) if m else None


def staging_prefix(name: str, tag: str) -> str:
    """What every entry :func:`staging_name` makes for ``name`` and ``tag`` starts with (its hex form).

    Example:
        >>> staging_name("out", "tmp").startswith(staging_prefix("out", "tmp"))
        True
    """
    return f".trainstate-{tag}-{name.encode().hex()}-"


def is_staging_name(name: str) -> bool:
    """Whether a directory entry is a leftover of an unfinished save or delete (safe to sweep)."""
    return staged_target(name) is not None
