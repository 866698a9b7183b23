"""Keras integration: the `@recompute_grad` layer decorator.

(The `Checkpointing` callback joins this module when it lands.)
"""

from memory_saving_gradients.integrations.layer_decorator import recompute_enabled
from memory_saving_gradients.integrations.layer_decorator import recompute_grad

__all__ = ["recompute_enabled", "recompute_grad"]
