"""Running the gradient ops that need scratch memory one at a time.

On CPU a convolution's two gradient ops (Conv2DBackpropInput and
Conv2DBackpropFilter) each allocate scratch as large as tens of MiB (im2col
patches), and they do not depend on each other. With several inter-op
threads TensorFlow runs them at once, so the step's peak holds two (or more)
scratch buffers: the CIFAR ResNet's "memory" plan peaked at 80 MiB with
default threading, 57.5 MiB of it the scratch of one convolution's two
gradient ops running side by side, against 55 MiB with one inter-op thread.
The planner's timeline counts one scratch at a time. Chaining these ops in
the order tf.gradients made them (reverse topological: a layer's input
gradient, its weight gradient, then the layer below; level after level) makes
that so whatever the thread count. `conv_gradients`' own gradient of a
convolution (tap slices and matrix products, no scratch op) joins the chain
as two links, its input and its filter gradient, each held back at a gate:
with several threads two convolutions' slices ran at once (VGG16 at 64 px,
`"memory"`: 48.0 MiB of activations, 31.9 with one thread; chained, 44.9
with either, the predicted peak). Of one layer's two gradient ops the one
with the smaller output (the weight gradient) runs first: it frees the
layer's input (often recomputed just for it) before the input gradient
allocates its layer-input-sized output, so the two never coexist. In
creation order they did: on MobileNetV2 (64 px, batch 144, `"memory"`) a
padded depthwise convolution's input gradient, 57 MiB, was alive while its
input was recomputed for the filter gradient, the step's peak
(docs/benchmarks_main.md). Each kernel still uses every intra-op thread.

Where the host's stock kernels take no scratch (oneDNN's, TensorFlow's
default on CPUs with AVX-512 VNNI or AMX; `workspace.stock_kernels_take_scratch`)
the chain saves little memory and takes away the inter-op parallelism of
independent gradient ops: measured side by side with default threading at
batch 8, `"memory"` steps of MobileNetV2 took 1.36x tf.gradients' time chained
and 1.32x not, DenseNet121 1.33x and 1.27x, for activation memory within 2%
(ResNet50: 1.18x and 1.15x, 6% more memory unchained). There only the
weight-gradient-first order of each layer's pair is kept: without it
MobileNetV2's step at batch 158 peaked 19 MiB higher.
"""

from __future__ import annotations

import tensorflow as tf

from memory_saving_gradients.tfgraph import compat
from memory_saving_gradients.tfgraph import conv_gradients
from memory_saving_gradients.tfgraph import workspace
from memory_saving_gradients.tfgraph.gradient_waits import ancestors_among
from memory_saving_gradients.tfgraph.gradient_waits import depends_on
from memory_saving_gradients.tfgraph.gradient_waits import gradient_tensors
from memory_saving_gradients.tfgraph.op_kinds import tensor_bytes
from memory_saving_gradients.tfgraph.workspace import SCRATCH_GRADIENT_OP_TYPES

# Convolutions whose gradient is a "...BackpropInput" and a "...BackpropFilter" op.
_SWAPPED_CONVOLUTIONS = frozenset({"Conv2D", "DepthwiseConv2dNative"})


class ScratchChain:
    """Chains the scratch-allocating gradient ops of one backprop, per device.

    Ops join in creation order, across every tf.gradients call of the
    backprop (a level whose ops are all kept is differentiated without a
    gate, and its gradient ops would otherwise run beside the previous
    level's), but for a layer's weight gradient, which goes before its input
    gradient. The other ordering edges of the rewrite run from an earlier op
    to a later one, and that swap is made only where the weight gradient
    does not depend on the input gradient through any edge made so far (the
    rewrite orders leaves first), so the chain makes no cycle. Where the
    host's kernels take no scratch, only those swaps are made (module
    docstring).
    """

    def __init__(self):
        self._last_on_device = {}
        self._chained = None  # asked once per backprop, at its first scratch op

    def extend(self, new_ops: list, gradients: list) -> None:
        """Appends the scratch ops among `new_ops` that `gradients` need.

        `new_ops`: the ops one tf.gradients call just created, in creation
        order; `gradients`: what it returned. tf.gradients also makes
        gradient ops nobody reads (the input gradient of a first
        convolution); the executor skips them, and a chain through them
        would make them run.
        """
        needed = ancestors_among(new_ops, [t for g in gradients for t in gradient_tensors(g)])
        links = [_link(op) for op in new_ops if op in needed and (
            op.type in SCRATCH_GRADIENT_OP_TYPES or conv_gradients.half_of(op) is not None)]
        if links and self._chained is None:
            self._chained = _chained_here()
        if links and not self._chained:
            for i in _swappable(links):
                compat.add_control_input(links[i][0], links[i + 1][1])
            return
        for start, end in _smaller_output_first(links):
            previous = self._last_on_device.get(end.device)
            if previous is not None and previous not in start.control_inputs:
                compat.add_control_input(start, previous)
            self._last_on_device[end.device] = end


def _link(op: tf.Operation) -> tuple:
    """(the op to hold back, the op that ends it) of a scratch-allocating gradient
    op (itself twice) or of a half of `conv_gradients`' gradient of a
    convolution (its gate, its result: its slices and products are not
    scratch ops, but with several threads two convolutions' ran at once)."""
    half = conv_gradients.half_of(op)
    return (op if half is None else half.gate), op


def _chained_here() -> bool:
    """Whether the scratch ops are chained: where the host's CPU kernels take
    scratch, and wherever a GPU may run them (cuDNN takes workspace; the probe
    measures CPU kernels only)."""
    return bool(tf.config.list_logical_devices("GPU")) or workspace.stock_kernels_take_scratch()


def _smaller_output_first(links: list) -> list:
    """`links` (in creation order) with each `_swappable` pair swapped."""
    ordered = list(links)
    for i in _swappable(links):
        ordered[i], ordered[i + 1] = ordered[i + 1], ordered[i]
    return ordered


def weight_gradient_first(op: tf.Operation) -> bool:
    """Whether `op`'s filter gradient runs before its input gradient
    (`_swappable`): a convolution whose filter is smaller than its input. Not
    under XLA, which schedules the step itself, ignoring control edges."""
    return (op.type in _SWAPPED_CONVOLUTIONS and not compat.in_xla_context(op.graph)
            and tensor_bytes(op.inputs[1]) < tensor_bytes(op.inputs[0]))


def _swappable(links: list) -> list:
    """The positions i in `links` (`_link`s, in creation order) where links[i]
    and links[i + 1] are the input and the weight gradient of one convolution
    (both read the same incoming gradient: tf.gradients makes the input
    gradient first), the weight gradient's output is the smaller and it does
    not depend on the input gradient."""
    roles = [_role(op) for _, op in links]
    return [i for i, ((first_start, first), (_, second)) in enumerate(zip(links, links[1:]))
            if roles[i][0] == "input" and roles[i + 1] == ("filter", roles[i][1])
            and tensor_bytes(second.outputs[0]) < tensor_bytes(first.outputs[0])
            and not depends_on(second, first_start)]


def _role(op: tf.Operation) -> tuple:
    """("input" or "filter", the incoming gradient's name) of a convolution's
    gradient op or `conv_gradients.Half`'s result; (None, None) for others."""
    half = conv_gradients.half_of(op)
    if half is not None:
        return half.role, half.out_backprop.name
    for role, suffix in (("input", "BackpropInput"), ("filter", "BackpropFilter")):
        if op.type.endswith(suffix):
            return role, op.inputs[2].name  # `out_backprop`
    return None, None
