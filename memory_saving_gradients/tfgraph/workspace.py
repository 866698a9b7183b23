"""Scratch memory of gradient ops, measured once per op kind and shape.

On CPU a convolution's gradient ops (Conv2DBackpropFilter/Input) allocate
scratch buffers that can be as large as the activations (im2col-style
patches), and the step's peak often falls on one of them. No rule of thumb
predicts them (measured: 4 MiB for a 1x1 convolution with an 18 MiB output,
32 MiB for a 3x3 convolution with 0.5 MiB tensors), so they are measured: the
gradient ops TensorFlow's registered gradient runs for the op are built in a
scratch graph on placeholders fed zeros (Grappler would fold constants), run
by a Session, once per (op type, attributes, shapes), and the peak of the
bytes the run requests above the op's output is its workspace
(`allocations.requested_run_peak`: bytes requested, not BFC's chunks). Nothing of the user's is touched (no allocator statistics are
read or reset, no random numbers drawn), so it works in tf.compat.v1 graphs
and tf.functions alike, with or without allocator statistics. A gradient op
that fails to build or run counts zero (logged at debug level), and so
does every op under XLA (jit_compile), which runs none of these kernels.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from typing import NamedTuple, Optional

import numpy as np
import tensorflow as tf

from memory_saving_gradients.tfgraph import allocations
from memory_saving_gradients.tfgraph import compat
from memory_saving_gradients.tfgraph import conv_gradients
from memory_saving_gradients.tfgraph import op_kinds
from memory_saving_gradients.tfgraph import sized_shapes

logger = logging.getLogger(__name__)


class _Kernel(NamedTuple):
    """A raw op to measure: its type, which input of the measured op it
    differentiates (None for the op's own kernel), and its tensor arguments as
    (argument, source) pairs: "x"/"w" are the measured op's two inputs, "y"
    its output, "dy" the output's gradient, "x_shape"/"w_shape" their shapes.
    `scratch_over`: the sources whose buffer the kernel may take for a
    temporary of its own where it reads them last
    (`forward_input_or_allocate_temp`)."""
    op_type: str
    differentiates: Optional[int]
    args: tuple
    scratch_over: tuple = ()


_BACKPROP_ARGS = (("input_sizes", "x_shape"), ("filter", "w"), ("out_backprop", "dy"))
_FILTER_ARGS = (("input", "x"), ("filter_sizes", "w_shape"), ("out_backprop", "dy"))
# The gradient kernels TensorFlow's registered gradient runs for each measured
# op type. Other ops' gradients allocate little besides their outputs
# (measured: MatMul, FusedBatchNormV3, element-wise ops).
_GRADIENT_OPS = {
    "Conv2D": (_Kernel("Conv2DBackpropInput", 0, _BACKPROP_ARGS),
               _Kernel("Conv2DBackpropFilter", 1, _FILTER_ARGS)),
    "DepthwiseConv2dNative": (
        _Kernel("DepthwiseConv2dNativeBackpropInput", 0, _BACKPROP_ARGS),
        _Kernel("DepthwiseConv2dNativeBackpropFilter", 1, _FILTER_ARGS)),
    # The CPU kernel copies the pool's output into a temporary (its argmax
    # search writes over it), or takes that output's buffer if no one else holds it.
    "MaxPool": (_Kernel("MaxPoolGrad", 0, (("orig_input", "x"), ("orig_output", "y"),
                                           ("grad", "dy")), scratch_over=("y",)),),
    "AvgPool": (_Kernel("AvgPoolGrad", 0, (("orig_input_shape", "x_shape"), ("grad", "dy"))),),
    # A transposed convolution (inputs: input_sizes, filter, out_backprop), its
    # shapes given as those of the Conv2D it transposes (x: its output, dy: its
    # `out_backprop`; see `_shapes`).
    "Conv2DBackpropInput": (_Kernel("Conv2D", 2, (("input", "x"), ("filter", "w"))),
                            _Kernel("Conv2DBackpropFilter", 1, _FILTER_ARGS)),
}
# Ops whose own kernel takes scratch when it runs (forward and recomputed),
# in the same terms: the CPU transposed convolution (measured, batch 8:
# 16-32 MiB beside a 0.5-2 MiB output).
_RUN_OPS = {"Conv2DBackpropInput": (_Kernel("Conv2DBackpropInput", None, _BACKPROP_ARGS),)}
# The gradient ops that allocate scratch (gradient_order.py runs them one at a
# time); a forward Conv2D takes little (measured: under 1 MiB).
SCRATCH_GRADIENT_OP_TYPES = frozenset(
    kernel.op_type for kernels in _GRADIENT_OPS.values() for kernel in kernels) - {"Conv2D"}
_DEVICE = "CPU:0"


def gradient_workspace_bytes(op: tf.Operation, concurrent: bool = False,
                             differentiated=None) -> int:
    """Bytes `op`'s gradient ops allocate besides their outputs (0 if not
    measured): the largest one's, or with `concurrent` all of theirs together,
    as when the executor runs a convolution's two gradient kernels at once.
    `differentiated` (a flag per input of `op`) leaves out the gradient ops
    tf.gradients does not build (a first convolution's input gradient)."""
    built = None if differentiated is None else [
        differentiated[kernel.differentiates] for kernel in _GRADIENT_OPS.get(op.type, ())]
    return _workspace(op, _GRADIENT_OPS, sum if concurrent else max, built)


# A kernel argument's source as a gradient probe names its stand-in
# (`gradient_reads.Reads.scratch_forwards`).
_STAND_INS = {"x": ("input", 0), "w": ("input", 1), "y": ("output", 0), "dy": ("grad", 0)}


def gradient_scratch_forwards(op: tf.Operation, differentiated=None) -> tuple:
    """(stand-in, bytes) for each tensor whose buffer a gradient kernel of `op`
    takes for scratch where it reads that tensor last (`_Kernel.scratch_over`):
    how much less of `gradient_workspace_bytes` it allocates then, measured
    (a CPU MaxPoolGrad copies the pool's output: InceptionV3's recomputed stem
    was predicted 0.6 MiB above its measured 11.8). Stand-ins as
    `gradient_reads.Reads.scratch_forwards` names them; `differentiated` as
    in `gradient_workspace_bytes`."""
    kernels = _GRADIENT_OPS.get(op.type, ())
    if not any(kernel.scratch_over for kernel in kernels) or _unmeasured(op):
        return ()
    attrs, shapes = _hashable(_attrs(op)), _shapes(op)
    found = []
    for index, kernel in enumerate(kernels):
        if differentiated is not None and not differentiated[kernel.differentiates]:
            continue
        for source in kernel.scratch_over:
            saved = _taken_over(op.type, index, source, attrs, shapes, op.outputs[0].dtype.name)
            if saved > 0:
                found.append((_STAND_INS[source], saved))
    return tuple(found)


def several_inter_op_threads() -> bool:
    """Whether TensorFlow's executor runs independent ops at once: more than one
    inter-op thread (set by `tf.config.threading`, else by TF_NUM_INTEROP_THREADS,
    else one per CPU this process may run on). A v1 Session's ConfigProto is
    not seen: unless it sets `use_per_session_threads`, the Session runs on a
    process-wide pool that the process's first Session sized."""
    threads = (tf.config.threading.get_inter_op_parallelism_threads()
               or int(os.environ.get("TF_NUM_INTEROP_THREADS") or 0))
    if not threads:
        threads = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                   else os.cpu_count() or 1)
    return threads > 1


def scratch_free_saves(op: tf.Operation) -> bool:
    """True where our scratch-free gradient of a convolution
    (`conv_gradients`) takes less than the stock kernels' measured scratch.

    Which kernels run depends on the host: TensorFlow's own CPU kernels take
    an im2col working set (up to 32 MiB), while with oneDNN (on by default on
    CPUs with AVX-512 VNNI or AMX) they take none from TensorFlow's allocator,
    and ours would only add its tap slices and flipped filter (18 MiB on
    ResNet50's 3x3 512 -> 512 convolutions). So the host decides first
    (`stock_kernels_take_scratch`, one probe): with oneDNN, never ours (the
    per-shape probes there read a few bytes). With TensorFlow's kernels, each
    shape is measured once (an unknown batch size at the size the planner
    assumes, `sized_shapes`)."""
    if not conv_gradients.is_eligible(op) or not stock_kernels_take_scratch():
        return False
    return conv_gradients.workspace_bytes(op) < gradient_workspace_bytes(op)


@functools.lru_cache(maxsize=None)
def stock_kernels_take_scratch() -> bool:
    """Whether this host's stock convolution gradients take scratch at all:
    a 3x3 convolution of 48 channels on 8 16x16 images, whose CPU kernels
    take about 32 MiB beside tensors of 0.4 MiB, and oneDNN's none."""
    graph = tf.Graph()
    with graph.as_default(), tf.device(_DEVICE):
        image = tf.compat.v1.placeholder(tf.float32, [8, 16, 16, 48])
        w = tf.compat.v1.placeholder(tf.float32, [3, 3, 48, 48])
        probe = tf.nn.conv2d(image, w, 1, "SAME").op
    return gradient_workspace_bytes(probe) > 2**20


def run_workspace_bytes(op: tf.Operation) -> int:
    """Bytes `op` itself allocates besides its outputs when it runs: measured
    (`_RUN_OPS`), or a reduction's temporary (`op_kinds.reduction_temp_bytes`)."""
    if compat.in_xla_context(op.graph):
        return 0  # XLA compiles the op without these kernels (`_workspace`)
    return _workspace(op, _RUN_OPS, max) + op_kinds.reduction_temp_bytes(op)


def _workspace(op, table, combine, built=None):
    if op.type not in table or _unmeasured(op):
        return 0
    scratch = _measured(table is _RUN_OPS, op.type, _hashable(_attrs(op)), _shapes(op),
                        op.outputs[0].dtype.name)
    return combine([s for s, made in zip(scratch, built or [True] * len(scratch)) if made]
                   or [0])


def _unmeasured(op):
    # Under XLA (jit_compile) none of these kernels runs: XLA compiles the op
    # itself, without their scratch (a CNN's stock step: 13.7-16.2 MiB
    # measured against 38.8 predicted with the kernels' 30 MiB).
    return compat.in_xla_context(op.graph) or any(
        t.shape.rank is None for t in list(op.inputs) + list(op.outputs))


def _attrs(op):
    return tuple(sorted((name, op.get_attr(name)) for name in op.node_def.attr
                        if not name.startswith("_") and name != "T"))


def _shapes(op):
    """Input, filter (if any), output shapes; for a transposed convolution
    those of the Conv2D it transposes (its output, filter, `out_backprop`).
    Unknown dimensions as the planner assumes them (`sized_shapes`)."""
    if op.type == "Conv2DBackpropInput":
        tensors = conv_gradients.roles(op)
    else:
        tensors = list(op.inputs) + list(op.outputs)
    return tuple(tuple(sized_shapes.sized_dims(t)) for t in tensors)


def _hashable(attrs):
    return tuple((name, tuple(v) if isinstance(v, list) else v) for name, v in attrs)


@functools.lru_cache(maxsize=None)
def _measured(run, op_type, attrs, shapes, dtype):
    try:
        return _run_ops((_RUN_OPS if run else _GRADIENT_OPS)[op_type], dict(attrs), shapes, dtype)
    except Exception as error:  # pylint: disable=broad-except  # then it is not measured
        logger.debug("workspace of %s not measured: %s", op_type, error)
        return ()


@functools.lru_cache(maxsize=None)
def _taken_over(op_type, index, source, attrs, shapes, dtype):
    """Bytes less scratch the `index`-th gradient kernel of `op_type` takes
    where it reads `source` last: measured with `source` fed (the feed holds
    its buffer) and made by an op of the probe (the kernel's to write over)."""
    held = _measured(False, op_type, attrs, shapes, dtype)
    if not held:
        return 0
    try:
        kernel = _GRADIENT_OPS[op_type][index]
        taken, = _run_ops((kernel,), dict(attrs), shapes, dtype, fresh=source)
        return held[index] - taken
    except Exception as error:  # pylint: disable=broad-except  # then none is counted
        logger.debug("scratch of %s over %s not measured: %s", op_type, source, error)
        return 0


def _run_ops(specs, attrs, shapes, dtype, fresh=None):
    """Runs each `_Kernel` of `specs` in a scratch graph; returns each one's scratch.

    Inputs are fed placeholders (Grappler would fold constants away); each op
    runs twice (the first run may set up caches once) and the second run's
    peak of bytes requested above its output is its scratch. `fresh`: a
    source made, instead of fed, by a product with a fed one that the kernels
    alone read, so that its buffer is theirs to take (its bytes not counted).
    """
    with allocations.probe_graph(_DEVICE) as (graph, scope):
        x = tf.compat.v1.placeholder(dtype, shapes[0])
        y, dy = (tf.compat.v1.placeholder(dtype, shapes[-1]) for _ in range(2))
        feed = {x: np.zeros(shapes[0], dtype), y: np.zeros(shapes[-1], dtype),
                dy: np.zeros(shapes[-1], dtype)}
        values = {"x": x, "x_shape": tf.constant(shapes[0], tf.int32), "y": y, "dy": dy}
        if len(shapes) > 2:  # a convolution: input, filter, output
            w = tf.compat.v1.placeholder(dtype, shapes[1])
            feed[w] = np.zeros(shapes[1], dtype)
            values.update(w=w, w_shape=tf.constant(shapes[1], tf.int32))
        made = 0
        if fresh is not None:
            one = tf.compat.v1.placeholder(dtype, [])
            feed[one] = np.ones((), dtype)
            values[fresh] = values[fresh] * one
            made = op_kinds.tensor_bytes(values[fresh])
        gradients = [_call(kernel.op_type, attrs,
                           **{name: values[source] for name, source in kernel.args})
                     for kernel in specs]
    with tf.compat.v1.Session(graph=graph) as sess:
        return tuple(int(max(allocations.requested_run_peak(sess, out.op, feed, scope)
                             - out.shape.num_elements() * out.dtype.size - made, 0))
                     for out in gradients)


def _call(op_type, attrs, **tensors):
    """Runs raw op `op_type` on `tensors` with those of `attrs` it takes."""
    raw = getattr(tf.raw_ops, op_type)
    allowed = inspect.signature(raw).parameters
    return raw(**{k: v for k, v in tensors.items() if k in allowed},
               **{k: v for k, v in attrs.items() if k in allowed})
