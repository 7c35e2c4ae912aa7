"""Many ranks on torch.distributed: collective save (save.py) on a coordination group of its own
(group.py), the global plan of who writes what (plan.py) and per-rank values (per_rank.py).

Loading needs no coordination: each rank reads the parts it holds (``_restore``), asking :func:`rank_and_world`
which rank it is.
"""

from __future__ import annotations

from trainstate._distributed.group import Coordinator, coordinator


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size under torch.distributed; (0, 1) outside it."""
    import sys

    if "torch.distributed" not in sys.modules:  # never imports torch for a NumPy-only user
        return 0, 1
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


__all__ = ["Coordinator", "coordinator", "rank_and_world"]
