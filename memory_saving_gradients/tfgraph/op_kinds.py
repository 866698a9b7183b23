"""What kind of op an op is: recomputable or not, control flow, its size and cost.

Facts about single ops; reading.py applies them to a region.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import tensorflow as tf

from memory_saving_gradients.tfgraph import compat
from memory_saving_gradients.tfgraph import effects
from memory_saving_gradients.tfgraph import loops
from memory_saving_gradients.tfgraph import sized_shapes
from memory_saving_gradients.tfgraph import static_values

# Ops whose copies would not behave like the original (or could not be
# differentiated when copied): their outputs are kept instead of recomputed.
CONTROL_FLOW_OP_TYPES = frozenset({
    "Switch", "RefSwitch", "Merge", "RefMerge", "Enter", "RefEnter", "Exit",
    "RefExit", "NextIteration", "RefNextIteration", "LoopCond", "ControlTrigger",
    "If", "StatelessIf", "While", "StatelessWhile", "Case", "StatelessCase",
    "PartitionedCall", "StatefulPartitionedCall", "SymbolicGradient",
})

# tf.compat.v1 control flow, whose untaken branches carry dead tensors.
V1_CONTROL_FLOW_OP_TYPES = frozenset({
    "Switch", "RefSwitch", "Merge", "RefMerge", "Enter", "RefEnter", "Exit", "RefExit"})

# Ops that feed per-example data into a graph.
DATA_SOURCE_OP_TYPES = frozenset({
    "Placeholder", "PlaceholderV2", "PlaceholderWithDefault", "IteratorGetNext",
    "IteratorGetNextSync", "IteratorGetNextAsOptional", "OptionalGetValue",
})

OPAQUE_DTYPES = frozenset({tf.resource, tf.variant, tf.string})  # a set: asked per tensor

# Ops that read only their inputs' shapes: they run as soon as a tensor exists
# and need not keep it alive for backprop.
SHAPE_ONLY_OP_TYPES = frozenset({"Shape", "ShapeN", "Size", "Rank"})

def plain_read_handle(tensor: tf.Tensor, x_names) -> str | None:
    """The name of the handle `tensor` reads, if it is a plain read of a
    variable whose handle is among `x_names` (a ReadVariableOp under no
    gradient_override_map: its gradient passes to the handle unchanged) and
    is not itself among them; else None."""
    op = tensor.op
    if (op.type != "ReadVariableOp" or tensor.name in x_names or compat.gradient_overridden(op)
            or op.inputs[0].name not in x_names):
        return None
    return op.inputs[0].name


# A row (all axes but the first) must be a multiple of this many bytes for
# TensorFlow's CPU kernels to return a first-axis slice as a view of its input
# (Eigen's alignment): measured, rows of 128 and 4096 bytes were views, rows
# of 20, 48, 96 and 4000 bytes copies.
_VIEW_ROW_BYTES = 64


def first_axis_view_of(op: tf.Operation):
    """The tensor whose buffer `op`'s outputs are views of, where TensorFlow's
    CPU kernel slices it along the first axis alone without copying: a
    StridedSlice with unit strides or a Slice keeping every other axis whole,
    an Unpack, Split or SplitV on axis 0, of a tensor of rank 2 or more whose
    rows have a static size that is a multiple of 64 bytes. Else None."""
    if op.type in ("StridedSlice", "Slice", "Unpack", "SplitV"):
        source = op.inputs[0]
    elif op.type == "Split":
        source = op.inputs[1]
    else:
        return None
    shape = source.shape
    if (shape.rank is None or shape.rank < 2 or not shape[1:].is_fully_defined()
            or source.dtype.base_dtype in OPAQUE_DTYPES
            or shape[1:].num_elements() * source.dtype.size % _VIEW_ROW_BYTES):
        return None
    return source if _slices_first_axis_only(op, shape) else None


def _slices_first_axis_only(op: tf.Operation, shape: tf.TensorShape) -> bool:
    """Whether `op` (a slice, unpack or split of a tensor of `shape`) takes
    whole rows only: the first axis sliced, every other kept whole."""
    if op.type == "Unpack":
        return op.get_attr("axis") in (0, -shape.rank)
    if op.type in ("Split", "SplitV"):
        axis = static_values.const_value(op.inputs[0] if op.type == "Split" else op.inputs[2])
        return axis is not None and int(axis) in (0, -shape.rank)
    out = op.outputs[0].shape
    if op.type == "StridedSlice":
        strides = static_values.const_value(op.inputs[3])
        if (strides is None or np.any(strides != 1) or op.get_attr("ellipsis_mask")
                or op.get_attr("new_axis_mask") or op.get_attr("shrink_axis_mask") not in (0, 1)):
            return False
        if op.get_attr("shrink_axis_mask"):
            return out.rank is not None and out.as_list() == shape[1:].as_list()
    return out.rank == shape.rank and out[1:].as_list() == shape[1:].as_list()


# Ops whose CPU kernels write their one output into an input's buffer when
# that input has no other reader and the output's shape and dtype
# (`forward_input_or_allocate_output`): element-wise ops, their gradients,
# BiasAdd, AddN, softmaxes. tests/test_forwarding.py measures each.
FORWARDING_OP_TYPES = frozenset({
    "Relu", "Relu6", "Elu", "Selu", "LeakyRelu", "Softplus", "Softsign", "Tanh", "Sigmoid",
    "Softmax", "LogSoftmax", "Neg", "Exp", "Expm1", "Log", "Log1p", "Square", "Sqrt",
    "Rsqrt", "Reciprocal", "Inv", "Erf", "Erfc", "Abs", "Sign", "Floor", "Ceil", "Round",
    "Sin", "Cos", "ClipByValue", "BiasAdd", "AddN",
    "Add", "AddV2", "Sub", "Mul", "MulNoNan", "RealDiv", "Div", "DivNoNan", "FloorDiv",
    "Maximum", "Minimum", "SquaredDifference", "Pow", "Xdivy", "Xlogy", "Select", "SelectV2",
    "ReluGrad", "Relu6Grad", "EluGrad", "SeluGrad", "LeakyReluGrad", "SoftplusGrad",
    "SoftsignGrad", "TanhGrad", "SigmoidGrad", "RsqrtGrad", "SqrtGrad", "ReciprocalGrad"})


# Op type -> (output, inputs it may be written over) of kernels with several
# outputs: the sparse cross entropy writes its backprop over the logits (the
# dense one does too in TensorFlow 2.21, not in 2.16: left out).
_FORWARDING_OUTPUTS = {"SparseSoftmaxCrossEntropyWithLogits": ((1, (0,)),)}


def forwardable_inputs(op: tf.Operation) -> list:
    """(output, inputs) of each output of `op` whose kernel may write it over
    one of those inputs, in the order the kernel tries them: the one output of
    an op of FORWARDING_OP_TYPES over any input, an output of
    `_FORWARDING_OUTPUTS` over the inputs listed; inputs of the output's
    dtype and static shape that the op reads once (an input read twice, as
    in `x * x`, is held twice and never forwarded). Unknown dimensions in the
    same places are taken to be the same (the batch), and an unknown one to be
    the size the planner assumes for it (`sized_shapes`): a custom gradient's
    closure reads the original tensor, of unknown batch, beside a gradient
    probe's stand-ins sized so (EfficientNetB0's swish gradients, batch
    unknown, were taken to write over their incoming gradient alone)."""
    if op.type in FORWARDING_OP_TYPES and len(op.outputs) == 1:
        pairs = ((0, range(len(op.inputs))),)
    else:
        pairs = _FORWARDING_OUTPUTS.get(op.type, ())
    inputs = list(op.inputs)
    found = []
    for index, candidates in pairs:
        out = op.outputs[index]
        if out.shape.rank is None:
            continue
        fitting = [inputs[i] for i in candidates
                   if sum(inputs[i] is other for other in inputs) == 1
                   and inputs[i].dtype == out.dtype and _same_shape(inputs[i], out)]
        if fitting:
            found.append((out, fitting))
    return found


def _same_shape(t: tf.Tensor, out: tf.Tensor) -> bool:
    """Whether `t` has `out`'s shape (of known rank), as `forwardable_inputs` takes it."""
    if t.shape.rank is None:
        return False
    return (t.shape.as_list() == out.shape.as_list()
            or sized_shapes.sized_dims(t) == sized_shapes.sized_dims(out))


_CONTRACTION_OP_TYPES = ("MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3")


def is_recomputable(op: tf.Operation, rerunnable_loops=frozenset()) -> bool:
    """True if rerunning a copy of `op` gives the same values and gradients.

    v2 while loops are recomputable only if in `rerunnable_loops` (see loops.py).
    """
    if in_v1_control_flow(op):
        return False  # inside a tf.compat.v1 while/cond body
    if op.type in loops.LOOP_OP_TYPES:
        return op in rerunnable_loops
    if op.type in CONTROL_FLOW_OP_TYPES or not effects.type_reruns_identically(op.type):
        # Side effects, hidden state or random draws; or a call of a graph
        # function by its own op type (not a registered op type).
        return False
    return not any(_not_recomputable_dtype(t.dtype) for t in (*op.inputs, *op.outputs))


@functools.lru_cache(maxsize=None)
def _not_recomputable_dtype(dtype: tf.DType) -> bool:
    """Reference and opaque dtypes (asked once per dtype: reading asks it per tensor)."""
    return compat.is_ref_dtype(dtype) or dtype.base_dtype in OPAQUE_DTYPES


def in_v1_control_flow(op: tf.Operation, output: bool = False) -> bool:
    """True if `op` (with `output`: its outputs) is in a tf.compat.v1 while/cond body.

    Ops under jit_compile sit in an XLA context, which is not a body; an
    Exit op sits in its loop's context, but its outputs live after the loop.
    """
    context = compat.control_flow_context(op, output)
    while context is not None:
        if context.IsWhileContext() or context.IsCondContext():
            return True
        context = context.outer_context
    return False


def outermost_while_loop(op: tf.Operation):
    """The outermost tf.compat.v1 while loop (WhileContext) `op` is in, or None."""
    loop = None
    context = compat.control_flow_context(op)
    while context is not None:
        if context.IsWhileContext():
            loop = context
        context = context.outer_context
    return loop


def gradient_overridable_on_cpu(op: tf.Operation) -> bool:
    """True when `op` has no gradient override of its own and its gradient
    runs on TensorFlow's CPU kernels: no GPU in its device or on the host, and
    outside XLA (the kernel facts our overrides work around are CPU ones)."""
    return not ("_gradient_op_type" in op.node_def.attr
                or "GPU" in op.device.upper() or tf.config.list_logical_devices("GPU")
                or compat.in_xla_context(op.graph))


def much_larger(big: tf.Tensor, small: tf.Tensor) -> bool:
    """Whether `big` has at least 8 times `small`'s elements (static shapes):
    where a sum, mean or broadcast between them is worth reordering for."""
    return tensor_elements(big) >= 8 * tensor_elements(small)


# Reductions run by TensorFlow's ReductionOp kernel (`reduction_temp_bytes`).
REDUCTION_OP_TYPES = frozenset({"Sum", "Mean", "Prod", "Max", "Min", "All", "Any",
                                "EuclideanNorm"})


def reduction_temp_bytes(op: tf.Operation, value_of=static_values.const_value) -> int:
    """Bytes of the temporary a reduction's CPU kernel allocates while it runs.

    The kernel sees its input as alternating runs of reduced and kept
    dimensions (leading size-1 dimensions dropped, any other size-1 one joining
    the run before it). Up to three runs it reduces in place; beyond that it
    first copies the input, transposed so the reduced runs come last, into a
    temporary of the input's size: a tf.tile over two axes has such a sum in
    its gradient (axes [0, 2, 4, 6] of the gradient reshaped to
    [1, n, 2, h, 2, w, 1, c]). `value_of` reads the axes' value (default: a
    Const's, which leaves the user's graph as it was). Unknown shapes or axes: 0.
    """
    if op.type not in REDUCTION_OP_TYPES or not op.inputs[0].shape.is_fully_defined():
        return 0
    axes = value_of(op.inputs[1])
    dims = op.inputs[0].shape.as_list()
    if axes is None or not dims:
        return 0
    reduced = {int(a) % len(dims) for a in np.atleast_1d(axes)}
    runs, previous = 0, None
    for i, size in enumerate(dims):
        if runs == 0 and size == 1:
            continue
        flag = previous if (runs and size == 1) else i in reduced
        runs += flag != previous
        previous = flag
    return tensor_bytes(op.inputs[0]) if runs > 3 else 0


def tensor_bytes(t: tf.Tensor) -> int:
    """Bytes of `t` from its static shape (`tensor_elements`)."""
    return tensor_elements(t) * _item_bytes(t.dtype)


def tensor_elements(t: tf.Tensor) -> int:
    """Elements of `t` from its static shape, unknown dimensions as the
    planner assumes them (`sized_shapes`); an unknown rank counts as one
    element."""
    dims = sized_shapes.sized_dims(t)
    return 1 if dims is None else math.prod(dims)


@functools.lru_cache(maxsize=None)
def _item_bytes(dtype: tf.DType) -> int:
    """Bytes of one element; 8 for opaque dtypes (a handle or pointer)."""
    return dtype.size if dtype.base_dtype not in OPAQUE_DTYPES else 8


def op_cost(op: tf.Operation) -> int:
    """Rough FLOPs of `op`: exact-ish for contractions, output size otherwise."""
    out_elems = sum(tensor_elements(o) for o in op.outputs
                    if o.dtype.base_dtype not in OPAQUE_DTYPES)
    if op.type in _CONTRACTION_OP_TYPES:
        shape = op.inputs[0].shape
        inner_axis = -2 if op.get_attr("transpose_a" if op.type == "MatMul" else "adj_x") else -1
        inner = shape[inner_axis] if shape.rank else None
        return 2 * out_elems * (inner or 1)
    if op.type.startswith(("Conv", "DepthwiseConv")) and len(op.inputs) > 1:
        # A convolution and both its backprops take one product per tap of the
        # window for each element of the convolution's output: for a backprop
        # that is its `out_backprop` (third input), not its result (a strided
        # transposed convolution's result has stride**2 times more elements;
        # a filter backprop's result is the filter, its second input a shape).
        backprop = "Backprop" in op.type
        kernel = (op.outputs[0] if "BackpropFilter" in op.type else op.inputs[1]).shape
        if kernel.rank and kernel.is_fully_defined():
            # A depthwise output reads one input channel: its window, not every channel's.
            taps = kernel.as_list()[:-2 if op.type.startswith("DepthwiseConv") else -1]
            products = tensor_elements(op.inputs[2]) if backprop else out_elems
            return 2 * products * math.prod(taps)
    if op.type == "Einsum" and len(op.inputs) == 2:
        return _contraction_flops(op.get_attr("equation").decode(), op.inputs) or out_elems
    return out_elems


def _contraction_flops(equation: str, inputs) -> int:
    """2 * the product of every index's size of a two-operand einsum (one
    multiply-add per combination of output and summed indices); 0 where the
    equation has an ellipsis or a size is unknown."""
    operands = equation.split("->")[0].split(",")
    sizes = {}
    for letters, tensor in zip(operands, inputs):
        dims = tensor.shape.as_list() if tensor.shape.rank is not None else None
        if "." in letters or dims is None or len(dims) != len(letters) or None in dims:
            return 0
        sizes.update(zip(letters, dims))
    return 2 * math.prod(sizes.values())
