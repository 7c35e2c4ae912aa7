"""How many threads a save, a restore or a check uses by default: the cores this process may run on, shared
between the ranks of one host.

``os.sched_getaffinity`` gives the cores the process may use (a container's or a job scheduler's CPU set,
not the machine's count); where it does not exist, ``os.cpu_count``. Under a launcher that starts several
ranks on one host (``torchrun`` sets ``LOCAL_WORLD_SIZE``), each rank takes its share, so 8 ranks on 64 cores
use 8 threads each rather than 64. ``TRAINSTATE_THREADS`` sets the default outright; a ``threads=`` argument
overrides it for one call. The default is read once, when trainstate is imported (launchers set both
variables before the process starts).
"""

from __future__ import annotations

import os
import warnings

MAX_DEFAULT = 32  # past this, more lanes than a checkpoint's files and pieces keep busy


def usable_cores() -> int:
    """The cores this process may run on."""
    getaffinity = getattr(os, "sched_getaffinity", None)
    if getaffinity is not None:
        try:
            return max(1, len(getaffinity(0)))
        except OSError:
            pass
    return max(1, os.cpu_count() or 1)


def default_threads(environ: dict[str, str] | None = None, cores: int | None = None) -> int:
    """``TRAINSTATE_THREADS`` if set (a positive integer), else this process's share of its cores: the usable
    cores divided by ``LOCAL_WORLD_SIZE`` (ranks on this host), at least 1 and at most :data:`MAX_DEFAULT`.
    A value that is not a positive integer is ignored, as if unset (a default must never stop an import)."""
    env = os.environ if environ is None else environ
    text = env.get("TRAINSTATE_THREADS")
    given = _positive(text)
    if given is not None:
        return given  # as given: the cap is for the default worked out here
    if text is not None and text.strip():
        warnings.warn(
            f"TRAINSTATE_THREADS={text!r:.40} is not a positive integer: ignored, the default is this process's "
            "share of its cores",
            RuntimeWarning,
            stacklevel=2,
        )
    ranks = _positive(env.get("LOCAL_WORLD_SIZE")) or 1
    return max(1, min(MAX_DEFAULT, (usable_cores() if cores is None else cores) // ranks))


def _positive(text: str | None) -> int | None:
    try:
        value = int(text) if text is not None else 0
    except ValueError:
        return None
    return value if value > 0 else None


DEFAULT_THREADS = default_threads()


MEMORY_SHARE = 4  # threads that each hold a buffer take at most 1/MEMORY_SHARE of the memory available


def threads_within(each: int, threads: int = DEFAULT_THREADS, available: int | None = None) -> int:
    """``threads``, fewer where each holds ``each`` bytes and together they would take more than a quarter of
    the memory available now (``consolidate``: each file in flight holds one whole tensor); at least 1."""
    if available is None:
        available = available_memory()
    if each <= 0 or available <= 0:
        return max(1, threads)
    return max(1, min(threads, available // MEMORY_SHARE // each))


def available_memory() -> int:
    """Bytes of memory available now (0 where the system does not say)."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0
