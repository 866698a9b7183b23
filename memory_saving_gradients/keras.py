"""Checkpointing for Keras: the `Checkpointing` callback, `enable`, `disable`, and
the `@recompute_grad` layer decorator.

Imported on its own (`import memory_saving_gradients.keras`) so that the
package does not import Keras unless asked.
"""

from memory_saving_gradients.integrations.keras import Checkpointing
from memory_saving_gradients.integrations.keras import disable
from memory_saving_gradients.integrations.keras import enable
from memory_saving_gradients.integrations.layer_decorator import recompute_enabled
from memory_saving_gradients.integrations.layer_decorator import recompute_grad

__all__ = ["Checkpointing", "disable", "enable", "recompute_enabled", "recompute_grad"]
