"""Many ranks on torch.distributed or jax.distributed: collective save (save.py) on a coordination group of
its own (group.py; jax_group.py for JAX's processes), the global plan of who writes what (plan.py) and
per-rank values (per_rank.py).

Loading needs no coordination: each rank reads the parts it holds (``_restore``), asking :func:`rank_and_world`
which rank it is.
"""

from __future__ import annotations

from trainstate._distributed.group import Coordinator, coordinator


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


__all__ = ["Coordinator", "coordinator", "rank_and_world"]
