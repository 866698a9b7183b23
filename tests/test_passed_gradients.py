"""Gradients passed on (`GraphModel.passed_grads`) by an op with several outputs.

A tf.custom_gradient's IdentityN that passes each output's gradient to its
own input (`grad = lambda ga, gb: (ga, gb)`), one output read outside the
loss: tf.gradients gives that output a zeros_like seed, and the custom
gradient returns it as its input's gradient, a buffer of that input's size
(TF 2.21: `gradients/zeros_like` reads IdentityN:0 and feeds the gradient of
the input behind it). Found by a review: the probe recorded which inputs get
*an* output's gradient, and the timeline aliased both inputs' gradients to
the one piece that came in; each input is now aliased to its own output's.
"""

import networkx as nx

from memory_saving_gradients.core import planning
from memory_saving_gradients.core import timeline
from memory_saving_gradients.core.model import Activation
from memory_saving_gradients.core.model import GraphModel

B = 100


def _pair_model(passed):
    """t0 -> a (8 B), b; pair(a, b) -> u (a's buffer), v (b's); u read by `side`
    only, outside the loss; y = f(v). No gradient reads anything."""
    ops = {"t0": ((), ("t0",)), "a": (("t0",), ("a",)), "b": (("t0",), ("b",)),
           "pair": (("a", "b"), ("u", "v")), "side": (("u",), ("s",)), "y": (("v",), ("y",))}
    size = {"a": 8 * B, "u": 8 * B}
    graph, tensors, op_outputs = nx.DiGraph(), {}, {}
    for op, (inputs, outputs) in ops.items():
        op_outputs[op] = outputs
        for o in outputs:
            graph.add_node(o)
            graph.add_edges_from((i, o) for i in inputs)
            tensors[o] = Activation(name=o, op=op, op_type="IdentityN" if op == "pair" else "Op",
                                    bytes=size.get(o, B), cost=1, recomputable=True,
                                    is_float=True)
    return GraphModel(graph=graph, tensors=tensors, order=tuple(tensors), pinned=frozenset(),
                      ys=("y",), op_outputs=op_outputs, num_region_ops=len(ops),
                      grad_reads={op: () for op in ops}, shared_buffers={"u": "a", "v": "b"},
                      passed_grads={"pair": passed})


def test_an_input_whose_output_got_no_gradient_takes_its_own_buffer():
    # Only v's gradient comes in: b's gradient is it, a's is TensorFlow's zeros (8 B),
    # alive with v's gradient until a's op differentiates it: 11 B in backprop
    # (y, v's gradient, a's zeros, t0's first piece), over the forward pass' 10 B.
    only_b = _pair_model((("b", "v"),))
    both = _pair_model((("a", "u"), ("b", "v")))  # what the probe records
    assert timeline.predict(only_b).peak_bytes == 11 * B
    assert timeline.predict(both).peak_bytes == 11 * B
    plan = planning.make_plan(both, {"b"}, "list")
    assert timeline.step_peaks(both, plan)[1] == timeline.step_peaks(only_b, plan)[1]
