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
When its condition bounds it all the same (`chunk_bound`: every test of it
compares a counter with a limit known now, as `i < n`) it is chunked too: its
condition is first made to test the counter against a `maximum_iterations`
input that is not negative (`_stop_at_bound`), which leaves the forward
loop's run as it was.

A loop whose bound is known only at run time (a Keras RNN over sequences of
unknown length, `tf.while_loop(..., maximum_iterations=n)` with a tensor n,
AutoGraph's `for t in tf.range(tf.shape(x)[1])`: `bounded_at_run_time`) is
laid out in `RUNTIME_CHUNKS` chunks of ceil(T / RUNTIME_CHUNKS) iterations,
T computed when the step runs (`layout`, `run_time_trips`). Any other loop is
rerun whole.
"""

import contextlib
import dataclasses
import logging
from typing import Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from memory_saving_gradients.core import loop_chunking
from memory_saving_gradients.tfgraph import compat
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
_COUNTER, _BOUND = 0, 1  # while_v2's first two loop inputs
# Comparisons a loop condition may test its counter with: op type ->
# (the counter is the first operand, the limit is reached too).
_COMPARISONS = {"Less": (True, False), "LessEqual": (True, True),
                "Greater": (False, False), "GreaterEqual": (False, True)}
# Body ops whose outputs are no new memory.
_FREE_OP_TYPES = frozenset({"Placeholder", "Identity", "Const", "ReadVariableOp"})
# Chunks a loop bounded only at run time is laid out in: its T iterations
# then keep ceil(T / 16) iterations' stacks and 16 states, whatever T is
# (the least for T near 16 * 16 when a state weighs what an iteration does).
# The planner, which cannot know T, plans such a loop as if T were that.
RUNTIME_CHUNKS = 16


def loop_function(loop: tf.Operation, part: str = "body"):
    """The loop's `part` ('body' or 'cond') as a FuncGraph: as traced in
    Python when available (complete shapes), else imported; None if neither."""
    try:
        return (compat.traced_function_graph(loop, part)
                or compat.while_function_graph(loop, loop.get_attr(part).name))
    except (KeyError, ValueError):
        return None


def trip_bound(loop: tf.Operation) -> Optional[int]:
    """The loop's `maximum_iterations` if known now (>= 0), else None."""
    value = static_values.static_value(loop.inputs[_BOUND])
    if value is None or np.ndim(value) != 0 or int(value) < 0:
        return None
    return int(value)


def trip_count(loop: tf.Operation) -> Optional[int]:
    """How many iterations the loop runs at most, if known now: its
    `maximum_iterations`, else what its condition allows (`condition_trips`)."""
    bound = trip_bound(loop)
    return condition_trips(loop) if bound is None else bound


def planned_trips(loop: tf.Operation) -> Optional[int]:
    """`trip_count`, or for a loop bounded at run time the count the planner
    assumes: RUNTIME_CHUNKS ** 2, which its chunks suit best."""
    count = trip_count(loop)
    if count is None and bounded_at_run_time(loop):
        return RUNTIME_CHUNKS ** 2
    return count


def trips(loop: tf.Operation) -> int:
    """`planned_trips` as a count to scale by: 1 when unknown or zero
    (`core.loop_chunking.trips` for a loop op)."""
    return max(planned_trips(loop) or 1, 1)


def condition_trips(loop: tf.Operation) -> Optional[int]:
    """Iterations the loop's condition allows when it compares a carried
    counter with a limit known now (`i < n`, `i <= n`, `n > i`, ...; either
    side of a logical and), the counter starting at a known value and the
    body adding a known positive step to it; else None."""
    found = [count.known_trips(loop) for count in _bound_facts(loop).counts
             if count is not None]
    found = [trips for trips in found if trips is not None]
    return min(found) if found else None


def bounded_at_run_time(loop: tf.Operation) -> bool:
    """True if the loop's trip count is known only when it runs: its
    `maximum_iterations` is a tensor computed then, or, built without one,
    every test of its condition counts a counter to a limit and some limit
    or start is such a tensor (`for t in tf.range(tf.shape(x)[1])`).

    Not under XLA, which compiles such a bound as a constant: chunks past it,
    given no iteration, failed to compile ("Update dim size 1 greater than
    dynamic slice dimension: 0"); those loops are rerun whole.
    """
    if compat.in_xla_context(loop.graph) or trip_bound(loop) is not None:
        return False
    facts = _bound_facts(loop)
    if facts.built_with_maximum_iterations:
        return static_values.static_value(loop.inputs[_BOUND]) is None
    return (facts.built_with_maximum_iterations is False and bool(facts.counts)
            and all(count is not None and count.countable_at_run_time
                    for count in facts.counts)
            and chunk_bound(loop) is None)


def run_time_trips(loop: tf.Operation, inputs: Sequence[tf.Tensor]) -> tf.Tensor:
    """The iterations a loop `bounded_at_run_time` runs at most, as an int32
    tensor of `inputs` (the loop's, or a copy's): the least of its
    `maximum_iterations` and the counts of its condition's tests (a review:
    `t < 400` given n = 100,000 was laid out over n, all 400 in one chunk)."""
    facts = _bound_facts(loop)
    bounds = [count.trips(inputs) for count in facts.counts
              if count is not None and count.countable_at_run_time]
    if facts.built_with_maximum_iterations:
        bounds.append(tf.maximum(tf.cast(inputs[_BOUND], tf.int32), 0))
    return bounds[0] if len(bounds) == 1 else tf.reduce_min(tf.stack(bounds))


def chunk_bound(loop: tf.Operation) -> Optional[int]:
    """The iterations a chunked loop's chunks are laid out over, if known now.

    Its `maximum_iterations`; for a loop built without one, what its condition
    allows where every test of it counts (a test of the data too makes the
    count a cap the loop may stop far below, and a chunk would be built for
    every k iterations of the cap); else None. A `maximum_iterations` known
    only at run time (or negative) bounds the loop too, and a chunk, given k
    in its place, would lose it: None.
    """
    bound = trip_bound(loop)
    if bound is not None:
        return bound
    facts = _bound_facts(loop)
    if facts.built_with_maximum_iterations is not False or not facts.counts:
        return None
    known = [None if count is None else count.known_trips(loop) for count in facts.counts]
    return None if None in known else min(known)


@dataclasses.dataclass(frozen=True)
class _Count:
    """A test of a loop's condition comparing a carried counter with a limit.

    The counter is loop input `counter`, stepped by `step` (> 0) each
    iteration; the limit is `limit`, known now, or else loop input
    `limit_input`, an invariant; `inclusive` for `<=` and `>=`.
    """

    counter: int
    step: int
    inclusive: bool
    limit: Optional[np.ndarray]
    limit_input: Optional[int]
    dtype: tf.DType

    @property
    def countable_at_run_time(self) -> bool:
        """True if `trips` is exact: its int64 arithmetic cannot overflow for
        a counter of 32 bits or fewer (a review: 64-bit counters near their
        limits gave a count too small, and wrong gradients)."""
        return self.dtype.size <= 4

    def known_trips(self, loop: tf.Operation) -> Optional[int]:
        """The iterations it allows, if its start and limit are known now."""
        start = static_values.static_value(loop.inputs[self.counter])
        limit = (self.limit if self.limit_input is None
                 else static_values.static_value(loop.inputs[self.limit_input]))
        if start is None or limit is None or np.ndim(start) or np.ndim(limit):
            return None
        span = int(limit) - int(start) + (1 if self.inclusive else 0)
        trips = max(-(-span // self.step), 0)
        # Counted only where the counter's last value fits its dtype (a uint8
        # stepped past 255 wraps around, and runs on).
        return trips if int(start) + trips * self.step <= self.dtype.max else None

    def trips(self, inputs: Sequence[tf.Tensor]) -> tf.Tensor:
        """The iterations it allows, as an int32 tensor of `inputs`; int32's
        largest where the counter would wrap around first (the loop may
        then run on: its first chunk is given every iteration). Exact only
        where `countable_at_run_time`."""
        start = tf.cast(inputs[self.counter], tf.int64)
        limit = tf.cast(self.limit if self.limit_input is None else inputs[self.limit_input],
                        tf.int64)
        span = limit - start + (1 if self.inclusive else 0)
        trips = tf.maximum(-(-span // self.step), 0)
        most = tf.constant(tf.int32.max, tf.int64)
        runs_on = (start + trips * self.step > self.dtype.max) | (trips > most)
        return tf.cast(tf.where(runs_on, most, trips), tf.int32)


@dataclasses.dataclass(frozen=True)
class _BoundFacts:
    """How a loop is bounded, read from its functions as built (cached on
    the op: `_stop_at_bound` then changes its condition)."""

    built_with_maximum_iterations: Optional[bool]  # None: its functions cannot be read
    counts: tuple  # per test of its condition (the sides of logical ands): a _Count or None


def _bound_facts(loop: tf.Operation) -> _BoundFacts:
    found = getattr(loop, "_memory_saving_bound_facts", None)
    if found is None:
        cond, body = loop_function(loop, "cond"), loop_function(loop)
        if cond is None or body is None:
            found = _BoundFacts(None, ())
        else:
            found = _BoundFacts(bool(cond.inputs[_BOUND].consumers()),
                                tuple(_condition_counts(loop, cond, body)))
        loop._memory_saving_bound_facts = found  # pylint: disable=protected-access
    return found


def _condition_counts(loop, cond, body) -> list:
    """For each test the loop's condition makes (the sides of its logical
    ands), a _Count where it compares a counter (`_compared`), else None."""
    tests = [loop_recording.passed_through(cond.outputs[0])]
    found = []
    while tests:
        test = tests.pop()
        if test.op.type == "LogicalAnd":
            tests.extend(loop_recording.passed_through(t) for t in test.op.inputs)
        elif test.op.type in _COMPARISONS:
            found.append(_compared(loop, cond, body, test.op))
        else:
            found.append(None)
    return found


def _compared(loop, cond, body, comparison) -> Optional[_Count]:
    """`comparison` (in `cond`) as a _Count, or None if it does not compare a
    carried integer counter stepped by a known positive value with a limit
    known now or invariant in the loop."""
    counter_first, inclusive = _COMPARISONS[comparison.type]
    counter, limit = (comparison.inputs if counter_first else reversed(comparison.inputs))
    arguments = [t.ref() for t in cond.inputs]
    counter = loop_recording.passed_through(counter)
    if counter.ref() not in arguments or not counter.dtype.is_integer:
        return None
    index = arguments.index(counter.ref())
    if index <= _BOUND:  # while_v2's own counter: bounded by maximum_iterations
        return None
    step = _step(loop, body, index)
    limit = loop_recording.passed_through(limit)
    limit_input, value = None, None
    if limit.ref() in arguments:
        limit_input = arguments.index(limit.ref())
        if not loop_recording.is_invariant(body, limit_input):
            return None
    else:
        value = tf.get_static_value(limit)
        if value is None or np.ndim(value):
            return None
    if step is None:
        return None
    return _Count(index, step, inclusive, value, limit_input, counter.dtype)


def _step(loop, body, index) -> Optional[int]:
    """The positive value known now (a constant, or a loop invariant such as
    AutoGraph's range step) the body adds to its loop variable `index`, else None."""
    value = loop_recording.returned_value(body, index)
    if value.op.type not in ("Add", "AddV2"):
        return None
    given = body.inputs[index]
    terms = [loop_recording.passed_through(t) for t in value.op.inputs]
    if given.ref() not in [t.ref() for t in terms]:
        return None
    step = _invariant_value(loop, body, body, terms[1] if terms[0] is given else terms[0])
    return int(step) if step is not None and np.ndim(step) == 0 and step > 0 else None


def _invariant_value(loop, body, function, tensor) -> Optional[np.ndarray]:
    """The value `tensor` of `function` (`loop`'s cond or body) has in every
    iteration, if known now: a constant, or a loop invariant whose input is known."""
    arguments = [t.ref() for t in function.inputs]
    if tensor.ref() not in arguments:
        return tf.get_static_value(tensor)
    index = arguments.index(tensor.ref())
    if not loop_recording.is_invariant(body, index):
        return None
    return static_values.static_value(loop.inputs[index])


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
    bound = chunk_bound(loop)
    if bound is None and bounded_at_run_time(loop):
        source = ("its maximum_iterations" if _bound_facts(loop).built_with_maximum_iterations
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
    counted = "" if trip_bound(loop) is not None else " (counted from its condition)"
    return size, f"rerun in chunks of {size} of its at most {bound} iterations{counted}"


def layout(loop: tf.Operation, size: int, inputs: Sequence[tf.Tensor]) -> loop_recording.Layout:
    """The chunks of `loop`, chunked in `size`s by `chunking`, for a run from
    `inputs` (the loop's own, or a copy's): for a loop bounded at run time,
    ops computing its chunk size from them."""
    if not bounded_at_run_time(loop):
        return loop_recording.Layout(_chunk_count(loop, size), size, chunk_bound(loop))
    with loop.graph.control_dependencies(None), tf.device(loop.device or None):
        iterations = run_time_trips(loop, inputs)
        return loop_recording.Layout(
            RUNTIME_CHUNKS, tf.maximum(-(-iterations // RUNTIME_CHUNKS), 1), iterations)


def _chunk_count(loop: tf.Operation, size: int) -> int:
    return RUNTIME_CHUNKS if bounded_at_run_time(loop) else -(-chunk_bound(loop) // size)


def _stop_at_bound(loop: tf.Operation) -> None:
    """Makes the condition of a loop built without `maximum_iterations` stop
    at its counter's bound too, where that bound (input 1) is not negative:
    the forward loop's own -1 changes nothing, and a chunk's copy given k
    stops after k iterations. Once per loop; before its states are recorded,
    so the recording's and the chunks' attributes carry it."""
    if (_bound_facts(loop).built_with_maximum_iterations is not False
            or getattr(loop, "_memory_saving_stops", False)):
        return
    cond = loop_recording.fresh_function(loop, "cond")
    with cond.as_default():
        counter, limit = cond.inputs[_COUNTER], cond.inputs[_BOUND]
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
    dtype = loop.inputs[_COUNTER].dtype
    chunks = layout(loop, size, inputs)
    _stop_at_bound(loop)
    state = inputs
    counters = [inputs[_COUNTER]]
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
        counters.append(state[_COUNTER])
    # What the original loop outputs: iterations run, its bound, its state.
    return [tf.add_n(counters), inputs[_BOUND]] + state[2:]


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
