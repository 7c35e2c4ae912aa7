"""Training-loop checkpointing: the manager, its policies, async staging and preemption handling."""

from .manager import CheckpointManager, SaveRecord
from .policies import CheckpointInfo

__all__ = ["CheckpointInfo", "CheckpointManager", "SaveRecord"]
