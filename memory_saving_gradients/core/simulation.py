"""Simulation: predict activation memory and recompute cost of a Plan.

No TensorFlow. The model is Chen et al.'s: checkpoints stay alive for the
whole of backprop; on top of them, at any time, either the tail (the
activations after the last checkpoints, which backprop starts from) or one
level's recomputed segment is alive. It is an estimate for comparing plans,
not an allocator: tests compare it with measured peaks only loosely.
"""

from __future__ import annotations

import dataclasses

from memory_saving_gradients.core.model import GraphModel
from memory_saving_gradients.core.planning import Plan


@dataclasses.dataclass(frozen=True)
class Estimate:
    """Predicted cost of a plan, in bytes and FLOPs.

    Attributes:
      peak_bytes: activation bytes alive at the worst point of backprop.
      kept_bytes: bytes of all checkpoints.
      largest_segment_bytes: bytes of the biggest recomputed level or tail.
      baseline_bytes: activation bytes tf.gradients keeps (all of them).
      recompute_flops: extra forward work, summed over copied ops.
      forward_flops: work of one forward pass over the region, for scale.
    """
    peak_bytes: int
    kept_bytes: int
    largest_segment_bytes: int
    baseline_bytes: int
    recompute_flops: int
    forward_flops: int

    @property
    def memory_ratio(self) -> float:
        """Predicted peak as a fraction of tf.gradients' activation memory."""
        return self.peak_bytes / max(self.baseline_bytes, 1)


def estimate(model: GraphModel, plan: Plan) -> Estimate:
    """Prices `plan` on `model`. O(size of the model)."""
    tensors = model.tensors
    checkpoints = set(plan.kept)
    copied = set()
    largest = 0
    recompute = 0
    for level in plan.levels:
        outs = [o for op in level.copy_ops for o in model.op_outputs[op]]
        largest = max(largest, model.bytes_of(o for o in outs if o not in checkpoints))
        recompute += sum(tensors[model.op_outputs[op][0]].cost for op in level.copy_ops)
        copied.update(level.copy_ops)
    tail = model.bytes_of(n for n in model.order
                              if n not in checkpoints and tensors[n].op not in copied)
    kept = model.bytes_of(checkpoints)
    forward = sum(tensors[outs[0]].cost for outs in model.op_outputs.values())
    return Estimate(
        peak_bytes=kept + max(largest, tail),
        kept_bytes=kept,
        largest_segment_bytes=max(largest, tail),
        baseline_bytes=model.bytes_of(model.order),
        recompute_flops=recompute,
        forward_flops=forward)
