"""Which rerunnable While loops a plan keeps instead of rerunning them (no TensorFlow).

A rerunnable loop whose outputs the model pins (a Keras RNN's: they feed list
ops that cannot be rerun) is rebuilt by its level whatever else the plan
keeps, in chunks: one or two more runs of the loop. The cut model prices
no pinned op, so every plan it offered paid those runs, and a budget above
the least peak bought no time back (the benchmarks' LSTM stack: its 50% and
70% budgets gave the `'memory'` plan). Keeping a loop trades its reruns for
memory held from the forward pass to its gradient: differentiated where it
is, in chunks from the states its forward run saved (one run, ceil(T/k)
states), or by the stock gradient (no run, T iterations of stacks).

`settings` lists the `planning.LoopModes` a search tries, fewest bytes kept
first (`peak_settings`, the ones a least-peak search tries); `adjusted` is the
cut problem under one of them.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from memory_saving_gradients.core import cuts
from memory_saving_gradients.core import loop_chunking
from memory_saving_gradients.core import op_table
from memory_saving_gradients.core.model import GraphModel
from memory_saving_gradients.core import planning
from memory_saving_gradients.core.planning import LoopModes


def rerunnable_loops(model: GraphModel) -> list:
    """The loops of `model` a plan may rerun, in topological order."""
    tensors = model.tensors
    return [op for op in op_table.order(model)
            if op in model.loops and tensors[model.op_outputs[op][0]].recomputable]


def settings(model: GraphModel) -> list:
    """The loop modes to try: none kept (the model's default), every rerunnable
    loop kept in chunks, then the chunked ones left to the stock gradient one
    more at a time, most rerun FLOPs saved per byte stacked first. A list of
    2 + (chunked loops) entries; [LoopModes()] for a model without loops."""
    loops = rerunnable_loops(model)
    if not loops:
        return [LoopModes()]
    kept = frozenset(loops)
    chunked = [op for op in loops if model.loops[op].chunk_size is not None]

    def flops_per_byte(op):
        loop = model.loops[op]
        extra = loop_chunking.stacked_bytes(loop) - loop_chunking.boundary_bytes(loop)
        return model.tensors[model.op_outputs[op][0]].cost / max(extra, 1)

    chunked.sort(key=flops_per_byte, reverse=True)
    return [LoopModes(), LoopModes(kept)] + [
        LoopModes(kept, frozenset(chunked[:count])) for count in range(1, len(chunked) + 1)]


def peak_settings(model: GraphModel) -> list:
    """The loop modes a least-peak search tries: none kept, and every
    rerunnable loop kept in chunks (the first two of `settings`). A loop's
    stacks hold its T iterations where chunks hold ceil(T/k) states and k
    iterations: giving loops their stacks rarely lowers a peak, and adds a
    setting per loop to price (8 GRUs: 10 settings, planning twice as long)."""
    return settings(model)[:2]


def adjusted(problem: cuts.CutProblem, model: GraphModel, modes: LoopModes) -> cuts.CutProblem:
    """`problem` with the loops `modes` keeps always kept and their ancestors no
    longer rebuilt for them (`op_rerun`). What a kept loop holds from the
    forward pass to its gradient (its stacks, or its chunk boundaries) is left
    to the simulator: counted as always kept, the stacks of a loop near the
    loss (freed first in backprop) made tf.gradients' own plan look as if it
    did not fit tf.gradients' memory; `strategies._fitting` lowers the cut
    model's budget by what the simulator finds above it."""
    kept = modes.in_place | modes.stacked
    if not kept:
        return problem
    position = {op: i for i, op in enumerate(problem.ops)}
    always = problem.always_kept.copy()
    always[[position[model.op_of(t)] for t in planning.kept_by_loops(model, kept)]] = True
    rerun = np.zeros(len(problem.ops), bool)
    rerun[[position[model.op_of(t)] for t in cuts.rerun_by_pinned(model, kept)]] = True
    return dataclasses.replace(problem, always_kept=always, op_rerun=rerun & ~always)


def describe(modes: LoopModes) -> tuple:
    """Notes naming the loops `modes` keeps, and how."""
    chunked = sorted(modes.in_place - modes.stacked)
    return tuple(
        f"loop {op}: {how}" for ops, how in (
            (chunked, "kept: differentiated where it is, in chunks (not rerun by a level)"),
            (sorted(modes.stacked), "kept with every iteration's stacks (stock gradient, "
                                    "no rerun)"))
        for op in ops)
