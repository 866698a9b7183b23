"""How many iterations a v2 while loop runs: known now, or only when it runs.

A While op's first two inputs are while_v2's iteration counter and
`maximum_iterations` (-1 when the loop was built without one). A bound is
known when the gradient is built from a `maximum_iterations` known then, or,
for a loop built without one, from its condition when every test of it
compares a carried counter with a limit (`i < n`: `_Count`). Either may be
known only when the step runs (`bounded_at_run_time`, `run_time_trips`).
What is read is read once per loop, before `loop_chunks` changes its
condition (`bound_facts`).
"""

import dataclasses
from typing import Optional, Sequence

import numpy as np
import tensorflow as tf

from memory_saving_gradients.tfgraph import compat
from memory_saving_gradients.tfgraph import loop_recording
from memory_saving_gradients.tfgraph import static_values

# Comparisons a loop condition may test its counter with: op type ->
# (the counter is the first operand, the limit is reached too).
_COMPARISONS = {"Less": (True, False), "LessEqual": (True, True),
                "Greater": (False, False), "GreaterEqual": (False, True)}

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
    value = static_values.static_value(loop.inputs[compat.WHILE_BOUND])
    if value is None or np.ndim(value) != 0 or int(value) < 0:
        return None
    return int(value)


def trip_count(loop: tf.Operation) -> Optional[int]:
    """How many iterations the loop runs at most, if known now: its
    `maximum_iterations`, else what its condition allows (`condition_trips`)."""
    bound = trip_bound(loop)
    return condition_trips(loop) if bound is None else bound


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
        return static_values.static_value(loop.inputs[compat.WHILE_BOUND]) is None
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
        bounds.append(tf.maximum(tf.cast(inputs[compat.WHILE_BOUND], tf.int32), 0))
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


def built_with_maximum_iterations(loop: tf.Operation) -> Optional[bool]:
    """Whether the loop's condition, as built, reads its `maximum_iterations`
    input (None: its functions cannot be read)."""
    return _bound_facts(loop).built_with_maximum_iterations


def _bound_facts(loop: tf.Operation) -> _BoundFacts:
    found = getattr(loop, "_memory_saving_bound_facts", None)
    if found is None:
        cond, body = loop_function(loop, "cond"), loop_function(loop)
        if cond is None or body is None:
            found = _BoundFacts(None, ())
        else:
            found = _BoundFacts(bool(cond.inputs[compat.WHILE_BOUND].consumers()),
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
    if index <= compat.WHILE_BOUND:  # while_v2's own counter: bounded by maximum_iterations
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
