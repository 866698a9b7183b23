"""How long planning takes on a 1,000-block residual network (10,000+ ops).

Two parts, each block x -> 8 elementwise ops -> a matmul -> x + f(x):

* core: the network built directly as the planner's model (core GraphModel,
  1 MiB per tensor). Times the 'memory' and 'speed' strategies, memory_within(0.1)
  and budgets of 30/50/70% of tf.gradients' activation memory, each end to end (cut problem,
  solver, plan, prediction).
* tf (--tf): the same network traced as a TensorFlow graph (width 16, a
  tf.Variable per block): reading the graph into the planner's model
  (`tfgraph/reading.py`), then 'memory', memory_within(0.1) and a budget of half of tf.gradients'
  predicted memory on that model.

Each strategy runs on a fresh copy of the model, so nothing one strategy
worked out (the planner's per-model tables) serves another. Times are the
median of --reps runs, as process CPU time and wall time (the machine is
shared: wall time is the CPU time plus waiting for a core).

Run: python -m benchmarks.solver_speed [--blocks N] [--tf] [--reps 3] [--profile PATH]
"""

import argparse
import cProfile
import dataclasses
import io
import pstats
import statistics
import time

import networkx as nx

from memory_saving_gradients.core import budgets
from memory_saving_gradients.core import pricing
from memory_saving_gradients.core import strategies
from memory_saving_gradients.core.model import Activation
from memory_saving_gradients.core.model import GraphModel

MIB = 2**20
INNER = 8  # elementwise ops per block before its matmul


def residual_model(blocks, inner=INNER):
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


class Clock:
    """Median process CPU and wall seconds of repeated calls, optionally profiled."""

    def __init__(self, reps, profiler=None):
        self.reps, self.profiler = reps, profiler

    def time(self, fn):
        """(last result, median CPU s, median wall s) of `reps` calls of fn()."""
        cpu, wall = [], []
        for _ in range(self.reps):
            c, w = time.process_time(), time.perf_counter()
            if self.profiler:
                self.profiler.enable()
            result = fn()
            if self.profiler:
                self.profiler.disable()
            cpu.append(time.process_time() - c)
            wall.append(time.perf_counter() - w)
        return result, statistics.median(cpu), statistics.median(wall)


def fresh(model):
    """A new GraphModel object with the same contents: the planner's per-model
    caches (keyed by the object) start empty for it."""
    return dataclasses.replace(model)


def timed(label, clock, strategy, model):
    result, cpu, wall = clock.time(lambda: strategies.run(fresh(model), strategy))
    est = result.estimate
    print(f"{label:14s} CPU {cpu:5.2f} s  wall {wall:5.2f} s  peak "
          f"{est.peak_bytes / MIB:8.1f} MiB ({est.memory_ratio:.3f} of tf.gradients)  "
          f"recompute {est.recompute_flops / est.forward_flops:.3f} of a forward pass", flush=True)


def core_part(blocks, clock):
    model = residual_model(blocks)
    print(f"core: {len(model.order)} ops, tf.gradients keeps "
          f"{model.bytes_of(model.order) / MIB:.0f} MiB of activations")
    timed("memory", clock, "memory", model)
    timed("speed", clock, "speed", model)
    timed("within 10%", clock, budgets.memory_within(0.1), model)
    baseline = model.bytes_of(model.order)
    for share in (0.3, 0.5, 0.7):
        timed(f"budget {share:.0%}", clock, budgets.budget(share * baseline), model)


def tf_part(blocks, clock, width=16):
    """Reading the traced network, then planning on what was read."""
    import numpy as np
    import tensorflow as tf

    from memory_saving_gradients import api
    from memory_saving_gradients import arguments
    from memory_saving_gradients.tfgraph import reading

    weights = [tf.Variable(np.eye(width, dtype=np.float32) / 2, name=f"w{k}")
               for k in range(blocks)]

    @tf.function(autograph=False)
    def step(x):
        h = x
        for w in weights:
            f = h
            for _ in range(INNER):
                f = tf.tanh(f)
            h = h + tf.matmul(f, w)
        loss = tf.reduce_sum(h * h)
        ys, xs, _ = arguments.normalise(loss, weights, None)
        sources = api._sources(ys[0].graph, xs)[2]  # pylint: disable=protected-access
        # The first read also finds the graph's data tensors (cached per graph).
        for label, reps in (("read (first)", 1), ("read (again)", clock.reps)):
            read, cpu, wall = Clock(reps, clock.profiler).time(
                lambda: reading.build_model(ys, sources))
            print(f"{label:14s} CPU {cpu:5.2f} s  wall {wall:5.2f} s", flush=True)
        model = read.model
        print(f"tf: {model.num_region_ops} ops, {len(model.order)} activations")
        timed("memory", clock, "memory", model)
        timed("within 10%", clock, budgets.memory_within(0.1), model)
        baseline = pricing.predict(fresh(model), None).baseline_bytes
        timed("budget 50%", clock, budgets.budget(0.5 * baseline), model)
        return loss

    step.get_concrete_function(tf.TensorSpec((8, width), tf.float32))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=1000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tf", action="store_true", help="also read and plan a TF graph")
    parser.add_argument("--profile", help="write a cProfile of every timed call here")
    args = parser.parse_args()
    clock = Clock(args.reps, cProfile.Profile() if args.profile else None)
    core_part(args.blocks, clock)
    if args.tf:
        tf_part(args.blocks, clock)
    if args.profile:
        out = io.StringIO()
        stats = pstats.Stats(clock.profiler, stream=out).strip_dirs()
        stats.sort_stats("cumulative").print_stats(40)
        stats.sort_stats("tottime").print_stats(25)
        with open(args.profile, "w") as f:
            f.write(out.getvalue())


if __name__ == "__main__":
    main()
