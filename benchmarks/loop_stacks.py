"""What loops keep for their gradient: the simulator's prediction beside the allocator's peak.

    python -m benchmarks.loop_stacks [--cases scan,GRU] [--threads default,1] [--calls 3]
                                     [--out loop_stacks]

Each case is one recurrence over T=64 steps (batch 32, 256 units, 64 input
features; the nested case 8 outer x 16 inner steps, batch 256, 64 units):
the tanh loop also with its cell a called tf.function ("called"), with a
tf.cond between it and a sigmoid cell ("cond"), without
`maximum_iterations` ("unbounded"), with one read from a variable when the
step runs ("run_time_bound"), and without one, its condition comparing with
such a read ("run_time_count"), and Keras's GRU and LSTM also in a
Bidirectional layer ("bidirectional_GRU", "bidirectional_LSTM"),
differentiated by tf.gradients and by checkpoints='memory' in one
tf.function step. For each, in a fresh subprocess: the activation memory
(allocator peak of the step, median of `--calls` calls after 2 warm-ups,
with their least and largest, minus the weight gradients it returns) beside
`checkpoint_plan`'s prediction from the same trace (`baseline_bytes` for
tf.gradients, `peak_bytes` for the plan), in bytes requested (the profiler's
allocator events) and in the chunks TensorFlow's BFC allocator counts (its
statistics; the prediction's `allocator_*` fields). Results go to results/<out>.{jsonl,md}.
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys

RESULTS = pathlib.Path(__file__).parent / "results"
STEPS, BATCH, FEATURES, UNITS = 64, 32, 64, 256
CASES = ("while_tanh", "called", "cond", "unbounded", "run_time_bound", "run_time_count",
         "scan", "SimpleRNN", "GRU", "LSTM", "bidirectional_GRU", "bidirectional_LSTM",
         "nested")
METHODS = ("tf.gradients", "memory")


def case(name):
    """(loss of the inputs, weights, inputs) of case `name`."""
    import numpy as np
    import tensorflow as tf
    rng = np.random.default_rng(0)
    wh = tf.Variable(rng.normal(size=(UNITS, UNITS)).astype(np.float32) * 0.05)
    wx = tf.Variable(rng.normal(size=(FEATURES, UNITS)).astype(np.float32) * 0.05)
    xs = tf.constant(rng.normal(size=(STEPS, BATCH, FEATURES)).astype(np.float32))
    cell = lambda h, x: tf.tanh(h @ wh + x @ wx)  # noqa: E731
    steps = {  # h_t = step(i, h, x_t), the final h only
        "while_tanh": lambda i, h, x: cell(h, x),
        "called": lambda i, h, x: tf.function(cell)(h, x),
        "cond": lambda i, h, x: tf.cond(i % 2 == 0, lambda: cell(h, x),
                                        lambda: tf.sigmoid(h @ wh + x @ wx)),
        "unbounded": lambda i, h, x: cell(h, x),
        "run_time_bound": lambda i, h, x: cell(h, x),
        "run_time_count": lambda i, h, x: cell(h, x),
    }
    length = tf.Variable(STEPS)
    if name in steps:
        def loss(xs):
            items = tf.TensorArray(tf.float32, STEPS).unstack(xs)
            bound, limit = {"unbounded": (None, STEPS),
                            "run_time_bound": (length.read_value(), STEPS),
                            "run_time_count": (None, length.read_value())}.get(
                                name, (STEPS, STEPS))
            _, h = tf.while_loop(lambda i, h: i < limit,
                                 lambda i, h: (i + 1, steps[name](i, h, items.read(i))),
                                 [0, tf.zeros([BATCH, UNITS])], maximum_iterations=bound)
            return tf.reduce_sum(h * h)
        return loss, [wh, wx], xs
    if name == "scan":  # the same cell, every h_t an output
        def loss(xs):
            hs = tf.scan(cell, xs, initializer=tf.zeros([BATCH, UNITS]))
            return tf.reduce_sum(hs * hs)
        return loss, [wh, wx], xs
    if name == "nested":
        return nested_case()
    direction, kind = name.split("_") if "_" in name else (None, name)
    layer = getattr(tf.keras.layers, kind)(UNITS, return_sequences=True)
    if direction == "bidirectional":
        layer = tf.keras.layers.Bidirectional(layer)
    layer.build((BATCH, STEPS, FEATURES))

    def loss(xs):
        hs = layer(tf.transpose(xs, [1, 0, 2]))
        return tf.reduce_sum(hs * hs)
    return loss, layer.trainable_weights, xs


def nested_case(outer=8, inner=16, batch=256, units=64, inner_bounded=True):
    """A loop of `outer` steps h <- 0.9 * (a loop of `inner` steps h <- tanh(h @ w));
    the inner loop without `maximum_iterations` unless `inner_bounded`."""
    import numpy as np
    import tensorflow as tf
    w = tf.Variable(np.eye(units, dtype=np.float32) * 0.5)

    def inner_loop(h):
        return tf.while_loop(lambda j, h: j < inner, lambda j, h: (j + 1, tf.tanh(h @ w)),
                             [0, h], maximum_iterations=inner if inner_bounded else None)[1]

    def loss(h):
        _, h = tf.while_loop(lambda i, h: i < outer, lambda i, h: (i + 1, inner_loop(h) * 0.9),
                             [0, h], maximum_iterations=outer)
        return tf.reduce_sum(h * h)
    h0 = tf.constant(np.random.default_rng(1).normal(size=(batch, units)).astype(np.float32))
    return loss, [w], h0


def measure(name, method, threads, calls):
    """One row: predicted and measured activation bytes of `method` on case
    `name`, with TensorFlow's default threading or `threads` inter-op threads."""
    import numpy as np
    import tensorflow as tf
    if threads != "default":
        tf.config.threading.set_inter_op_parallelism_threads(int(threads))
    import memory_saving_gradients as msg
    from memory_saving_gradients.tfgraph import profiled_allocations
    loss_of, weights, inputs = case(name)
    found = {}

    @tf.function
    def step(inputs):
        loss = loss_of(inputs)
        found.setdefault("plan", msg.checkpoint_plan(loss, weights, "memory"))
        if method == "tf.gradients":
            return tf.gradients(loss, weights)
        return msg.gradients(loss, weights, checkpoints=method)

    step(inputs)
    step(inputs)
    outputs = sum(int(np.prod(w.shape)) * tf.as_dtype(w.dtype).size for w in weights)
    calls = int(calls)  # a string from the --job command line
    chunks = statistics.median(msg.function_peak_bytes(step, inputs)[0] for _ in range(calls))
    requested = [profiled_allocations.requested_peak(
        profiled_allocations.allocator_events(lambda: step(inputs))) - outputs
        for _ in range(calls)]
    est = found["plan"].estimate
    stock = method == "tf.gradients"
    return {"case": name, "method": method, "threads": threads,
            "predicted": int(est.baseline_bytes if stock else est.peak_bytes),
            "measured": int(statistics.median(requested)),
            "measured_least": min(requested), "measured_largest": max(requested),
            "predicted_allocator": int(est.allocator_baseline_bytes if stock
                                       else est.allocator_peak_bytes),
            "measured_allocator": int(chunks) - outputs}


def run_job(name, method, threads, calls):
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="1", TF_CPP_MIN_LOG_LEVEL="2")
    done = subprocess.run([sys.executable, "-m", "benchmarks.loop_stacks", "--job", name,
                           method, threads, str(calls)], env=env, capture_output=True, text=True,
                          timeout=600, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(rows):
    lines = ["| case | method | inter-op threads | bytes requested: predicted / measured MiB "
             "(ratio) | measured calls: least-largest MiB "
             "| allocator chunks: predicted / measured MiB (ratio) |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        cells = [f"{p / 2**20:.2f} / {m / 2**20:.2f} ({p / max(m, 1):.2f})"
                 for p, m in [(row[f"predicted{kind}"], row[f"measured{kind}"])
                              for kind in ("", "_allocator")]]
        spread = f"{row['measured_least'] / 2**20:.2f}-{row['measured_largest'] / 2**20:.2f}"
        lines.append(f"| {row['case']} | {row['method']} | {row['threads']} | "
                     + " | ".join([cells[0], spread, cells[1]]) + " |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--threads", default="default",
                        help="comma-separated: 'default' and/or inter-op thread counts")
    parser.add_argument("--calls", type=int, default=3,
                        help="measured calls per row (after 2 warm-ups)")
    parser.add_argument("--out", default="loop_stacks")
    parser.add_argument("--job", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        print(json.dumps(measure(*args.job)))
        return
    rows = [run_job(name, method, threads, args.calls) for name in args.cases.split(",")
            for method in METHODS for threads in args.threads.split(",")]
    with open(RESULTS / f"{args.out}.jsonl", "w") as out:
        out.writelines(json.dumps(row) + "\n" for row in rows)
    (RESULTS / f"{args.out}.md").write_text(table(rows))
    print(table(rows))


if __name__ == "__main__":
    main()
