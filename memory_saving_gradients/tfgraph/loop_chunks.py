"""Checkpointing inside one v2 while loop: O(sqrt(T)) memory for T iterations.

The stock gradient of a While op (while_v2's `_WhileGrad`) makes the loop
push every iteration's intermediates onto TensorLists, so a T-step RNN keeps
T steps of state. When the rewrite reruns a loop during backprop, it instead
reruns it as a chain of chunk loops of k iterations each (`copy_loop`): each
chunk is the same While op (same cond and body functions) started from the
previous chunk's state with `maximum_iterations` = k. Only the chunk
boundaries (about T/k carried states) stay alive. Every chunk but the last
has our registered gradient (`_chunk_gradient`): it reruns the chunk once
more, from its saved input state, as a plain While that the stock gradient
differentiates (keeping k iterations), after the gradient from the chunk
after it arrived. Peak: T/k carried states plus one chunk's intermediates.

What it relies on (while_v2.while_loop): a While op's first two inputs are
the iteration counter (starting at 0) and `maximum_iterations`, and its
condition is `counter < maximum_iterations and cond(state)` when the loop was
built with `maximum_iterations`. So a chunk stops after k iterations or where
the original loop stopped, whichever is first; the chunks together run
exactly the original iterations even when the condition stops the loop early.
A loop built without `maximum_iterations` (or with one not known when the
gradient is built) has no such bound in its condition: it is rerun whole.
"""

import logging
import math
from typing import List, Optional, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2
from tensorflow.python.framework import ops as tf_ops
from tensorflow.python.ops import control_flow_util_v2
from tensorflow.python.ops import gradients_impl

from memory_saving_gradients.tfgraph import static_values
from memory_saving_gradients.tfgraph import waiting

logger = logging.getLogger("memory_saving_gradients")

# Name of our registered gradient, set on chunk loops via `_gradient_op_type`.
CHUNK_GRADIENT = "MemorySavingGradientsLoopChunk"
_COUNTER, _BOUND = 0, 1  # while_v2's first two loop inputs
_stock_gradients = gradients_impl.gradients


def trip_bound(loop: tf.Operation) -> Optional[int]:
    """The loop's `maximum_iterations` if known now (>= 0), else None."""
    value = static_values.static_value(loop.inputs[_BOUND])
    if value is None or np.ndim(value) != 0 or int(value) < 0:
        return None
    return int(value)


def default_chunk_size(bound: int) -> int:
    """About sqrt(T): T/k saved states and k iterations of one chunk balance."""
    return max(1, math.ceil(math.sqrt(bound)))


def why_not_chunked(loop: tf.Operation) -> Optional[str]:
    """Why `loop` must be rerun whole, or None if it can be rerun in chunks."""
    bound = trip_bound(loop)
    if bound is None:
        return ("its trip count is not known when the gradient is built (no static "
                "maximum_iterations); it is rerun whole")
    if bound < 2:
        return f"it runs at most {bound} iteration(s); nothing to split"
    carried = [loop.inputs[i] for i in _carried_slots(loop)]
    if any(t.dtype == tf.resource for t in carried):
        return "it carries a resource handle from one iteration to the next"
    return None


def copy_loop(loop: tf.Operation, inputs: Sequence[tf.Tensor],
              chunk_size: Optional[int] = None) -> List[tf.Tensor]:
    """A copy of rerunnable `loop` reading `inputs`; returns its outputs.

    Split into chunks of `chunk_size` iterations (default about sqrt(T)) when
    `why_not_chunked` allows it, else one copy of the whole loop.
    """
    reason = why_not_chunked(loop)
    bound = trip_bound(loop)
    size = min(chunk_size or default_chunk_size(bound or 1), bound or 1)
    if reason is None and size >= bound:
        reason = f"its chunk size {size} covers all {bound} iterations"
    if reason is not None:
        logger.info("loop %s: %s", loop.name, reason)
        return list(_copy_while(loop, inputs).outputs)
    logger.info("loop %s: rerun in chunks of %d of its at most %d iterations, "
                "saving the carried state between chunks", loop.name, size, bound)
    return _copy_in_chunks(loop, list(inputs), size, bound)


def _copy_in_chunks(loop, inputs, size, bound):
    """Chains ceil(bound / size) chunk loops; returns outputs like `loop`'s."""
    carried = set(_carried_slots(loop))
    dtype = loop.inputs[_COUNTER].dtype
    state = inputs
    counters = [inputs[_COUNTER]]
    starts = range(0, bound, size)
    for start in starts:
        last = start + size >= bound
        limits = [tf.constant(0, dtype), tf.constant(min(size, bound - start), dtype)]
        # Unchanged inputs (captured weights, read-only TensorLists) are read
        # from the loop's own inputs, so their gradients meet there.
        chunk_inputs = limits + [state[i] if i in carried else inputs[i]
                                 for i in range(2, len(inputs))]
        chunk = _copy_while(loop, chunk_inputs, None if last else CHUNK_GRADIENT)
        state = list(chunk.outputs)
        counters.append(state[_COUNTER])
    # What the original loop outputs: iterations run, its bound, its state.
    return [tf.add_n(counters), inputs[_BOUND]] + state[2:]


@tf.RegisterGradient(CHUNK_GRADIENT)
def _chunk_gradient(chunk, *grads):
    """Reruns `chunk` from its saved inputs, then differentiates the rerun.

    The rerun waits for the incoming gradient through data (one carried
    input plus a zero computed from it), since XLA drops control edges: run
    early, every chunk's intermediates would be alive at once.
    """
    graph = chunk.graph
    wanted = [i for i, g in enumerate(grads) if g is not None]
    arrived = [grads[i] for i in wanted if waiting.addable(waiting.values(grads[i]).dtype)]
    with graph.control_dependencies([g.op for g in map(waiting.values, arrived)]):
        inputs = list(chunk.inputs[:2]) + [tf.identity(t) for t in chunk.inputs[2:]]
    tied = _first_numeric(chunk, inputs)
    if arrived and tied is not None:
        inputs[tied] = waiting.after(inputs[tied], arrived[0])
    rerun = _copy_while(chunk, inputs)
    partials = _stock_gradients([rerun.outputs[i] for i in wanted], inputs[2:],
                                [grads[i] for i in wanted])
    return [None, None] + list(partials)


def _first_numeric(loop, inputs):
    """Index of a numeric input to tie the rerun to: a carried one if any."""
    order = _carried_slots(loop) + list(range(2, len(inputs)))
    return next((i for i in order if waiting.addable(inputs[i].dtype)), None)


def _carried_slots(loop):
    """Input positions (past counter and bound) whose value changes per iteration.

    The others are captures: the body returns its argument unchanged.
    """
    body = _function_graph(loop, "body")
    slots = []
    for i in range(2, len(body.inputs)):
        out = body.outputs[i]
        while out.op.type == "Identity":
            out = out.op.inputs[0]
        if out is not body.inputs[i]:
            slots.append(i)
    return slots


def _copy_while(loop, inputs, gradient=None):
    """A While op like `loop` reading `inputs`, with functions of its own."""
    graph = loop.graph
    attrs = {k: v for k, v in loop.node_def.attr.items() if k != "_gradient_op_type"}
    if gradient is not None:
        attrs["_gradient_op_type"] = attr_value_pb2.AttrValue(s=gradient.encode())
    # Differentiating a loop appends data inputs to it, and a node's control
    # inputs must follow its data inputs: the loop itself waits through its inputs.
    with graph.control_dependencies(None):
        new = graph._create_op_internal(  # pylint: disable=protected-access
            loop.type, list(inputs), dtypes=[o.dtype for o in loop.outputs],
            name=loop.name, attrs=attrs, op_def=loop.op_def, compute_device=False)
    new._set_device(loop.device)  # pylint: disable=protected-access
    give_own_loop_functions(new)
    for old_t, new_t in zip(loop.outputs, new.outputs):
        new_t.set_shape(old_t.shape)
    return new


def give_own_loop_functions(loop: tf.Operation) -> None:
    """Gives a copied v2 while loop condition and body graphs of its own.

    Differentiating a while loop makes its functions output per-iteration
    accumulators, saved under the function's name + '_rewritten'. A copy
    sharing the original's function names would clash with the original (or
    another copy) being differentiated too, so it gets fresh names; while_v2
    reads these graphs from the op (`_cond_graph`, `_body_graph`).
    """
    for part in ("cond", "body"):
        func_graph = _function_graph(loop, part)
        func_graph.name = f"{loop.get_attr(part).name}_recomputed_{tf_ops.uid()}"
        setattr(loop, f"_{part}_graph", func_graph)


def _function_graph(loop, part):
    """The loop's cond or body FuncGraph: the one set on the op, else rebuilt."""
    existing = getattr(loop, f"_{part}_graph", None)
    if existing is not None:
        return existing
    shapes = [tf.TensorShape(s) for s in loop.get_attr("output_shapes")]
    return control_flow_util_v2.get_func_graph(loop, shapes, loop.get_attr(part).name)
