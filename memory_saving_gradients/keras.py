"""Checkpointing for Keras `model.fit`: `Checkpointing` callback, `enable`, `disable`.

Imported on its own (`import memory_saving_gradients.keras`) so that the
package does not import Keras unless asked.
"""

from memory_saving_gradients.integrations.keras import Checkpointing
from memory_saving_gradients.integrations.keras import disable
from memory_saving_gradients.integrations.keras import enable

__all__ = ["Checkpointing", "disable", "enable"]
