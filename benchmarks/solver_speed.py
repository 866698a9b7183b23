"""How long planning takes on a 1,000-block residual network (10,000+ ops), without TensorFlow graphs.

The network is built directly as the planner's model (core GraphModel): each
block is x -> 8 elementwise ops -> a matmul -> x + f(x), 1 MiB per tensor.
Times the 'memory' and 'speed' strategies and budgets of 30/50/70% of
tf.gradients' activation memory, each end to end (cut problem, solver,
plan, prediction). Run: python -m benchmarks.solver_speed [--blocks N]
"""

import argparse
import time

import networkx as nx

from memory_saving_gradients.core import budgets
from memory_saving_gradients.core import strategies
from memory_saving_gradients.core.model import Activation
from memory_saving_gradients.core.model import GraphModel

MIB = 2**20


def residual_model(blocks, inner=8):
    """GraphModel of x_{k+1} = x_k + matmul(f_k(x_k)), f_k a chain of `inner` ops."""
    graph = nx.DiGraph()
    order, tensors = [], {}

    def add(name, op_type, reads, cost=MIB // 4):
        graph.add_node(name)
        tensors[name] = Activation(name=name, op=name, op_type=op_type, bytes=MIB, cost=cost,
                                   recomputable=True, is_float=True)
        graph.add_edges_from((r, name) for r in reads)
        order.append(name)

    add("x0", "Relu", [])
    for k in range(blocks):
        prev = f"x{k}"
        for i in range(inner):
            add(f"b{k}/op{i}", "Tanh", [prev])
            prev = f"b{k}/op{i}"
        add(f"b{k}/mm", "MatMul", [prev], cost=MIB * 64)
        add(f"x{k + 1}", "AddV2", [f"x{k}", f"b{k}/mm"])
    return GraphModel(graph=graph, tensors=tensors, order=tuple(order), pinned=frozenset(),
                      ys=(order[-1],), op_outputs={n: (n,) for n in order},
                      num_region_ops=len(order))


def timed(label, strategy, model):
    start = time.perf_counter()
    result = strategies.run(model, strategy)
    seconds = time.perf_counter() - start
    est = result.estimate
    print(f"{label:12s} {seconds:6.2f} s  peak {est.peak_bytes / MIB:8.0f} MiB "
          f"({est.memory_ratio:.3f} of tf.gradients)  recompute "
          f"{est.recompute_flops / est.forward_flops:.3f} of a forward pass")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=1000)
    args = parser.parse_args()
    model = residual_model(args.blocks)
    print(f"{len(model.order)} ops, tf.gradients keeps "
          f"{model.bytes_of(model.order) / MIB:.0f} MiB of activations")
    timed("memory", "memory", model)
    timed("speed", "speed", model)
    baseline = model.bytes_of(model.order)
    for share in (0.3, 0.5, 0.7):
        timed(f"budget {share:.0%}", budgets.budget(share * baseline), model)


if __name__ == "__main__":
    main()
