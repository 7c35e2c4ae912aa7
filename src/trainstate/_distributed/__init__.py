"""Many ranks on torch.distributed or jax.distributed: collective save (save.py) on a coordination group of
its own (group.py; jax_group.py for JAX's processes), the global plan of who writes what (plan.py) and
per-rank values (per_rank.py).

Loading is planned in ``_restore``: each rank reads the parts it holds, asking :func:`rank_and_world` which rank
it is; a collective load (``_restore/shared.py``) uses a coordinator here so that the parts several ranks hold
are read by one of them and sent to the others.
"""

from __future__ import annotations

from typing import Any

from trainstate._distributed import jax_group
from trainstate._distributed.group import Coordinator, GlooCoordinator, timeout_seconds, torch_world


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size under torch.distributed, else its index and the process count
    under ``jax.distributed``; (0, 1) outside both."""
    import sys

    if "torch.distributed" in sys.modules:  # never imports torch for a NumPy-only user
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    from trainstate._distributed.jax_group import process_and_count

    return process_and_count()


def coordinator(group: Any = None, timeout: float | None = None, channel: str = "save") -> Coordinator | None:
    """The coordinator for ``group`` (default: the default torch.distributed process group, else the processes
    of a ``jax.distributed`` job), or None outside both.

    A group of one process is treated as no group: its checkpoints are plain ones. Each
    ``channel`` is a gloo group of its own, so exchanges on one (a manager's background saves) never
    interleave with those on another (its foreground decisions), whatever thread runs them.
    """
    if group is None:
        group = torch_world()
        if group is None:  # no torch process group: the processes of a jax.distributed job, if any
            return jax_group.coordinator(timeout_seconds(timeout), channel)
    import torch.distributed as dist

    if dist.get_world_size(group) <= 1:
        return None
    return GlooCoordinator(group, timeout_seconds(timeout), channel)


__all__ = ["Coordinator", "coordinator", "rank_and_world"]
