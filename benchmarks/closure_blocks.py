"""`@recompute_grad` blocks that read a tensor the model sets on them, trained by `fit`.

    python -m benchmarks.closure_blocks [--layers 8] [--seq 128] [--batch 8]
        [--threads 0,1] [--out benchmarks/results/closure_blocks.md]

A subclassed decoder whose blocks get the encoder's output (the memory they
cross-attend to) and the attention bias (from the batch's padding) from an
attribute the model sets before calling them, not as arguments: how such
tensors often reach the blocks of a hand-written model. Both are closures
of each block's call; the memory carries a gradient to the encoder's
weights. Since session 61 closures cross the gradient boundary as inputs
and every block is a recomputed segment; before, a block reading a closure
that carries a gradient was built plainly (recomputing nothing).

Each threading runs in a fresh process with RECOMPUTE=1: the decorated
decoder beside a stock twin (undecorated blocks) from the same seeds. One
fit step of each traces; two more warm up; then --steps steps of each,
alternating which goes first, give the median allocator peak above the
memory held before the step and the median wall time. Activation memory is
that peak minus the weight-gradient bytes. The weights after all steps are
compared with the twin's: their largest difference over the largest change
the steps made to a weight.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

HIDDEN, HEADS, FFN, VOCAB = 128, 4, 512, 1000


def build(layers: int, seq: int, recomputed: bool):
    """The decoder (blocks decorated when `recomputed`), compiled for fit."""
    import keras
    import tensorflow as tf

    from memory_saving_gradients.keras import recompute_grad

    class Block(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.context = {}  # the model puts the memory and attention bias here
            self.attention = keras.layers.MultiHeadAttention(HEADS, HIDDEN // HEADS)
            self.cross = keras.layers.MultiHeadAttention(HEADS, HIDDEN // HEADS)
            self.norm1 = keras.layers.LayerNormalization()
            self.norm2 = keras.layers.LayerNormalization()
            self.up = keras.layers.Dense(FFN, activation="gelu")
            self.down = keras.layers.Dense(HIDDEN)

        def call(self, h):
            bias = self.context["bias"]  # (batch, 1, seq): 0 or -1e9 per key
            scores = tf.einsum("bqd,bkd->bqk", h, h) / HIDDEN ** 0.5 + bias
            h = self.norm1(h + self.attention(h, h) + tf.einsum(
                "bqk,bkd->bqd", tf.nn.softmax(scores), h))
            h = h + self.cross(h, self.context["memory"])
            return self.norm2(h + self.down(self.up(h)))

    class RecomputedBlock(Block):
        @recompute_grad
        def call(self, h):
            return super().call(h)

    class Decoder(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.tokens = keras.layers.Embedding(VOCAB, HIDDEN)
            self.encoder = keras.layers.Dense(HIDDEN, activation="tanh")
            self.blocks = [(RecomputedBlock if recomputed else Block)() for _ in range(layers)]
            self.head = keras.layers.Dense(VOCAB)

        def call(self, ids):
            padding = tf.cast(tf.equal(ids, 0), tf.float32)[:, tf.newaxis, :]
            h = self.tokens(ids)
            memory = self.encoder(h)
            for block in self.blocks:
                block.context["bias"], block.context["memory"] = padding * -1e9, memory
                h = block(h)
            return self.head(h)

    keras.utils.set_random_seed(0)
    model = Decoder()
    model.compile(optimizer=keras.optimizers.SGD(1e-3), jit_compile=False,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model(np.zeros((1, seq), np.int32))
    return model


def data(batch: int, seq: int):
    rng = np.random.default_rng(0)
    ids = rng.integers(1, VOCAB, size=(batch, seq)).astype(np.int32)
    ids[:, seq * 3 // 4:] = 0  # a padded last quarter
    return ids, rng.integers(0, VOCAB, size=(batch, seq)).astype(np.int32)


def measure(job: dict) -> dict:
    """The decorated decoder beside its stock twin, in this process."""
    import tensorflow as tf
    if job["threads"]:
        tf.config.threading.set_inter_op_parallelism_threads(job["threads"])
    import memory_saving_gradients as msg
    msg.enable_cpu_allocator_stats()
    models = {"ours": build(job["layers"], job["seq"], True),
              "stock": build(job["layers"], job["seq"], False)}
    x, y = data(job["batch"], job["seq"])

    def fit_step(model):
        model.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0)

    initial = [w.numpy() for w in models["stock"].weights]
    for _ in range(3):  # trace, then warm up
        for model in models.values():
            fit_step(model)
    measured = {name: [] for name in models}
    order = list(models)
    for _ in range(job["steps"]):
        for name in order:
            start = time.perf_counter()
            peak, _ = msg.function_peak_bytes(fit_step, models[name])
            measured[name].append((peak, time.perf_counter() - start))
        order.reverse()
    grad_bytes = sum(int(np.prod(w.shape)) * 4 for w in models["stock"].trainable_weights)
    row = dict(job)
    for name, runs in measured.items():
        row[f"{name}_activation_bytes"] = int(statistics.median(p for p, _ in runs)) - grad_bytes
        row[f"{name}_step_s"] = statistics.median(t for _, t in runs)
    # The largest difference of the two models' weights over the largest
    # change the steps made to any stock weight.
    pairs = list(zip(models["ours"].weights, models["stock"].weights, initial))
    row["weights_rel_diff"] = (max(float(np.abs(a.numpy() - b.numpy()).max()) for a, b, _ in pairs)
                               / max(float(np.abs(b.numpy() - w).max()) for _, b, w in pairs))
    return row


def run_child(job: dict) -> dict:
    env = dict(os.environ, RECOMPUTE="1", TF_CPP_MIN_LOG_LEVEL="2")
    out = subprocess.run([sys.executable, "-m", "benchmarks.closure_blocks", "--worker",
                          json.dumps(job)], env=env, capture_output=True, text=True,
                         check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not lines:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", default="0,1", help="inter-op threads; 0 is the default")
    parser.add_argument("--out", default=os.path.join("benchmarks", "results",
                                                      "closure_blocks.md"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(json.loads(args.worker))))
        return
    rows = ["| inter-op threads | stock activation MiB | @recompute_grad MiB | ratio | "
            "step time ratio | weights' difference / change |", "| --- | --- | --- | --- | --- | --- |"]
    for threads in (int(t) for t in args.threads.split(",")):
        row = run_child(dict(threads=threads, layers=args.layers, seq=args.seq,
                             batch=args.batch, steps=args.steps))
        stock, ours = row["stock_activation_bytes"], row["ours_activation_bytes"]
        rows.append(f"| {threads or 'default'} | {stock / 2**20:.1f} | {ours / 2**20:.1f} | "
                    f"{ours / stock:.2f} | {row['ours_step_s'] / row['stock_step_s']:.2f} | "
                    f"{row['weights_rel_diff']:.1e} |")
    table = "\n".join(rows)
    print(table)
    with open(args.out, "w", encoding="utf-8") as out:
        out.write(f"# {__doc__.splitlines()[0]}\n\n`python -m benchmarks.closure_blocks "
                  f"--layers {args.layers} --seq {args.seq} --batch {args.batch} --steps "
                  f"{args.steps} --threads {args.threads}`\n\n{table}\n")


if __name__ == "__main__":
    main()
