"""Whether a gradient function is linear in the gradients it receives.

tf.gradients sums an op's partial gradients before its gradient function sees
them. A registered gradient is a vector-Jacobian product, linear in those
gradients, so wherever the sum is split (a recomputed copy beside its
original, which a second-order gradient through ours differentiates both of)
the parts add up to the same. A gradient override (`tf.custom_gradient`,
`gradient_override_map`) need not be: a clipping one gives clip(a) + clip(b),
not clip(a + b). `reading` never copies an op whose override is not shown
linear here.

The check is static, on the ops a probe built (`gradient_reads`): every op on
a path from an incoming gradient to a result must be linear in the inputs on
such paths (a product with one of them, a sum of only them, a reshape or a
gradient kernel taking them as its incoming gradient), and every result must
be on such a path or zero. Anything else counts as not linear, which only
costs memory (the op's outputs are kept).
"""

from __future__ import annotations

import tensorflow as tf

from memory_saving_gradients.tfgraph import compat
from memory_saving_gradients.tfgraph import loops
from memory_saving_gradients.tfgraph import op_kinds
from memory_saving_gradients.tfgraph import purity

# Linear in their first input alone (the others: shapes, axes, indices).
_LINEAR_IN_FIRST = frozenset({
    "Identity", "Snapshot", "StopGradient", "PreventGradient", "EnsureShape", "CheckNumerics",
    "Neg", "Conj", "Real", "Imag", "Cast", "Reshape", "ExpandDims", "Squeeze", "Transpose",
    "ConjugateTranspose", "Sum", "Mean", "Tile", "BroadcastTo", "Slice", "StridedSlice", "Pad",
    "MirrorPad", "MirrorPadGrad", "ReverseV2", "Gather", "GatherV2", "GatherNd",
    "UnsortedSegmentSum", "SegmentSum", "Cumsum", "Unpack", "SplitV", "DepthToSpace",
    "SpaceToDepth", "SpaceToBatchND", "BatchToSpaceND", "BiasAddGrad"})
# Linear in one given input alone.
_LINEAR_IN = {"Split": 1, "ScatterNd": 1, "StridedSliceGrad": 4}
# Sums: linear when every data input is on a gradient's path (or zero).
_SUMS = frozenset({"Add", "AddV2", "Sub", "AddN", "ConcatV2", "Concat", "Pack"})
# Products: linear in whichever one of their inputs is on a gradient's path.
_PRODUCTS = frozenset({
    "Mul", "MulNoNan", "MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum",
    "Conv2D", "Conv3D", "DepthwiseConv2dNative", "Conv2DBackpropInput",
    "Conv2DBackpropFilter", "Conv3DBackpropInputV2", "Conv3DBackpropFilterV2",
    "DepthwiseConv2dNativeBackpropInput", "DepthwiseConv2dNativeBackpropFilter"})
_QUOTIENTS = frozenset({"RealDiv", "Div", "DivNoNan"})
_SELECTS = frozenset({"Select", "SelectV2"})
# Their outputs depend on the shapes they read, not the values (`_value_free`).
_SHAPES = op_kinds.SHAPE_ONLY_OP_TYPES | {"ZerosLike"}
_NAN_TESTS = frozenset({"IsNan", "IsFinite", "IsInf"})
# A gradient kernel (`ReluGrad`, `MaxPoolGradV2`, `FusedBatchNormGradV3`, ...) is
# linear in its incoming-gradient argument, named so in its op definition.
_GRADIENT_ARGUMENTS = frozenset({"gradients", "grad", "grads", "dy", "y_backprop",
                                 "out_backprop", "input_grads"})

# `_gradient_op_type` names of overrides this package makes, linear by construction.
_DECLARED = set()


def declare_linear(tensors) -> None:
    """Records that the gradient override of the ops making `tensors` (any
    nest, composites included) is linear: ours, a sum of vector-Jacobian
    products the probe cannot build alone."""
    for tensor in tf.nest.flatten(tensors, expand_composites=True):
        if not isinstance(tensor, tf.Tensor):
            continue
        attr = tensor.op.node_def.attr.get(loops.CUSTOM_GRADIENT_ATTR)
        if attr is not None:
            _DECLARED.add(attr.s)


def declared_linear(op: tf.Operation) -> bool:
    """Whether `op`'s gradient override was declared linear (`declare_linear`)."""
    attr = op.node_def.attr.get(loops.CUSTOM_GRADIENT_ATTR)
    return attr is not None and attr.s in _DECLARED


def is_linear(ops, seeds, results) -> bool:
    """Whether `results` are linear in the tensors `seeds` (the incoming
    gradients, a zero one included: a second order may send it one), made by
    `ops` (creation order, each after the ops it reads). O(inputs of `ops`).

    A tensor computed from the seeds otherwise (`bent`) may still feed an op
    whose output does not depend on its value: `tf.recompute_grad` makes its
    recomputation wait for the gradient through `where(g == g, 0, nan)`.
    """
    on_path = {id(s) for s in seeds if s is not None}
    zero, bent = set(), set()
    for op in ops:
        if _value_free(op, bent):
            if op.type == "ZerosLike":
                zero.update(id(t) for t in op.outputs)
            continue
        reading = {i for i, t in enumerate(op.inputs) if id(t) in on_path}
        if any(id(t) in bent for t in op.inputs):
            bent.update(id(t) for t in op.outputs)
        elif not reading:
            if is_zero_maker(op) or (op.type in _PRODUCTS
                                      and any(id(t) in zero for t in op.inputs)):
                zero.update(id(t) for t in op.outputs)
        elif op.type == "IdentityN":  # each output is its own input
            on_path.update(id(op.outputs[i]) for i in reading)
            zero.update(id(o) for t, o in zip(op.inputs, op.outputs) if id(t) in zero)
        elif _linear_op(op, reading, {i for i, t in enumerate(op.inputs) if id(t) in zero}):
            on_path.update(id(t) for t in op.outputs)
        else:
            bent.update(id(t) for t in op.outputs)
    return all(r is None or id(r) in on_path or id(r) in zero
               for result in results for r in _parts(result))


def _value_free(op, bent) -> bool:
    """Whether `op`'s outputs are the same whatever values it reads, given the
    tensors computed nonlinearly from the gradients (`bent`): a shape, unless
    those values chose it (`boolean_mask`); a NaN test of a linear function of
    them (NaNs aside: a NaN gradient stays NaN either way), not of a bent one
    (`sqrt(dy)` is NaN where dy < 0); `b == b` of an integer or bool."""
    reads_bent = [t for t in op.inputs if id(t) in bent]
    if op.type in ("Equal", "NotEqual") and op.inputs[0] is op.inputs[1]:
        dtype = op.inputs[0].dtype
        return not (dtype.is_floating or dtype.is_complex) or not reads_bent
    if op.type in _SHAPES:
        return all(t.shape.is_fully_defined() for t in reads_bent)
    return op.type in _NAN_TESTS and not reads_bent


def _linear_op(op, reading, zeros) -> bool:
    """Whether `op` is linear in its inputs `reading` (indices; `zeros`: inputs known zero)."""
    kind = op.type
    if kind == "Cast" and not _widens(op.inputs[0].dtype, op.outputs[0].dtype):
        return False  # rounds (a gradient compressed to bfloat16)
    if kind in _LINEAR_IN_FIRST:
        return reading == {0}
    if kind in _LINEAR_IN:
        return reading == {_LINEAR_IN[kind]}
    data = _data_inputs(op)
    if kind in _SUMS:
        return data <= reading | zeros
    if kind in _PRODUCTS:
        return len(reading) == 1
    if kind in _QUOTIENTS:
        return reading == {0}
    if kind in _SELECTS:
        return 0 not in reading and {1, 2} <= reading | zeros
    if "Grad" in kind or "Backprop" in kind:
        definition = compat.op_def(kind)
        names = [arg.name for arg in definition.input_arg] if definition else []
        return bool(names) and all(i < len(names) and names[i] in _GRADIENT_ARGUMENTS
                                   for i in reading)
    return False


def _widens(source: tf.DType, target: tf.DType) -> bool:
    """Whether a cast from float `source` to `target` is exact: the same type,
    or a float with more bytes (float16 and bfloat16 round into each other)."""
    return target == source or (target.is_floating and target.size > source.size)


def _data_inputs(op) -> set:
    """Indices of the inputs a sum adds (a concat's axis is not one)."""
    count = len(op.inputs)
    if op.type == "ConcatV2":
        return set(range(count - 1))
    if op.type == "Concat":
        return set(range(1, count))
    return set(range(count))


def is_zero_maker(op) -> bool:
    """An op whose output is all zeros: a zero constant, a zero fill, zeros_like."""
    if op.type == "ZerosLike":
        return True
    if op.type == "Const":
        value = tf.get_static_value(op.outputs[0])
        return value is not None and not value.any()
    if op.type == "Fill":
        value = tf.get_static_value(op.inputs[1])
        return value is not None and not value.any()
    return False


def _parts(result):
    """The tensors of a gradient result that carry gradient (an IndexedSlices' values)."""
    if result is None or isinstance(result, tf.Tensor):
        return (result,)
    return (result.values,)


def overrides_linear(ops, linear) -> bool:
    """Whether every op among `ops` with a gradient override or a called function
    has a linear gradient (`linear(op)`): then so does a gradient through them."""
    return all(linear(op) for op in ops
               if loops.CUSTOM_GRADIENT_ATTR in op.node_def.attr
               or purity.called_functions(op.node_def))


def calls_nonlinear_gradients(op: tf.Operation, linear) -> bool:
    """Whether a function `op` calls (a PartitionedCall's, an If's branches)
    holds an op whose gradient `linear(inner op)` finds not linear (a call
    inside is asked the same through `linear`). Of a function traced in
    another process, only its definition is known: any override counts."""
    for name in purity.called_functions(op.node_def):
        function = purity.find_function(op.graph, name)
        graph = getattr(function, "graph", None)
        if graph is not None:
            if not overrides_linear(graph.get_operations(), linear):
                return True
        elif _definition_overrides(op.graph, name):
            return True
    return False


def _definition_overrides(graph, name) -> bool:
    """Whether function `name`'s definition, or one it calls, holds a gradient
    override; True for a function not found."""
    names, seen = [name], set()
    while names:
        name = names.pop()
        if name in seen:
            continue
        seen.add(name)
        nodes = purity.function_nodes(graph, name)
        if nodes is None:
            return True
        for node in nodes:
            if loops.CUSTOM_GRADIENT_ATTR in node.attr:
                return True
            names.extend(purity.called_functions(node))
    return False
