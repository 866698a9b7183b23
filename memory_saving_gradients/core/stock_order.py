"""The order stock tf.gradients' backward pass runs in, by the executor's ready queue.

No TensorFlow. The timeline's units are forward ops; TensorFlow runs the
gradient of a MatMul, a convolution or a BiasAdd as separate ops for the data
gradient and the weight gradient, both ready when the op's output gradient
is. Which one the executor runs first depends on the out-edge order of the
optimized graph (`executor_order`); the other waits on the inter-op pool's
queue, with one thread until the chain of data gradients stops. `parts`
builds that graph of gradient parts and returns the order `executor_order`
runs it in, for an assumed out-edge order.
"""

from __future__ import annotations

from typing import Collection, Union

from memory_saving_gradients.core import executor_order
from memory_saving_gradients.core import op_table

# Ops whose weight gradient TensorFlow computes in an op of its own
# (MatMul_1, Conv2DBackpropFilter, DepthwiseConv2dNativeBackpropFilter,
# BiasAddGrad), beside the data gradient.
SEPARATE_WEIGHT_GRADIENT = frozenset({
    "MatMul", "Conv2D", "Conv3D", "DepthwiseConv2dNative", "BiasAdd"})

# Ops whose data gradient is no kernel at all (BiasAdd passes its gradient
# through) or one the executor runs inline (aliasing ops): cheap, cost 0.
PASS_THROUGH = frozenset({"BiasAdd", "Reshape", "Identity", "ExpandDims", "Squeeze",
                           "StopGradient", "PreventGradient"})

# Op types whose weight gradient the optimized graph lists before their data
# gradient where TensorFlow's own CPU kernels run, as measured: with one
# inter-op thread, eight keras.applications CNNs and a U-Net held their
# convolutions' filter gradients (and what those read) until the chain of data
# gradients stopped. Not with oneDNN's kernels, whose graph rewrite lists them
# the other way; a MatMul's varies between the layers of one model (a residual
# MLP measured between the two orders). Conv3D is not measured.
WEIGHTS_LISTED_FIRST = frozenset({"Conv2D", "DepthwiseConv2dNative"})

DATA, WEIGHTS, WHOLE = "data", "weights", "whole"
_SEED = "seed"


def parts(model, threads: int = 1,
          data_last: Union[bool, Collection[str]] = True) -> list:
    """(op, DATA | WEIGHTS | WHOLE) of stock backprop, in the order they start.

    `data_last`: the out-edge order assumed: True, an op's data gradient listed
    after its weight gradient (the executor then continues with the data
    gradients and defers the weight gradients); False, the reverse; or the op
    types listed so, the others the reverse (`WEIGHTS_LISTED_FIRST`).
    """
    rows = op_table.rows(model)
    order = op_table.order(model)
    split = {op for op in order
             if model.weight_grad_bytes.get(op, 0) and rows[op].op_type in SEPARATE_WEIGHT_GRADIENT}
    producer = {o: op for op in order for o in rows[op].outputs}
    ys = frozenset(model.ys)
    # Ops a gradient reaches, from the ys back (reverse topological order).
    reached = set()
    for op in reversed(order):
        if not ys.isdisjoint(rows[op].outputs):
            reached.add(op)
    for op in reversed(order):
        if op not in reached:
            continue
        for t, _ in rows[op].grads:
            u = producer.get(t)
            if u is not None:
                reached.add(u)

    def units(op):
        if op in split:
            pair = [(op, WEIGHTS), (op, DATA)]
            listed_last = (data_last if isinstance(data_last, bool)
                           else rows[op].op_type in data_last)
            return pair if listed_last else pair[::-1]
        return [(op, WHOLE)]

    successors, cost, expensive = {}, {}, {}
    for op in reversed(order):
        if op not in reached:
            continue
        for part in units(op):
            cost[part] = max(rows[op].cost, 1)
            expensive[part] = True
        if op in split and rows[op].op_type in PASS_THROUGH:
            cost[(op, DATA)], expensive[(op, DATA)] = 0, False
        elif op not in split and rows[op].op_type in PASS_THROUGH:
            cost[(op, WHOLE)], expensive[(op, WHOLE)] = 0, False
        giving = (op, DATA) if op in split else (op, WHOLE)
        successors[giving] = [
            part for t, _ in rows[op].grads if producer.get(t) is not None
            for part in units(producer[t])]
        successors[giving] = list(dict.fromkeys(successors[giving]))
        if not ys.isdisjoint(rows[op].outputs):
            # A y's incoming gradient is made by an op of its own (grad_ys), whose
            # end makes the y's parts ready as any op's does: a seed, left out.
            cost[(op, _SEED)], expensive[(op, _SEED)] = 0, False
            successors[(op, _SEED)] = units(op)
    runs = executor_order.simulate(successors, cost, expensive, threads)
    return [run.op for run in runs if run.op[1] != _SEED]


def one_thread_order(model) -> list:
    """`parts` as an executor with one inter-op thread runs them, the weight
    gradients of `model.deferred_weight_gradient_types` listed first (so they
    wait), the other ops' last (a MatMul's weight gradient runs at once; a
    BiasAdd's waits all the same, its data gradient being no kernel)."""
    return parts(model, 1, model.deferred_weight_gradient_types)
