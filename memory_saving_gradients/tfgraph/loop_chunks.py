"""Checkpointing inside one v2 while loop: O(sqrt(T)) memory for T iterations.

The stock gradient of a While op (while_v2's `_WhileGrad`) makes the loop
push every iteration's intermediates onto TensorLists, so a T-step RNN keeps
T steps of state. Here the loop is differentiated in chunks of k iterations,
each rerun once from the state at its start, newest first, as a plain While
that the stock gradient differentiates (keeping k iterations).

Where the chunk states come from:
- preferably the forward pass: its While op is made to save its state every
  k iterations (loop_recording.py) and the chunks are replayed from those
  (loop_replay.py). The loop runs twice in all. A loop differentiated where
  it is gets this through a gradient set on it while our gradients are built
  (`chunked_gradients`, `_loop_gradient`); a loop the plan recomputes
  (`copy_loop`) takes the forward's outputs and that gradient.
- else (logged why) a chain of chunk loops rerun from the loop's inputs
  during backprop (`_copy_in_chunks`): the same While op started from the
  previous chunk's state with `maximum_iterations` = k. Only the chunk
  boundaries stay alive; every chunk but the last has our registered
  gradient (`_chunk_gradient`) that reruns it once more. The loop runs three
  times in all.

What it relies on (while_v2.while_loop): a While op's first two inputs are
the iteration counter (starting at 0) and `maximum_iterations`, and its
condition is `counter < maximum_iterations and cond(state)` when the loop was
built with `maximum_iterations`. So a chunk stops after k iterations or where
the original loop stopped, whichever is first; the chunks together run
exactly the original iterations even when the condition stops the loop early.

A loop built without `maximum_iterations` (while_v2 passes -1; AutoGraph's
`for i in tf.range(n)` and `while i < n` loops are built so) has no such test.
When its condition bounds it all the same (`loop_bounds.chunk_bound`: every test of it
compares a counter with a limit known now, as `i < n`) it is chunked too: its
condition is first made to test the counter against a `maximum_iterations`
input that is not negative (`_stop_at_bound`), which leaves the forward
loop's run as it was.

A loop whose bound is known only at run time (a Keras RNN over sequences of
unknown length, `tf.while_loop(..., maximum_iterations=n)` with a tensor n,
AutoGraph's `for t in tf.range(tf.shape(x)[1])`: `loop_bounds.bounded_at_run_time`) is
laid out in `RUNTIME_CHUNKS` chunks of ceil(T / RUNTIME_CHUNKS) iterations,
T computed when the step runs (`layout`, `loop_bounds.run_time_trips`). Any other loop is
rerun whole.
"""

import contextlib
import logging
from typing import Iterable, Iterator, List, Optional, Sequence, Tuple

import tensorflow as tf

from memory_saving_gradients.core import loop_chunking
from memory_saving_gradients.tfgraph import compat
from memory_saving_gradients.tfgraph import loop_bounds
from memory_saving_gradients.tfgraph import loop_recording
from memory_saving_gradients.tfgraph import loop_replay
from memory_saving_gradients.tfgraph import loop_rerun
from memory_saving_gradients.tfgraph import loops
from memory_saving_gradients.tfgraph import static_values

logger = logging.getLogger("memory_saving_gradients")

# Name of our registered gradient, set on chunk loops via `_gradient_op_type`.
CHUNK_GRADIENT = "MemorySavingGradientsLoopChunk"
# Set on a forward loop while our gradients are built (`chunked_gradients`).
LOOP_GRADIENT = "MemorySavingGradientsChunkedLoop"
# Body ops whose outputs are no new memory.
_FREE_OP_TYPES = frozenset({"Placeholder", "Identity", "Const", "ReadVariableOp"})
# Chunks a loop bounded only at run time is laid out in: its T iterations
# then keep ceil(T / 16) iterations' stacks and 16 states, whatever T is
# (the least for T near 16 * 16 when a state weighs what an iteration does).
# The planner, which cannot know T, plans such a loop as if T were that.
RUNTIME_CHUNKS = 16


def planned_trips(loop: tf.Operation) -> Optional[int]:
    """`trip_count`, or for a loop bounded at run time the count the planner
    assumes: RUNTIME_CHUNKS ** 2, which its chunks suit best."""
    count = loop_bounds.trip_count(loop)
    if count is None and loop_bounds.bounded_at_run_time(loop):
        return RUNTIME_CHUNKS ** 2
    return count


def trips(loop: tf.Operation) -> int:
    """`planned_trips` as a count to scale by: 1 when unknown or zero
    (`core.loop_chunking.trips` for a loop op)."""
    return max(planned_trips(loop) or 1, 1)


def choose_chunk_size(loop: tf.Operation, bound: int) -> int:
    """The core's chunk size for `loop`, from its carried state's bytes and
    the bytes its body computes per iteration (static shapes)."""
    body = compat.while_function_graph(loop, loop.get_attr("body").name)
    step = [t for op in body.get_operations() if op.type not in _FREE_OP_TYPES
            for t in op.outputs]
    state_bytes = _float_bytes(loop.inputs[2:])
    # Shapes inside a body may be unknown (variables without handle data):
    # then a step counts as much as a state.
    return loop_chunking.chunk_size(bound, state_bytes, _float_bytes(step) or state_bytes)


def _float_bytes(tensors):
    return sum(t.shape.num_elements() * t.dtype.size for t in tensors
               if t.dtype.is_floating and t.shape.is_fully_defined())


def chunking(loop: tf.Operation) -> Tuple[Optional[int], str]:
    """(chunk size, what is done and why) for rerunnable `loop`; a size of
    None means the loop is rerun whole."""
    bound = loop_bounds.chunk_bound(loop)
    if bound is None and loop_bounds.bounded_at_run_time(loop):
        source = ("its maximum_iterations" if loop_bounds.built_with_maximum_iterations(loop)
                  else "counted from its condition")
        return RUNTIME_CHUNKS, (
            f"rerun in {RUNTIME_CHUNKS} chunks of ceil(T / {RUNTIME_CHUNKS}) iterations, T "
            f"{source} when the step runs (planned as if {planned_trips(loop)})")
    if bound is None:
        return None, ("rerun whole: its trip count is not known when the gradient is "
                      "built (no maximum_iterations, and its condition does not only "
                      "compare counters with limits known now)")
    size = min(choose_chunk_size(loop, bound), bound)
    if size >= bound:
        return None, f"rerun whole: at most {bound} iteration(s), one chunk"
    counted = ("" if loop_bounds.trip_bound(loop) is not None
               else " (counted from its condition)")
    return size, f"rerun in chunks of {size} of its at most {bound} iterations{counted}"


def layout(loop: tf.Operation, size: int, inputs: Sequence[tf.Tensor]) -> loop_recording.Layout:
    """The chunks of `loop`, chunked in `size`s by `chunking`, for a run from
    `inputs` (the loop's own, or a copy's): for a loop bounded at run time,
    ops computing its chunk size from them."""
    if not loop_bounds.bounded_at_run_time(loop):
        bound = loop_bounds.chunk_bound(loop)
        return loop_recording.Layout(_chunks_of(bound, size), size, bound)
    with loop.graph.control_dependencies(None), tf.device(loop.device or None):
        iterations = loop_bounds.run_time_trips(loop, inputs)
        return loop_recording.Layout(
            RUNTIME_CHUNKS, tf.maximum(_chunks_of(iterations, RUNTIME_CHUNKS), 1), iterations)


def _chunk_count(loop: tf.Operation, size: int) -> int:
    if loop_bounds.bounded_at_run_time(loop):
        return RUNTIME_CHUNKS
    return _chunks_of(loop_bounds.chunk_bound(loop), size)


def _chunks_of(iterations, size):
    """ceil(iterations / size), for ints or integer tensors."""
    return -(-iterations // size)


def _stop_at_bound(loop: tf.Operation) -> None:
    """Makes the condition of a loop built without `maximum_iterations` stop
    at its counter's bound too, where that bound (input 1) is not negative:
    the forward loop's own -1 changes nothing, and a chunk's copy given k
    stops after k iterations. Once per loop; before its states are recorded,
    so the recording's and the chunks' attributes carry it."""
    if (loop_bounds.built_with_maximum_iterations(loop) is not False
            or getattr(loop, "_memory_saving_stops", False)):
        return
    cond = loop_recording.fresh_function(loop, "cond")
    with cond.as_default():
        counter, limit = cond.inputs[compat.WHILE_COUNTER], cond.inputs[compat.WHILE_BOUND]
        within = tf.logical_or(tf.less(limit, 0), tf.less(counter, limit))
        cond.outputs[0] = tf.logical_and(within, cond.outputs[0])
    compat.set_loop_condition(loop, cond)
    loop._memory_saving_stops = True  # pylint: disable=protected-access


def saves_states(loop: tf.Operation, size: int) -> Tuple[bool, bool]:
    """Whether `loop`'s forward run saves its chunk boundaries when it is
    differentiated where it is, and when the plan recomputes it (the same
    tests `_loop_gradient` and `copy_loop` make); else a chain reruns it."""
    in_place = loop_recording.why_not(loop) is None
    return in_place, in_place and _forward_outputs_too_big(loop, size) is None


def rerunnable_in(graph: tf.Graph, region: Iterable[str]) -> set:
    """The rerunnable v2 while loops producing the tensors named in `region`."""
    return loops.rerunnable_loops({graph.get_tensor_by_name(n).op for n in region})


def describe(graph: tf.Graph, region: Iterable[str], described=frozenset()) -> tuple:
    """One note per rerunnable loop of `region`: its chunk size, or why none;
    none for the loops named in `described` (the plan's notes say what it does)."""
    found = sorted((op for op in rerunnable_in(graph, region) if op.name not in described),
                   key=lambda op: op.name)
    return tuple(f"loop {loop.name}: {chunking(loop)[1]}" for loop in found)


def copy_loop(loop: tf.Operation, inputs: Sequence[tf.Tensor]) -> List[tf.Tensor]:
    """A copy of rerunnable `loop` reading `inputs`; returns its outputs.

    When `chunking` gives a size: the forward pass's outputs, differentiated
    from the states it saved, if it can save them and its outputs are small;
    else a chain of chunk loops. Without a size: one copy.
    """
    # A loop that already saves its states has the lists as inputs too.
    inputs = list(inputs)[:len(loop_recording.template(loop)[1])]
    size, what = chunking(loop)
    logger.info("loop %s: %s", loop.name, what)
    if size is None:
        return list(loop_rerun.copy_while(loop, inputs).outputs)
    found = _recorded(loop, size, _forward_outputs_too_big)
    if found is None:
        return _copy_in_chunks(loop, inputs, size, in_turn=True)
    return loop_replay.forward_outputs(loop, found, inputs)


def _copy_in_chunks(loop, inputs, size, in_turn=False):
    """Chains ceil(bound / size) chunk loops; returns outputs like `loop`'s.
    `in_turn` (a level's rerun): it reruns in turn with the level's other
    chains (`loop_rerun.rerun_in_turn`).

    Each chunk reads all of the previous chunk's outputs, captures (weights)
    included: their gradients then add up along the chain, as within one
    loop, instead of one partial weight gradient per chunk waiting to be summed.
    """
    dtype = loop.inputs[compat.WHILE_COUNTER].dtype
    chunks = layout(loop, size, inputs)
    _stop_at_bound(loop)
    state = inputs
    counters = [inputs[compat.WHILE_COUNTER]]
    for index in range(chunks.count):
        limits = [tf.constant(0, dtype), chunks.limit(index, dtype)]
        last = index == chunks.count - 1
        chunk = loop_rerun.copy_while(loop, limits + state[2:],
                                      None if last else CHUNK_GRADIENT, one_at_a_time=True)
        for before, after in zip(state, chunk.outputs):
            if before.dtype in (tf.resource, tf.variant):
                compat.copy_handle_data(before, after)
        if in_turn and index == 0 and not last:  # one chunk: the stock gradient, nothing to mark
            loop_rerun.rerun_in_turn(chunk)
        state = list(chunk.outputs)
        counters.append(state[compat.WHILE_COUNTER])
    # What the original loop outputs: iterations run, its bound, its state.
    return [tf.add_n(counters), inputs[compat.WHILE_BOUND]] + state[2:]


@contextlib.contextmanager
def chunked_gradients(loops: Iterable[tf.Operation]) -> Iterator[None]:
    """Within, tf.gradients differentiates each of the rerunnable `loops` by
    rerunning it in chunks, not by keeping every iteration, one loop's
    gradient after another (`loop_rerun.loop_gradients_in_turn`).

    For loops differentiated where they are (the tail after the last
    checkpoint, kept checkpoints). The attribute that selects our gradient
    is set on the forward op only while the context is open.
    """
    marked = []
    for loop in loops:
        size, what = chunking(loop)
        logger.info("loop %s: %s", loop.name, what)
        if size is not None and "_gradient_op_type" not in loop.node_def.attr:
            marked.append(loop)
    with compat.gradients_overridden(marked, LOOP_GRADIENT), loop_rerun.loop_gradients_in_turn():
        yield


@tf.RegisterGradient(LOOP_GRADIENT)
@loop_rerun.in_turn
def _loop_gradient(loop, *grads, after):
    """Differentiates the loop in chunks, in turn with the other loops: from
    the states its forward pass saved if it can, else from a chain of chunks
    rerun from its inputs."""
    size, _ = chunking(loop)
    found = _recorded(loop, size)
    if found is not None:
        count = found.num_inputs
        return loop_replay.replay_gradients(loop, found, loop.inputs[:count], grads[:count],
                                            after)
    return loop_rerun.differentiate_rerun(
        loop.graph, loop.inputs, grads, lambda inputs: _copy_in_chunks(loop, inputs, size),
        after)


@tf.RegisterGradient(CHUNK_GRADIENT)
def _chunk_gradient(chunk, *grads):
    """Reruns one chunk from its saved input state and differentiates that."""
    grads = loop_rerun.differentiate_rerun(
        chunk.graph, chunk.inputs, grads,
        lambda inputs: loop_rerun.copy_while(chunk, inputs, one_at_a_time=True).outputs)
    loop_rerun.chain_differentiated(chunk, grads)
    return grads


def _recorded(loop, size, obstacle=lambda loop, size: None):
    """`loop`'s Recording of its chunk-boundary states (made now if needed),
    or None (logged why) when it cannot save them or `obstacle` says no."""
    why = loop_recording.why_not(loop) or obstacle(loop, size)
    if why is not None:
        logger.info("loop %s: its forward pass cannot save the chunk states (%s): "
                    "rerun as a chain of chunks", loop.name, why)
        return None
    _stop_at_bound(loop)
    if loop_recording.recording(loop) is not None:
        return loop_recording.recording(loop)
    return loop_recording.record(loop, layout(loop, size, loop.inputs))


def _forward_outputs_too_big(loop, size):
    """Why a copied loop should not use its forward outputs, or None.

    Using them keeps them from the forward pass until backprop: fine for a
    final state, not for a TensorArray of more elements than the states saved
    anyway (a long sequence the plan chose to recompute).
    """
    if compat.in_xla_context(loop.graph) and any(
            t.dtype == tf.variant for t in loop.inputs[2:]):
        # tf.gradients fills the unused gradients of the pass-through with
        # zeros_like, which XLA cannot build for a list not yet written.
        return "under XLA, a pass-through of its TensorLists cannot be differentiated"
    saved = _chunk_count(loop, size)
    for handle in loop_recording.written_lists(loop):
        length = _reserved_length(handle)
        if length is None or length > saved:
            return (f"it writes a TensorArray of {length or 'unknown'} elements, more than "
                    f"the {saved} states it would save: the plan recomputes it")
    return None


def _reserved_length(handle):
    """The element count of a fixed-size TensorList (TensorListReserve), else None."""
    while handle.op.type in ("Identity", "TensorListSetItem"):
        handle = handle.op.inputs[0]
    if handle.op.type != "TensorListReserve":
        return None
    count = static_values.static_value(handle.op.inputs[1])
    return None if count is None else int(count)
