"""Differentiating a long loop from the chunk-boundary states its forward pass
saved (loop_recording.py): each chunk runs once more, newest first.

Chunk j restarts from the state the forward loop saved at iteration j*k
(chunk 0 from the loop's inputs), runs its k iterations as a plain While op
that the stock gradient differentiates (keeping k iterations), once the
gradient of its outputs has arrived: the gradient of chunk j+1's inputs, or
of the loop's outputs for the last chunk. Loop invariants (weights) are
inputs of every chunk: their gradients add up along the chain, as within one
loop. The loop runs twice in all (forward, then once in chunks), against
three times for a chain of chunks rerun during backprop (loop_chunks.py).
"""

from typing import List, Sequence

import tensorflow as tf

from memory_saving_gradients.tfgraph import compat
from memory_saving_gradients.tfgraph import loop_recording
from memory_saving_gradients.tfgraph import loop_rerun

# Registered gradient of `forward_outputs`' pass-through op.
REPLAY_GRADIENT = "MemorySavingGradientsLoopReplay"


def replay_gradients(loop: tf.Operation, found: loop_recording.Recording,
                     inputs: Sequence[tf.Tensor], grads: Sequence, after=()) -> list:
    """Gradients of `inputs` (what the loop read, or a copy's stand-ins for
    them), given `grads` of the loop's outputs (as many as `inputs`); the
    last chunk's rerun waits for the gradients `after` too."""
    grads = list(grads)
    chunks = found.layout
    for chunk in reversed(range(chunks.count)):
        limits = [tf.constant(0, inputs[0].dtype), chunks.limit(chunk, inputs[0].dtype)]
        grads = loop_rerun.differentiate_rerun(
            loop.graph, _chunk_inputs(loop, found, list(inputs), chunk, limits), grads,
            lambda chunk_inputs: loop_rerun.copy_while(
                loop, chunk_inputs, one_at_a_time=True).outputs,
            after if chunk == chunks.count - 1 else ())
        if not any(g is not None for g in grads):
            break  # the earlier chunks get none either
    return grads


def _chunk_inputs(loop, found, inputs, chunk, limits):
    """A callable making chunk `chunk`'s inputs (after its gradient arrived)."""
    def make() -> List[tf.Tensor]:
        if chunk == 0:
            return limits + inputs[2:]
        carried = inputs[2:found.num_inputs]
        return limits + [_saved_state(loop, found, i, chunk, carried)
                         if i in found.saved else inputs[i]
                         for i in range(2, found.num_inputs)]
    return make


# Registered gradient of a saved state's read (`_saved_state`).
SAVED_STATE_GRADIENT = "MemorySavingGradientsSavedState"


def _saved_state(loop, found, index, chunk, carried):
    """The state `index` saved at the start of `chunk`, as a function of the
    loop's carried inputs `carried` (or a copy's stand-ins for them): its
    gradient, which only a second order reaches, reruns the iterations
    before the chunk from them and differentiates that rerun."""
    value = loop_recording.saved_state(loop, found, index, chunk)
    read = tf.identity_n([value] + list(carried))
    compat.set_gradient_override(read[0].op, SAVED_STATE_GRADIENT)
    saved = (loop, index, chunk * found.layout.size)
    read[0].op._memory_saving_saved = saved  # pylint: disable=protected-access
    return read[0]


@tf.RegisterGradient(SAVED_STATE_GRADIENT)
@loop_rerun.always_in_turn
def _saved_state_gradient(read, grad, *_, after):
    # The value read is the state after `start` iterations from `carried`
    # (or the final one, where the loop stopped before: the same as the
    # prefix rerun, which its condition stops there too). Through the
    # recording lists, TensorFlow's gradient came out 19% off on a tanh loop.
    # The prefix reruns once its gradient arrives, after the prefix
    # differentiated before it (per thread: a tf.distribute strategy's
    # replicas trace in threads): one prefix's iterations alive at a time.
    loop, index, start = read._memory_saving_saved  # pylint: disable=protected-access
    carried = list(read.inputs[1:])
    dtype = loop.inputs[0].dtype
    grads = [None] * (2 + len(carried))
    grads[index] = grad
    found = loop_rerun.differentiate_rerun(
        read.graph, [tf.constant(0, dtype), tf.cast(start, dtype)] + carried, grads,
        lambda inputs: loop_rerun.copy_while(loop, inputs, one_at_a_time=True).outputs,
        after)
    return [None] + found[2:]


def forward_outputs(loop: tf.Operation, found: loop_recording.Recording,
                    inputs: Sequence[tf.Tensor]) -> List[tf.Tensor]:
    """The loop's outputs as from a copy reading `inputs`, without running it:
    the forward pass's values, with a gradient that replays the chunks and
    sends the gradients to `inputs`."""
    outputs = loop.outputs[:found.num_inputs]
    passed = tf.identity_n(list(outputs) + list(inputs))
    compat.set_gradient_override(passed[0].op, REPLAY_GRADIENT)
    passed[0].op._memory_saving_replayed = loop  # pylint: disable=protected-access
    for forward, copy in zip(outputs, passed):
        if forward.dtype in (tf.resource, tf.variant):
            compat.copy_handle_data(forward, copy)
    return passed[:found.num_inputs]


@tf.RegisterGradient(REPLAY_GRADIENT)
@loop_rerun.in_turn
def _replay_gradient(passed, *grads, after):
    loop = passed._memory_saving_replayed  # pylint: disable=protected-access
    found = loop_recording.recording(loop)
    count = found.num_inputs
    inputs = passed.inputs[count:]
    return [None] * count + replay_gradients(loop, found, inputs, grads[:count], after)
