"""What every writer of data files shares: the piece size of per-piece checksums, and the data files of one
save written ``workers`` at a time (write.py, and chunked.py for transformed chunks)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from trainstate._save.encode import Entry

PIECE_BYTES = 1 << 20  # per-piece checksums for chunks larger than this; 1 MiB: a piece stays in L2 cache
_R = TypeVar("_R")


def each_file(
    write: Callable[[str, list[Entry]], _R], names: list[str], groups: list[list[Entry]], workers: int
) -> list[_R]:
    """``write(name, group)`` for every data file, ``workers`` files at once (in this thread for one)."""
    workers = min(len(groups), workers)
    if workers <= 1:
        return [write(name, group) for name, group in zip(names, groups)]
    with ThreadPoolExecutor(workers, thread_name_prefix="trainstate-save") as pool:
        return list(pool.map(write, names, groups))
