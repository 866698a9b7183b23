"""Where a "memory" step's time goes: variants of one training step timed side by side.

    python -m benchmarks.step_time_parts [--model mlp256] [--rounds 9] [--out NAME]

In one process (run it once per threading; TF_NUM_INTEROP_THREADS=1 for one
inter-op thread), on one model and batch, each variant is a tf.function:

* `forward`: the loss only (the price of one forward pass, for scale);
* `tf.gradients`: stock gradients of the loss to the weights;
* `memory`: `gradients(checkpoints="memory")`;
* `memory, no gates`: the same rewrite with the level gates
  (`gradient_waits.gate`) off while tracing: a diagnostic of what the
  waiting costs (copies may then run early; memory is not its point);
* `memory, leaves unordered`: the same rewrite without `leaf_order`
  (chain steps not waiting for the leaf gradients made before them): what
  that order costs in time and saves in memory;
* `memory, copies wait directly`: the same with the copies that wait for
  the level's gradients given the control inputs themselves (as before
  `copying.waiting_through_input`), which keeps grappler's remapper from
  fusing them (MatMul + BiasAdd + Relu);
* `memory, every leaf waited`: the same with each chain op waiting for every
  leaf gradient made before it, also those whose inputs stay alive past it
  anyway (`leaf_order._alive_anyway` off);
* `memory, as before s22`: both of the last two off (the rewrite's order as
  before branch s22-mlp-time);
* `memory, stock copies`: the same with
  `transposed_copies.recomputes_scratch_free` off (plan and copies of
  transposed convolutions as the stock op, before the scratch-free copies;
  `benchmarks.transposed_copies` runs it beside tf.gradients and "memory");
* `memory, scratch unchained`: the same without `gradient_order.ScratchChain`
  (no order among convolution and pooling gradients at all);
* `memory, chained as before`: the same with those ops chained across layers
  even where the host's stock kernels take no scratch (as before session 24);
* `memory, tiled means`: the same without `broadcast_sinking` (the gradients
  of means and sums reach their input as full-size Tiles, as before session 25);
* `memory_within(10%)`: `checkpoints=memory_within(0.1)`, the least recompute
  within 10% of the "memory" plan's predicted peak.

The variants are called in turn for `rounds` rounds; medians of wall time
and of this process's CPU time (all threads) are reported as ratios to
tf.gradients. CPU time is less disturbed than wall time by other jobs on a
shared machine, though it counts spinning threads too. The allocator's peak
(median of 3, weight gradients subtracted) gives the activation memory
(for `forward`, the whole peak), beside the timeline's prediction for the
plan of the variant's trace (`predicted`; tf.gradients': its baseline) and
the FLOPs it recomputes as a fraction of a forward pass (`recompute`).
Results are appended to results/NAME.jsonl.
"""

import argparse
import contextlib
import json
import os
import statistics
import time
import types

from benchmarks.predicted_vs_measured import MODELS, RESULTS, loss_and_weights
from benchmarks.predicted_vs_measured import loss_and_weights_bytes

VARIANTS = ("tf.gradients", "forward", "memory", "memory, no gates", "memory, leaves unordered",
            "memory, copies wait directly", "memory, every leaf waited", "memory, as before s22",
            "memory, stock copies", "memory, scratch unchained", "memory, chained as before",
            "memory, tiled means", "memory_within(10%)")


@contextlib.contextmanager
def _switched_off(variant):
    """The variant's parts of the rewrite off while a step is traced (module docstring)."""
    from memory_saving_gradients.tfgraph import broadcast_sinking
    from memory_saving_gradients.tfgraph import copying
    from memory_saving_gradients.tfgraph import gradient_order
    from memory_saving_gradients.tfgraph import gradient_waits
    from memory_saving_gradients.tfgraph import leaf_order
    from memory_saving_gradients.tfgraph import transposed_copies
    copies_wait = (copying, "waiting_through_input", lambda graph, inputs, waits: (inputs, waits))
    every_leaf = (leaf_order, "_alive_anyway", lambda leaf, step, chain_position: False)
    switches = {
        "memory, no gates": [(gradient_waits, "gate", lambda gradients: None)],
        "memory, leaves unordered": [(leaf_order, "order_leaves", lambda *args: 0)],
        "memory, copies wait directly": [copies_wait],
        "memory, every leaf waited": [every_leaf],
        "memory, as before s22": [copies_wait, every_leaf],
        "memory, stock copies": [(transposed_copies, "recomputes_scratch_free", lambda op: False)],
        "memory, scratch unchained": [(gradient_order.ScratchChain, "extend", lambda *args: None)],
        # gradient_order's own view of the host only (conv_gradients' choice unchanged).
        "memory, chained as before": [(gradient_order, "workspace", types.SimpleNamespace(
            stock_kernels_take_scratch=lambda: True))],
        "memory, tiled means": [(broadcast_sinking, "sink", lambda new_ops, grads: (grads, new_ops))],
    }.get(variant, [])
    originals = [(module, name, getattr(module, name)) for module, name, _ in switches]
    for module, name, stand_in in switches:
        setattr(module, name, stand_in)
    try:
        yield
    finally:
        for module, name, original in originals:
            setattr(module, name, original)


def traced(model, inputs, labels, variant):
    """The variant's step, traced and called twice (warm-up), and the plan of
    its trace ("memory", or memory_within's; None for `forward`)."""
    import tensorflow as tf
    import memory_saving_gradients as msg
    plans = []
    checkpoints = msg.memory_within(0.1) if variant == "memory_within(10%)" else "memory"

    @tf.function
    def step(inputs, labels):
        loss, weights = loss_and_weights(model, inputs, labels)
        if variant == "forward":
            return [loss]
        plans.append(msg.checkpoint_plan(loss, weights, checkpoints))
        if variant == "tf.gradients":
            return [loss] + tf.gradients(loss, weights)
        return [loss] + msg.gradients(loss, weights, checkpoints=checkpoints)

    with _switched_off(variant):
        step.get_concrete_function(inputs, labels)
    step(inputs, labels), step(inputs, labels)
    return step, (plans[0] if plans else None)


def timed_rounds(steps, inputs, labels, rounds):
    """Per variant: ([wall seconds], [CPU seconds]), the variants called in turn."""
    found = {name: ([], []) for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            wall, cpu = time.perf_counter(), time.process_time()
            step(inputs, labels)[0].numpy()
            found[name][0].append(time.perf_counter() - wall)
            found[name][1].append(time.process_time() - cpu)
    return found


def measure(model_name, rounds, variants=VARIANTS):
    """One row per variant: medians, their ratios to tf.gradients (the first), activation
    bytes measured and predicted."""
    import tensorflow as tf
    build, data = MODELS[model_name]
    model = build()
    inputs, labels = (tf.constant(a) for a in data())
    traces = {v: traced(model, inputs, labels, v) for v in variants}
    steps = {v: step for v, (step, _) in traces.items()}
    times = timed_rounds(steps, inputs, labels, rounds)
    rows = []
    for name, (wall, cpu) in times.items():
        rows.append({"model": model_name, "variant": name, "rounds": rounds,
                     "threads": os.environ.get("TF_NUM_INTEROP_THREADS", "default"),
                     "wall_s": statistics.median(wall), "cpu_s": statistics.median(cpu),
                     **_memory(steps[name], traces[name][1], name, inputs, labels),
                     "wall_all": wall, "cpu_all": cpu})
    base = rows[0]
    for row in rows:
        for key in ("wall_s", "cpu_s", "activation_bytes"):
            row[key.split("_")[0] + "_ratio"] = round(row[key] / base[key], 3)
    return rows


def _memory(step, plan, variant, inputs, labels):
    """The step's activation bytes (median of 3 peaks less the weight gradients it
    returns; `forward`: the whole peak), the plan's prediction and recompute."""
    import memory_saving_gradients as msg
    peaks = [msg.function_peak_bytes(step, inputs, labels)[0] for _ in range(3)]
    if plan is None:
        return {"activation_bytes": int(statistics.median(peaks))}
    estimate = plan.estimate
    stock = variant == "tf.gradients"
    return {"activation_bytes": int(statistics.median(peaks)) - loss_and_weights_bytes(plan),
            "predicted": estimate.baseline_bytes if stock else estimate.peak_bytes,
            "recompute": 0.0 if stock else estimate.recompute_flops / max(estimate.forward_flops, 1)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp256", choices=sorted(MODELS))
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--out", default="step_time_parts")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS,
                        help="tf.gradients first (the ratios' base)")
    args = parser.parse_args(argv)
    import memory_saving_gradients as msg
    msg.measure.enable_cpu_allocator_stats()
    RESULTS.mkdir(exist_ok=True)
    with (RESULTS / f"{args.out}.jsonl").open("a") as out:
        for row in measure(args.model, args.rounds, args.variants):
            out.write(json.dumps(row) + "\n")
            predicted = (f", predicted {row['predicted'] / 2**20:.1f} MiB"
                         if "predicted" in row else "")
            print(f"{row['threads']:>7} {row['variant']:24} wall {row['wall_s']:.3f} s "
                  f"({row['wall_ratio']:.2f}x)  cpu {row['cpu_s']:.3f} s ({row['cpu_ratio']:.2f}x)  "
                  f"activations {row['activation_bytes'] / 2**20:.1f} MiB "
                  f"({row['activation_ratio']:.3f}){predicted}", flush=True)


if __name__ == "__main__":
    main()
