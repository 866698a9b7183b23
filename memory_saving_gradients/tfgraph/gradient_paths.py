"""Which ops pass a gradient back, and which tensors a gradient reaches: the
paths tf.gradients takes through a graph, read off its ops without building
any gradient."""

import tensorflow as tf

from memory_saving_gradients.tfgraph import compat, graph_walks

# Op types through which no gradient comes back (tf.gradients' own zeros
# among them).
_NO_GRADIENT_READERS = frozenset({"ZerosLike", "StopGradient", "PreventGradient"})


def stops_gradient(op: tf.Operation) -> bool:
    """Whether `op` stops gradients (`tf.stop_gradient`) and no
    gradient_override_map gave it a gradient."""
    return op.type in _NO_GRADIENT_READERS and not compat.gradient_overridden(op)


def passes_gradient(op: tf.Operation) -> bool:
    """Whether a gradient at `op`'s outputs can reach its inputs: not a stop
    (`tf.stop_gradient`, tf.gradients' own zeros) unless a
    gradient_override_map gave it another gradient, not registered as not
    differentiable, and with an output tapes differentiate (not a comparison
    or a shape). An op with no gradient registered counts as passing one: a
    v1 function call has its function's, and for any other
    (`lacks_gradient`) tf.gradients raises rather than pass nothing."""
    if stops_gradient(op):
        return False
    try:
        if compat.gradient_function(op) is None:
            return False
    except LookupError:
        pass
    return any(compat.is_trainable(t) for t in op.outputs)


def lacks_gradient(op: tf.Operation) -> bool:
    """Whether `op`'s type has no gradient registered (`tf.truncatemod`,
    `tf.random.poisson`'s rate), where tf.gradients raises LookupError; a v1
    function call has its function's."""
    try:
        compat.gradient_function(op)
    except LookupError:
        return not compat.is_function_op(op)
    return False


def gradient_comes_back_from(ops: list, outputs: list) -> set:
    """ids of the tensors from which a gradient at `outputs` comes back
    through `ops`: through those that pass one on (`passes_gradient`)."""
    inside, passes = set(ops), {}  # op -> passes_gradient(op), each asked once

    def gradient_passes_back(tensor: tf.Tensor) -> bool:
        if tensor.op not in inside or not compat.is_trainable(tensor):
            return False
        if tensor.op not in passes:
            passes[tensor.op] = passes_gradient(tensor.op)
        return passes[tensor.op]

    return graph_walks.tensors_feeding(outputs, through=gradient_passes_back)


def reached_from(sources: list, ops: list) -> set:
    """ids of the sources and of the outputs of `ops` depending on one,
    through any op, as tf.gradients sees it (O(len(ops)))."""
    reached = graph_walks.ops_reading(sources, within=set(ops))
    return {id(t) for t in sources} | {id(t) for op in reached for t in op.outputs}


def is_function_call(op: tf.Operation) -> bool:
    """True for ops tf.gradients differentiates even at stop_gradients.

    tf.gradients (gradients_util._GradientsHelper) gives every function call
    (PartitionedCall, StatefulPartitionedCall, a graph function called by its
    name) a gradient even when its outputs are in stop_gradients: a
    SymbolicGradient op instead of the call's registered gradient.
    """
    return (op.type in ("PartitionedCall", "StatefulPartitionedCall")
            or compat.is_function_op(op))
