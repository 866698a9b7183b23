"""How many iterations of a long loop to rerun at a time (no TensorFlow).

Rerunning a T-iteration loop in chunks of k keeps ceil(T/k) carried states
(the chunk boundaries) plus one chunk's per-iteration intermediates:
memory(k) = ceil(T/k) * state_bytes + k * step_bytes, least near
k = sqrt(T * state_bytes / step_bytes). With equal sizes that is k = sqrt(T),
about 2 * sqrt(T) states instead of T.
"""

from __future__ import annotations

import math


def chunk_size(trip_count: int, state_bytes: int = 1, step_bytes: int = 1) -> int:
    """The k in 1..trip_count that minimises `chunked_bytes`.

    Example: chunk_size(1000) == 31; chunk_size(1000, 1, 4) == 15.
    """
    if trip_count <= 1:
        return max(trip_count, 1)
    best = math.sqrt(trip_count * max(state_bytes, 1) / max(step_bytes, 1))
    candidates = {min(max(int(k), 1), trip_count) for k in (math.floor(best), math.ceil(best))}
    return min(sorted(candidates),
               key=lambda k: chunked_bytes(trip_count, k, state_bytes, step_bytes))


def chunked_bytes(trip_count: int, size: int, state_bytes: int, step_bytes: int) -> int:
    """Predicted peak of a loop's gradient when rerun in chunks of `size`."""
    return math.ceil(trip_count / size) * state_bytes + size * step_bytes


# A loop gradient's buffers the size of a table its body gathers from, beside
# the gradient it returns: the running sum and this iteration's part made
# dense, the least it holds (measured: 2.08 to 10 tables beside the result;
# the zeros the sum starts from often stay too, and the executor often makes
# parts ahead of the sum, up to the loop's parallel_iterations).
GATHERED_SUM_BUFFERS = 2


def gradient_scratch_bytes(loop, chunk: bool) -> int:
    """What a gradient of a `core.model.Loop` sums in beside the stacks it
    reads: a gathered table's dense sums, and for a gradient of one `chunk`
    its weights' gradients too (the loop's whole gradient sums those in its
    outputs)."""
    own_sums = loop.invariant_bytes if chunk else 0
    return own_sums + GATHERED_SUM_BUFFERS * loop.gathered_bytes


def trips(loop) -> int:
    """A `core.model.Loop`'s iteration count, 1 when unknown or zero."""
    return max(loop.trip_count or 1, 1)


def stacked_bytes(loop) -> int:
    """What a `core.model.Loop`'s stock gradient keeps: every iteration's stacks."""
    return loop.iteration_bytes * trips(loop)


def boundary_bytes(loop) -> int:
    """What a chunked `Loop` keeps for backprop: its ceil(T/k) chunk-boundary states."""
    return math.ceil(trips(loop) / loop.chunk_size) * loop.state_bytes


def chunk_stack_bytes(loop) -> int:
    """The stacks of one chunk, alive while that chunk's gradient runs."""
    return min(loop.chunk_size, trips(loop)) * loop.iteration_bytes


def last_chunk_trips(loop) -> int:
    """Iterations of a chunked `Loop`'s last chunk: of its ceil(T/k) chunks
    all but the last are k iterations long."""
    chunks = math.ceil(trips(loop) / loop.chunk_size)
    return trips(loop) - (chunks - 1) * loop.chunk_size


def rewritten_bytes(loop) -> int:
    """What a rerun of a `Loop` writes into its lists again (its output sequence)."""
    return loop.written_bytes * trips(loop)


def run_ahead_buffers(loop, iterations: int, kept: int, one_at_a_time: bool = False) -> tuple:
    """(count, bytes each) of a `Loop`'s values computed ahead
    (`Loop.ahead_bytes`) at their most during a run of `iterations`
    iterations, above the `kept` bytes the run leaves (stacks or boundaries,
    which grow as the values ahead are used up): min(P, n) iterations' values
    at first, less what they will keep, max(0, ahead - kept / n) each. P is
    the loop's `parallel_iterations`, 1 for the chunks the rewrite reruns
    (`one_at_a_time`).

    Example: an LSTM's 64 KiB input projection, 16 iterations, 32 in
    parallel: 16 of 64 KiB when the run keeps nothing, none when it keeps a
    stack of 128 KiB per iteration.
    """
    n = max(iterations, 1)
    parallel = 1 if one_at_a_time else loop.parallel_iterations
    return min(parallel, n), max(0, loop.ahead_bytes - kept // n)
