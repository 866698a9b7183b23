"""Which ops pass a gradient back, and which tensors a gradient reaches: the
paths tf.gradients takes through a graph, read off its ops without building
any gradient."""

from typing import Optional, Sequence

import tensorflow as tf

from memory_saving_gradients.tfgraph import compat, gradient_reads, graph_walks, op_kinds

_CALLS = frozenset({"PartitionedCall", "StatefulPartitionedCall"})
_LOOPS = frozenset({"While", "StatelessWhile"})
_CONDS = frozenset({"If", "StatelessIf", "Case", "StatelessCase"})

# The gradient given an op taken as a constant where stop_gradients cannot
# say so: tf.gradients differentiates a function call at a stop anyway
# (`is_function_call`).
NO_GRADIENT = "MemorySavingGradientsNone"

# Op types through which no gradient comes back (tf.gradients' own zeros
# among them).
_NO_GRADIENT_READERS = frozenset({"ZerosLike", "StopGradient", "PreventGradient"})


def stops_gradient(op: tf.Operation) -> bool:
    """Whether `op` stops gradients (`tf.stop_gradient`) and no
    gradient_override_map gave it a gradient."""
    return op.type in _NO_GRADIENT_READERS and not compat.gradient_overridden(op)


def passes_gradient(op: tf.Operation, unregistered_passes: bool = True) -> bool:
    """Whether a gradient at `op`'s outputs can reach its inputs: not a stop
    (`tf.stop_gradient`, tf.gradients' own zeros) unless a
    gradient_override_map gave it another gradient, not registered as not
    differentiable, and with an output tapes differentiate (not a comparison
    or a shape). A v1 function call has its function's gradient. An op with
    no gradient registered (`lacks_gradient`) counts as passing one where
    `unregistered_passes`: tf.gradients raises there rather than pass
    nothing."""
    if stops_gradient(op):
        return False
    try:
        if compat.gradient_function(op) is None:
            return False
    except LookupError:
        if not (unregistered_passes or is_function_call(op)):
            return False
    return any(compat.is_trainable(t) for t in op.outputs)


def lacks_gradient(op: tf.Operation) -> bool:
    """Whether `op`'s type has no gradient registered (`tf.truncatemod`,
    `tf.random.poisson`'s rate), where tf.gradients raises LookupError; a
    function call has its function's."""
    try:
        compat.gradient_function(op)
    except LookupError:
        return not is_function_call(op)
    return False


def gradient_missing_at(op: tf.Operation, differentiated: Optional[Sequence[int]] = None):
    """The type of the op without a registered gradient that differentiating
    `op` would meet: `op`'s own (`lacks_gradient`), or for a cond, a loop or
    a function call, that of one inside its branches, body or function (at
    any depth) on a path from an argument to a result that a gradient
    reaches (`gradient_comes_back_from`); None if there is none. TensorFlow
    differentiates such ops from inside, for all their trainable arguments
    and results (a loop variable nothing reads after the loop too), and
    raises there. `differentiated`: the indices of `op`'s outputs whose
    results count (None: all). Once TensorFlow has differentiated such an
    op it adds outputs for the intermediates its gradient reads, which get
    none: the caller passes the outputs `op` had before. Reads functions
    only for such ops."""
    if lacks_gradient(op):
        return op.type
    if not holds_functions(op):
        return None
    indices = range(len(op.outputs)) if differentiated is None else differentiated
    for function in _functions_differentiated(op):
        arguments = ([function.inputs[i] for i in indices] if op.type in _LOOPS
                     else function.inputs)
        results = [function.outputs[i] for i in indices]
        ops = function.get_operations()
        reached = reached_from([t for t in arguments if compat.is_trainable(t)], ops)
        coming_back = gradient_comes_back_from(
            ops, [t for t in results if compat.is_trainable(t)])
        for inner in ops:
            if (any(id(t) in reached for t in inner.inputs)
                    and any(id(t) in coming_back for t in inner.outputs)):
                # Of a holder inside, the outputs a gradient reaches: its
                # outputs as built are not known here.
                missing = gradient_missing_at(inner, [
                    i for i, t in enumerate(inner.outputs) if id(t) in coming_back])
                if missing is not None:
                    return missing
    return None


def holds_functions(op: tf.Operation) -> bool:
    """Whether `op` is a v2 cond, loop or function call, differentiated
    through the functions it runs."""
    return op.type in _CALLS | _LOOPS | _CONDS


def _functions_differentiated(op: tf.Operation) -> list:
    """The function graphs differentiating `op` differentiates: a loop's
    body, a cond's or switch_case's branches, a call's function ([] where
    not found)."""
    if op.type in _LOOPS:
        body = compat.traced_function_graph(op, "body")
        return [body if body is not None
                else compat.while_function_graph(op, op.get_attr("body").name)]
    return list(compat.called_function_graphs(op)[0])


def graded_inputs(op: tf.Operation) -> list:
    """`op`'s inputs but those its registered gradient gives None
    (`_ungraded`), for an op that passes a gradient."""
    ungraded = _ungraded(op)
    return [t for i, t in enumerate(op.inputs) if i not in ungraded]


def _ungraded(op: tf.Operation) -> tuple:
    """Indices of the inputs `op`'s registered gradient gives None. Not
    asked where an output is a list, a handle or a string: the probe seeds
    those with None, so every input would look ungraded."""
    if any(t.dtype.base_dtype in op_kinds.OPAQUE_DTYPES for t in op.outputs):
        return ()
    return gradient_reads.gradient_reads(op, folds=False).ungraded


def gradient_comes_back_from(ops: list, outputs: list) -> set:
    """ids of the tensors a gradient at `outputs` reaches through `ops`, each
    op passing it (`passes_gradient`) only to the inputs its registered
    gradient gives one: not `tf.floor`'s, nor a `tf.custom_gradient`'s
    forward inputs (`gradient_reads`' `ungraded`, probed once per kind of
    op)."""
    inside, passes = set(ops), {}  # op -> passes_gradient(op), each asked once

    def gradient_passes_back(tensor: tf.Tensor) -> bool:
        if tensor.op not in inside or not compat.is_trainable(tensor):
            return False
        if tensor.op not in passes:
            passes[tensor.op] = passes_gradient(tensor.op)
        return passes[tensor.op]

    return graph_walks.tensors_feeding(outputs, through=gradient_passes_back,
                                       inputs=graded_inputs)


def read_differentiably(tensor: tf.Tensor) -> bool:
    """Whether an op reading `tensor` passes a gradient back to it
    (`passes_gradient` but not an op with no gradient registered;
    `graded_inputs`: not `tf.floor`). Its readers' own readers are not
    looked at: past the first op, a tensor read only by `tf.stop_gradient`
    may be a loss (a detached copy of it logged) as well as a stopped side
    branch."""
    return any(passes_gradient(op, unregistered_passes=False)
               and any(t is tensor for t in graded_inputs(op))
               for op in tensor.consumers())


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
    return op.type in _CALLS or compat.is_function_op(op)


@tf.RegisterGradient(NO_GRADIENT)
def _no_gradient(op, *unused_grads):
    return [None] * len(op.inputs)
