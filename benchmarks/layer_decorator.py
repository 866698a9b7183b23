"""@recompute_grad on every block of a BERT-like encoder, trained by `model.fit`.

    python -m benchmarks.layer_decorator [--layers 12] [--seq 128] [--batch 8]
        [--cap-mb 256] [--out benchmarks/results/layer_decorator]

Compares, on the same encoder blocks (a Keras layer whose call takes
`training=`): stock (no recomputation), ours (`@recompute_grad` on the block's
call, switched on by RECOMPUTE=1), `keras.RematScope(list_of_layers)` naming
the blocks, and `tf.recompute_grad` wrapped around the block's body (with
`training` closed over, as it accepts no keywords). Each method runs in a
fresh subprocess (`--worker`), which also builds a stock twin from the same
seeds: one `fit` step of each, updates compared (`update_rel_err`); then
two warm-up steps each, steps of the two alternate (ABBA order), each one `fit` call on
one batch, timed and its
allocator peak taken (peak above the memory in use at its start), medians
kept; then one profiled step each for the peak of bytes requested. Activation
memory is peak minus the weight-gradient bytes. A second
subprocess per method searches the largest batch whose `fit` step peaks under
the cap (benchmarks.search.max_batch). With --accumulation-steps N, ours runs
once more with Keras gradient accumulation (SGD, gradient_accumulation_steps=N):
the step peak at the same micro-batch, and the largest micro-batch (the
effective batch is N times it); the weights check then compares a
non-update step (zero update) and is not meaningful.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

import numpy as np

METHODS = ("stock", "ours(@recompute_grad)", "keras.RematScope(list_of_layers)",
           "tf.recompute_grad")
LEARNING_RATE = 1e-3


def build(method, layers, seq, accumulation_steps=None, hidden=128, heads=4, ffn=512,
          vocab=1000, dropout=0.1):
    """The encoder for `method`, compiled for fit (SGD, no XLA), fixed seeds."""
    import contextlib

    import keras
    import tensorflow as tf

    from memory_saving_gradients.keras import recompute_grad

    class EncoderBlock(keras.layers.Layer):
        """Post-LN transformer block: attention, GELU FFN, dropout, layer norm."""

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.attention = keras.layers.MultiHeadAttention(heads, hidden // heads,
                                                             dropout=dropout)
            self.drop1, self.drop2 = keras.layers.Dropout(dropout), keras.layers.Dropout(dropout)
            self.norm1, self.norm2 = (keras.layers.LayerNormalization(),
                                      keras.layers.LayerNormalization())
            self.up = keras.layers.Dense(ffn, activation="gelu")
            self.down = keras.layers.Dense(hidden)

        def build(self, input_shape):
            self.attention.build(input_shape, input_shape)
            self.norm1.build(input_shape)
            self.up.build(input_shape)
            self.down.build(input_shape[:-1] + (ffn,))
            self.norm2.build(input_shape)

        def call(self, h, training=None):
            a = self.attention(h, h, training=training)
            h = self.norm1(h + self.drop1(a, training=training))
            return self.norm2(h + self.drop2(self.down(self.up(h)), training=training))

    class OursBlock(EncoderBlock):
        @recompute_grad
        def call(self, h, training=None):
            return super().call(h, training=training)

    class TfRecomputeBlock(EncoderBlock):
        def call(self, h, training=None):
            body = lambda x: EncoderBlock.call(self, x, training=training)  # noqa: E731
            return tf.recompute_grad(body)(h)

    block = {"ours(@recompute_grad)": OursBlock,
             "tf.recompute_grad": TfRecomputeBlock}.get(method, EncoderBlock)
    names = [f"block{i}" for i in range(layers)]
    scope = (keras.RematScope(mode="list_of_layers", layer_names=names)
             if method.startswith("keras.RematScope") else contextlib.nullcontext())
    keras.utils.set_random_seed(0)
    with scope:
        ids = keras.Input((seq,), dtype="int32")
        h = keras.layers.Embedding(vocab, hidden)(ids)
        h = h + keras.layers.Embedding(seq, hidden)(tf.range(seq))[tf.newaxis]
        h = keras.layers.Dropout(dropout)(keras.layers.LayerNormalization()(h))
        for name in names:
            h = block(name=name)(h)
        model = keras.Model(ids, keras.layers.Dense(vocab)(h))
    optimizer = keras.optimizers.SGD(LEARNING_RATE,
                                     gradient_accumulation_steps=accumulation_steps)
    model.compile(optimizer=optimizer, jit_compile=False,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def data(batch, seq, vocab=1000):
    rng = np.random.default_rng(0)
    return (rng.integers(0, vocab, size=(batch, seq)).astype(np.int32),
            rng.integers(0, vocab, size=(batch, seq)).astype(np.int32))


def fit_step(model, x, y):
    model.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0)


def timed_peak(model, x, y):
    """(wall seconds, peak bytes above the start, CPU seconds) of one fit step.

    CPU time (of every thread of this process) is less disturbed than wall
    time by other processes on a shared machine.
    """
    import memory_saving_gradients as msg
    start, start_cpu = time.perf_counter(), time.process_time()
    peak, _ = msg.function_peak_bytes(fit_step, model, x, y)
    return time.perf_counter() - start, int(peak), time.process_time() - start_cpu


def update_rel_err(model, twin, initial):
    """Max over weights of |update - twin's update| / |twin's update| (2-norms),
    the denominator at least 1e-3 of the largest update norm."""
    ours = [w.numpy() - w0 for w, w0 in zip(model.weights, initial)]
    theirs = [w.numpy() - w0 for w, w0 in zip(twin.weights, initial)]
    norms = [float(np.linalg.norm(t)) for t in theirs]
    floor = 1e-3 * max(norms + [1e-30])
    return max(float(np.linalg.norm(o - t)) / max(n, floor)
               for o, t, n in zip(ours, theirs, norms))


def measure(job):
    """One method beside its stock twin: correctness, peak and time per fit step."""
    from benchmarks.live_set_diff import allocator_events
    from benchmarks.live_set_diff import requested_peak
    row = dict(job, status="ok")
    model = build(job["method"], job["layers"], job["seq"], job.get("accumulation_steps"))
    x, y = data(job["batch"], job["seq"])
    initial = [w.numpy() for w in model.weights]
    fit_step(model, x, y)  # trace + first update
    twin = build("stock", job["layers"], job["seq"])
    fit_step(twin, x, y)
    # One update from the same weights, batch and dropout seeds: must agree.
    row["update_rel_err"] = update_rel_err(model, twin, initial)
    for _ in range(2):  # warm-up: a step after another function's is slower
        fit_step(model, x, y)
        fit_step(twin, x, y)
    grad_bytes = sum(int(np.prod(w.shape)) * 4 for w in model.trainable_weights)
    calls = {"step": [], "twin": []}
    pair = [("step", model), ("twin", twin)]
    for _ in range(job["steps"]):
        for name, fitted in pair:
            calls[name].append(timed_peak(fitted, x, y))
        pair.reverse()  # ABBA order: neither always runs first
    for name, prefix in (("step", ""), ("twin", "twin_")):
        times, peaks, cpu_times = zip(*calls[name])
        row[f"{prefix}step_s"] = statistics.median(times)
        row[f"{prefix}step_cpu_s"] = statistics.median(cpu_times)
        row[f"{prefix}peak_bytes"] = int(statistics.median(peaks))
        row[f"{prefix}activation_bytes"] = row[f"{prefix}peak_bytes"] - grad_bytes
    # Bytes requested (one profiled step each): independent of the chunks BFC
    # hands out, which moved the allocator's ratio by up to 0.05 between processes.
    for name, fitted in pair:
        prefix = "" if name == "step" else "twin_"
        events = allocator_events(lambda a, b, m=fitted: fit_step(m, a, b), x, y)
        row[f"{prefix}requested_activation_bytes"] = requested_peak(events) - grad_bytes
    row["requested_activation_ratio"] = (row["requested_activation_bytes"]
                                         / row["twin_requested_activation_bytes"])
    row["time_ratio"] = row["step_s"] / row["twin_step_s"]
    row["cpu_time_ratio"] = row["step_cpu_s"] / row["twin_step_cpu_s"]
    row["activation_ratio"] = row["activation_bytes"] / row["twin_activation_bytes"]
    return row


def measure_max_batch(job):
    """Largest batch whose fit step peaks under job['cap_bytes']."""
    from benchmarks import search
    row = dict(job, status="ok")
    model = build(job["method"], job["layers"], job["seq"], job.get("accumulation_steps"))
    errors = {}

    def peak(batch):
        try:
            x, y = data(batch, job["seq"])
            fit_step(model, x, y)  # trace at this shape
            return timed_peak(model, x, y)[1]
        except Exception as e:  # pylint: disable=broad-except  # recorded: does not fit
            errors[batch] = f"{type(e).__name__}: {e}"[:500]
            return None

    best, probes = search.max_batch(peak, job["cap_bytes"], job["batch"],
                                    limit=job.get("limit", 1024))
    row.update(max_batch=best, probes={str(b): p for b, p in probes.items()},
               probe_errors={str(b): e for b, e in errors.items()})
    return row


def run_worker(job):
    """Runs `job` in a fresh Python process; returns its row (errors recorded)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_CPU_ALLOCATOR_USE_BFC="1",
               RECOMPUTE="1" if job["method"].startswith("ours") else "0")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.layer_decorator", "--worker",
                           json.dumps(job)], env=env, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        return dict(job, status="error", error=proc.stderr.strip().splitlines()[-1:])
    return json.loads(lines[-1])


def worker_main(job):
    try:
        row = (measure_max_batch if job["kind"] == "max_batch" else measure)(job)
    except Exception as e:  # pylint: disable=broad-except  # recorded, not hidden
        row = dict(job, status="error", error=f"{type(e).__name__}: {e}"[:1000])
    print(json.dumps(row))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--cap-mb", type=float, default=256)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--no-max-batch", action="store_true")
    parser.add_argument("--accumulation-steps", type=int, default=0,
                        help="also run ours with Keras gradient accumulation over N steps")
    parser.add_argument("--out", default="benchmarks/results/layer_decorator",
                        help="writes OUT.jsonl (rows) and OUT.md (table)")
    parser.add_argument("--append", action="store_true",
                        help="add the rows to OUT.jsonl instead of replacing it")
    args = parser.parse_args(argv)
    if args.worker:
        return worker_main(json.loads(args.worker))
    rows = []
    base = dict(layers=args.layers, seq=args.seq, batch=args.batch)
    runs = [dict(base, method=m) for m in args.methods.split(",") if m]
    if args.accumulation_steps:
        runs.append(dict(base, method=METHODS[1], accumulation_steps=args.accumulation_steps))
    for run in runs:
        rows.append(run_worker(dict(run, kind="measure", steps=args.steps)))
        print(json.dumps(rows[-1]), flush=True)
        if not args.no_max_batch:
            rows.append(run_worker(dict(run, kind="max_batch",
                                        cap_bytes=int(args.cap_mb * 2**20))))
            print(json.dumps(rows[-1]), flush=True)
    with open(args.out + ".jsonl", "a" if args.append else "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    with open(args.out + ".jsonl") as f:
        all_rows = [json.loads(line) for line in f]
    with open(args.out + ".md", "w") as f:
        f.write(table(all_rows))
    return None


def table(rows):
    """Markdown: one line per method run, its measure and max-batch rows joined."""
    def name(row):
        steps = row.get("accumulation_steps")
        return row["method"] + (f" + accumulation({steps})" if steps else "")
    found = {}
    for row in rows:
        found.setdefault(name(row), {})[row["kind"]] = row
    stock_batch = found.get("stock", {}).get("max_batch", {}).get("max_batch")
    first = rows[0] if rows else {}
    cap = next((r["cap_bytes"] for r in rows if "cap_bytes" in r), None)
    lines = [f"{first.get('layers')} blocks, seq {first.get('seq')}, batch {first.get('batch')}; "
             f"max batch under {_mib(cap)} MiB. For a method measured "
             f"more than once, the last run is shown (all rows in the .jsonl).", "",
             "| method | activation MiB | stock twin MiB | activation ratio | step s | "
             "time ratio | CPU time ratio | update rel. err | max batch | batch ratio | status |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for method, kinds in found.items():
        m, b = kinds.get("measure", {}), kinds.get("max_batch", {})
        errors = [r.get("error") for r in (m, b) if r.get("status") == "error"]
        cells = [method, _mib(m.get("activation_bytes")), _mib(m.get("twin_activation_bytes")),
                 _num(m.get("activation_ratio")), _num(m.get("step_s")),
                 _num(m.get("time_ratio")), _num(m.get("cpu_time_ratio")),
                 _num(m.get("update_rel_err"), "{:.1e}"),
                 b.get("max_batch", ""),
                 _num(b["max_batch"] / stock_batch if b.get("max_batch") and stock_batch
                      else None),
                 "; ".join(_one_line(e)[:160] for e in errors) or "ok"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def _one_line(error):
    """An error message fit for a table cell: no terminal colours, no line breaks."""
    return " ".join(re.sub(r"\x1b\[[0-9;]*m", "", str(error)).split())


def _mib(value):
    return "" if value is None else f"{value / 2**20:.1f}"


def _num(value, fmt="{:.2f}"):
    return "" if value is None else fmt.format(value)


if __name__ == "__main__":
    main()
