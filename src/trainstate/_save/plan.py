"""tensor table -> file plan: which tensors go into which data file."""

from __future__ import annotations

from trainstate._save.encode import Entry

FILE_TEMPLATE = "{}-{:05d}.safetensors"


def plan_files(entries: list[Entry], n_files: int) -> list[list[Entry]]:
    """Spread entries over at most ``n_files`` files with balanced byte counts, keeping state order inside."""
    n_files = max(1, min(n_files, len(entries)))
    loads = [0] * n_files
    owner: dict[int, int] = {}
    for i in sorted(range(len(entries)), key=lambda i: -entries[i].nbytes):
        f = loads.index(min(loads))
        owner[i] = f
        loads[f] += entries[i].nbytes
    return [[e for i, e in enumerate(entries) if owner[i] == f] for f in range(n_files)]
