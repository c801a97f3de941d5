"""Training memory: bytes each module saves for backward, checkpointing plans that fit a budget."""

from ._apply import CheckpointHandle, apply_checkpointing
from ._plan import CheckpointPlan, PlanError
from ._profile import MemoryProfile, MemoryRow, memory_profile

__all__ = [
    "CheckpointHandle",
    "CheckpointPlan",
    "MemoryProfile",
    "MemoryRow",
    "PlanError",
    "apply_checkpointing",
    "memory_profile",
]
