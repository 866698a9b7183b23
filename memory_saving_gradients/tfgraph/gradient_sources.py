"""Whether a gradient at a tensor can reach anything else: what it is made from.

A `tf.custom_gradient` (the layer decorator's segment) sends gradients to its
arguments only, so a tensor its body reads from outside (a closure) must carry
no gradient there, whatever later differentiates the step: a tape, or
`tf.gradients` after a tape reached the call. Asking a tape is not enough (it
watches only what it was told to); this asks the graph instead.
"""

import tensorflow as tf

from memory_saving_gradients.tfgraph import compat


def carrying_gradient(tensors: list) -> list:
    """Those of `tensors` a gradient at which may pass on to something they
    are made from.

    Walks each one's ancestors along differentiable inputs (`is_differentiable`)
    and stops at the first that takes one: a tensor a recording tape watches,
    an op reading a resource or a v1 variable's reference, a placeholder fed
    by its caller (a function's argument, a `tf.compat.v1.placeholder`).
    Constants, ops without a gradient (`tf.stop_gradient`, random ops, table
    lookups) and integer inputs end a path; a function's capture (a
    placeholder, or the constant a small eager tensor is captured as, which
    tapes see as that tensor) is followed to the tensor it captures, through
    enclosing graphs. Linear in the ops walked, each walk ending at the first
    source it finds, and in the captures of the graphs it reaches.

    What it cannot see: a later `tf.gradients` asked for a tensor made from
    constants alone, or a tape that, when the function runs, watches an
    eager tensor it captured while traced with no tape watching.
    """
    captured = {}  # graph -> {id(its capture): the tensor it captures}

    def capture_of(t):
        if t.graph not in captured:
            captured[t.graph] = {id(inner): outer
                                 for outer, inner in compat.captured_pairs(t.graph)}
        return captured[t.graph].get(id(t))

    def carries(tensor) -> bool:
        stack, seen = [tensor], set()
        while stack:
            t = stack.pop()
            if compat.tape_would_record([t]) or compat.is_ref_dtype(t.dtype):
                return True
            if compat.is_eager_tensor(t):
                continue
            op = t.op
            if op in seen:
                continue
            seen.add(op)
            if op.type in ("Const", "Placeholder"):
                outer = capture_of(t)
                if outer is not None:
                    stack.append(outer)
                elif op.type == "Placeholder":
                    return True
                continue
            if not _has_gradient(op):
                continue
            if any(i.dtype == tf.resource for i in op.inputs):
                return True
            stack.extend(i for i in op.inputs if is_differentiable(i.dtype))
        return False

    return [t for t in tensors if carries(t)]


def is_differentiable(dtype: tf.DType) -> bool:
    """Float and complex tensors carry gradients, and variants (a TensorList
    carries its items', as a Keras RNN's outputs come out of its loop);
    integers, booleans and strings do not."""
    return dtype.is_floating or dtype.is_complex or dtype.base_dtype == tf.variant


def _has_gradient(op: tf.Operation) -> bool:
    # None registered: counted as one, so that a call reading it is built
    # plainly and tf.gradients raises there as it would without us.
    try:
        return compat.gradient_function(op) is not None
    except LookupError:
        return True
