"""The While-loop events of a timeline replay (`timeline._Replay`); no TensorFlow.

A loop differentiated by its stock gradient keeps T iterations' stacks from
its run to its gradient. One the plan reruns in chunks of k keeps ceil(T/k)
chunk boundaries instead, made where the rewrite makes them (its forward run,
or a chain of chunks that reruns it), and one chunk's stacks while its
gradient runs. A loop rerun whole in a level keeps its stacks while the level
runs.
"""

from __future__ import annotations

import math

from memory_saving_gradients.core import loop_chunking


class LoopEvents:
    """Mixed into `timeline._Replay`: uses its model, plan facts (`planned`,
    `copied`, `stacked`) and buffer book-keeping (`_alloc`, `_use`, `_scratch`,
    `recompute_flops`)."""

    def _chunked(self, op, loop):
        return self.planned and loop.chunk_size is not None and op not in self.stacked

    def _saves_states(self, op, loop):
        """Whether the chunked loop `op`'s boundaries come from its forward run."""
        return (loop.states_saved_when_recomputed if op in self.copied
                else loop.states_saved_in_place)

    def _reuses_forward(self, op):
        """A recomputed chunked loop that takes the forward run's outputs (no rerun)."""
        loop = self.model.loops.get(op)
        return (loop is not None and self._chunked(op, loop) and op in self.copied
                and loop.states_saved_when_recomputed)

    def _loop_forward(self, op, loop, where):
        """What a loop keeps for its gradient once it ran: stacks or chunk
        boundaries; and while it runs, the values its body computes ahead.

        A copied loop's original is not differentiated (no stacks). A chunked
        loop's boundaries are saved by its forward run or made by the chain
        of chunks that recomputes it in its level; one differentiated where it
        is without saved boundaries makes them in its gradient.
        """
        original = where == ("fwd",)
        trips = loop_chunking.trips(loop)
        kept, run = None, trips
        buffers = trips  # a stack's buffers: one per iteration
        if self._chunked(op, loop):
            if original == self._saves_states(op, loop):
                kept = loop_chunking.boundary_bytes(loop)
                buffers = math.ceil(trips / loop.chunk_size)
            if not original:  # a chain of chunks, each a loop of its own
                run = min(loop.chunk_size, trips)
                # Its last chunk is differentiated by the stock gradient: its
                # stacks stay from this run to the loop's gradient (less the
                # items its output lists hold too, counted as those outputs).
                last = loop_chunking.last_chunk_trips(loop)
                shared = sum(size for _, size in loop.stacked_items)
                self._alloc(_last_chunk(where, op), last * max(0, loop.iteration_bytes - shared))
                self.pieces[_last_chunk(where, op)] = last
        elif not original:  # rerun whole: its stacks, and its lists written again
            kept = loop_chunking.stacked_bytes(loop) + loop_chunking.rewritten_bytes(loop)
            self._hold_list_items_once(where, loop, trips)
        elif op not in self.copied:
            kept = loop_chunking.stacked_bytes(loop)
            self._hold_list_items_once(where, loop, trips)
        if kept is not None:
            self._alloc(("loop", where, op), kept)
            self.pieces[("loop", where, op)] = buffers
        if original and loop.outside_bytes and (op in self.copied or self._chunked(op, loop)):
            self._alloc(("outside", op), loop.outside_bytes)  # read again by its rerun
        # A chain of chunks runs one iteration at a time (its share of the boundaries: none).
        chain = run < trips
        self._run_ahead(op, where, loop, run, 0 if chain or kept is None else kept, chain)

    def _hold_list_items_once(self, where, loop, trips):
        """A run that keeps its stacks: the output lists' items the stacks
        hold too (`Loop.stacked_items`) are no buffers of their own."""
        for name, size in loop.stacked_items:
            key = where + (name,)
            if key in self.born:
                start, whole = self.born[key]
                self.born[key] = (start, max(0, whole - size * trips))

    def _run_ahead(self, op, where, loop, iterations, kept, one_at_a_time=False):
        """The values a run of `loop` computes ahead of its recurrence
        (`loop_chunking.run_ahead_buffers`): separate buffers, alive in this
        step only."""
        count, size = loop_chunking.run_ahead_buffers(loop, iterations, kept, one_at_a_time)
        for number in range(count if size else 0):
            self._alloc(("ahead", where, op, number), size)

    def _loop_backward(self, op, loop, where):
        """A loop's gradient frees what it kept; a chunked one reruns each chunk
        (after a chain of chunks makes its boundaries, if nothing saved them)."""
        if ("outside", op) in self.born:
            self._use(("outside", op))
        if self._chunked(op, loop):
            self._use(("loop", ("fwd",), op))
            self._use(("loop", where, op))
            chain = op not in self.copied and not loop.states_saved_in_place
            stacks = loop_chunking.chunk_stack_bytes(loop)
            rerun_stacks = stacks  # the chunks rerun here; the last one's may be kept already
            last_chunk = _last_chunk(where, op)
            if last_chunk in self.born:  # the first chunk differentiated
                self._use(last_chunk)
                rerun_stacks -= self.born[last_chunk][1]
            self._scratch(rerun_stacks + loop_chunking.rewritten_bytes(loop)
                          + loop_chunking.gradient_scratch_bytes(loop, chunk=True)
                          + (loop_chunking.boundary_bytes(loop) if chain else 0), "loop")
            self._run_ahead(op, where + ("chunk",), loop,
                            min(loop.chunk_size, loop_chunking.trips(loop)), stacks, True)
            runs = 2 if chain else 1
            self.recompute_flops += runs * self.tensors[self.model.op_outputs[op][0]].cost
        else:
            self._use(("loop", where, op))
            self._scratch(loop_chunking.gradient_scratch_bytes(loop, chunk=False), "loop")


def _last_chunk(where, op):
    """The key of the stacks a chain of chunks' last chunk keeps for its gradient."""
    return ("last chunk", where, op)
