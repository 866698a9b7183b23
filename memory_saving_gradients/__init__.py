"""Gradient checkpointing for TensorFlow 2.x graphs: a drop-in for tf.gradients.

Only checkpoint tensors are kept from the forward pass; everything between
them is recomputed, segment by segment, when backprop reaches it.
"""

from memory_saving_gradients.api import CheckpointPlan
from memory_saving_gradients.api import checkpoint_plan
from memory_saving_gradients.api import gradients
from memory_saving_gradients.api import gradients_collection
from memory_saving_gradients.api import gradients_memory
from memory_saving_gradients.api import gradients_speed
from memory_saving_gradients.core.budgets import Budget
from memory_saving_gradients.core.budgets import MemoryWithin
from memory_saving_gradients.core.budgets import budget
from memory_saving_gradients.core.budgets import memory_within
from memory_saving_gradients.measure import enable_cpu_allocator_stats
from memory_saving_gradients.measure import function_peak_bytes
from memory_saving_gradients.measure import session_peak_bytes
from memory_saving_gradients.integrations.patching import checkpointing
from memory_saving_gradients.integrations.patching import patch_tf_gradients
from memory_saving_gradients.integrations.patching import unpatch_tf_gradients

__all__ = [
    "Budget", "CheckpointPlan", "budget", "checkpoint_plan", "checkpointing", "enable_cpu_allocator_stats",
    "function_peak_bytes",
    "gradients", "gradients_collection", "gradients_memory", "gradients_speed", "MemoryWithin",
    "memory_within",
    "patch_tf_gradients", "session_peak_bytes", "unpatch_tf_gradients",
]
__version__ = "0.1.0"
