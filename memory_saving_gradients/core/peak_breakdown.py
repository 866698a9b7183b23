"""Where a step's predicted activation peak falls, and what holds it there.

No TensorFlow. A plan that saves little leaves a user asking why: the answer
is the step of the peak (the op running) and the buffers alive then, by
kind. Where the peak is a large layer's recomputed tensors and their
gradients, other checkpoints change little there; a smaller batch per step
does (gradient accumulation).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Optional

from memory_saving_gradients.core import timeline
from memory_saving_gradients.core.model import GraphModel
from memory_saving_gradients.core.planning import Plan

# Buffer kinds, in the order they are reported.
KINDS = ("kept from the forward pass", "recomputed", "gradient", "loop state",
         "loop scratch", "kernel scratch")
_RUNNING = {"forward": "running {}", "recompute": "recomputing {}",
            "gradient": "differentiating {}"}


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One buffer alive at the peak: its kind (one of `KINDS`), what it holds, its bytes."""
    kind: str
    name: str
    bytes: int


@dataclasses.dataclass(frozen=True)
class PeakBreakdown:
    """The activation peak of a plan (or of tf.gradients) and what holds it.

    Attributes:
      bytes: the activation peak (`timeline.activation_peak`: weight
        gradients left out).
      running: what ran in the peak's step, e.g. 'differentiating conv2d/Conv2D
        (level 0)'.
      buffers: the buffers alive then, largest first; they sum to `bytes`.
      near: (bytes, running) of the highest step of each other phase (the
        forward pass, the tail, each level) within `NEAR` of the peak,
        highest first: lowering the peak alone would leave these about as high.
    """
    bytes: int
    running: str
    buffers: tuple
    near: tuple = ()

    def bytes_by_kind(self) -> dict:
        """Kind -> bytes alive at the peak, for the kinds present, in `KINDS` order."""
        totals = collections.Counter()
        for buffer in self.buffers:
            totals[buffer.kind] += buffer.bytes
        return {kind: totals[kind] for kind in KINDS if totals[kind]}

    def describe(self, largest: int = 3) -> str:
        """One line: the peak, when, its bytes by kind, its `largest` buffers
        and the other phases near it."""
        if not self.buffers:
            return f"{_size(self.bytes)}: nothing is alive"
        kinds = ", ".join(f"{kind} {_size(size)}" for kind, size in self.bytes_by_kind().items())
        top = ", ".join(f"{b.kind} {b.name} ({_size(b.bytes)})" for b in self.buffers[:largest])
        line = f"{_size(self.bytes)} while {self.running}: {kinds}; largest: {top}"
        if self.near:
            line += "; about as high: " + ", ".join(
                f"{_size(size)} while {running}" for size, running in self.near)
        return line


# A phase whose highest step is within this fraction of the peak is reported beside it.
NEAR = 0.1


def peak_breakdown(model: GraphModel, plan: Optional[Plan] = None) -> PeakBreakdown:
    """The activation peak of `plan` on `model` (None: tf.gradients) and what
    holds it. One replay of the step: linear in the size of the model.

    Example: on a chain whose first layer is the largest, the peak of a
    'memory' plan is where that layer is differentiated, held by its
    recomputed tensors and the gradients in flight there.
    """
    steps = timeline.ActivationTimeline(model, plan)
    live = steps.live
    peak = int(live.argmax())
    buffers, scratch = steps.contents(peak)
    described = [_describe(key, size) for key, size in buffers]
    described += [Buffer(f"{kind} scratch", "in that step", size)
                  for kind, size in scratch.items()]
    described.sort(key=lambda b: -b.bytes)
    highest = {}  # phase -> its highest step
    for step, (_, _, phase) in steps.running.items():
        if phase not in highest or live[step] > live[highest[phase]]:
            highest[phase] = step
    peak_phase = steps.running[peak][2] if peak in steps.running else None
    near = sorted(((int(live[step]), _running(steps.running[step]))
                   for phase, step in highest.items()
                   if phase != peak_phase and live[step] >= (1 - NEAR) * live[peak] > 0),
                  reverse=True)
    return PeakBreakdown(int(live[peak]), _running(steps.running.get(peak)),
                         tuple(described), tuple(near))


def _running(running) -> str:
    """'differentiating <op> (level n)' and the like, for an `ActivationTimeline.running` entry."""
    if running is None:
        return "the step starts"
    what, op, phase = running
    where = f"level {phase}" if isinstance(phase, int) else phase
    return f"{_RUNNING[what].format(op)} ({where})"


def _describe(key: tuple, size: int) -> Buffer:
    """The `Buffer` a replay's buffer key names (`timeline.ActivationTimeline.contents`)."""
    kind = key[0]
    if kind == "fwd":
        return Buffer("kept from the forward pass", key[1], size)
    if kind == "copy":
        return Buffer("recomputed", f"{key[2]} (level {key[1]})", size)
    if kind in ("grad", "sum"):
        return Buffer("gradient", f"of {key[-1]}", size)
    if kind in ("weights", "dense"):
        return Buffer("gradient", f"part of a weight's, from {key[1]}", size)
    if kind == "early":
        return Buffer("gradient", f"part of {key[1]}'s, made in the forward pass", size)
    loop = key[2] if kind in ("loop", "last chunk", "ahead") else key[-1]
    return Buffer("loop state", f"of {loop}", size)


def _size(size: int) -> str:
    if size >= 2**20:
        return f"{size / 2**20:.1f} MiB"
    return f"{size / 2**10:.1f} KiB" if size >= 2**10 else f"{size} bytes"
