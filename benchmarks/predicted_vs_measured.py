"""The simulator's predicted peak beside the allocator's measured peak.

    python -m benchmarks.predicted_vs_measured [--models a,b] [--threads default,1]

A model is a name of `MODELS` or "FAMILY:SIZE:BATCH" (`model_by_name`). The
held-out keras.applications models (`image_models.HELD_OUT`) run only when named
(`--models VGG16,Xception`).

For each model and threading a fresh subprocess builds the model and, for
each method (tf.gradients, "memory", "speed"; budgetS: a budget of S times
tf.gradients' predicted memory; withinS: memory_within(S)) in turn, traces one training
step (forward and gradients in one tf.function, batch 8 for the image
models), takes the prediction of `checkpoint_plan` from the same trace, and
measures the step's allocator peak (`function_peak_bytes`: statistics reset
before each call; median of 3 calls after 2 warm-ups) minus the weight
gradients it returns: activation memory, as predicted (`predicted`: bytes
requested; `predicted_allocator`: the chunks TensorFlow's BFC allocator hands
out, `core/allocator.py`). Where the weight gradients outweigh the activations
(ResNet50) that difference is not the activations' peak: the third table
compares the whole step (weight gradients counted as they appear) and, with
`--requested`, the activation peak (each weight gradient left out while it
lives: `live_set_diff.activation_peak` beside `timeline.step_peaks`;
docs/planner.md). Step times are
medians of calls made in turn across the methods, after the peaks.
With `--threads N` (an integer) the subprocess runs TensorFlow with N
inter-op threads (1: one; more than the cores: as on a larger machine, the
executor running more ready ops side by side); `default` leaves TensorFlow's;
with `--jit` the step is compiled by XLA (`jit_compile=True`).
Results go to results/predicted_vs_measured.{jsonl,md}; the small models
(`SMALL_MODELS`) are the ones tests/test_memory_model.py measures.
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

from benchmarks.image_models import APPLICATIONS, HELD_OUT, image_data

RESULTS = pathlib.Path(__file__).parent / "results"
METHODS = ("tf.gradients", "memory", "speed")
TIMED_ROUNDS = 9  # step time: median of these calls per method, methods in turn


def family_model(name, size, batch=None):
    """A benchmarks.models family at one size (depth or image side), as a Keras-like callable;
    its data a batch of `batch` (default: the family's own batch)."""
    def build():
        from benchmarks.models import FAMILIES
        family = FAMILIES[name]
        model = family.build(size, **family.options)
        inputs, labels = family.sample(size, 1, **family.options)
        model.forward(inputs, labels, training=False)  # weights, outside tf.function
        return model

    def data():
        from benchmarks.models import FAMILIES
        family = FAMILIES[name]
        return family.sample(size, batch or family.batch, **family.options)
    return build, data


def model_by_name(name):
    """(build, data) of MODELS[name], or of "FAMILY:SIZE:BATCH" (e.g. "bert:4:96", the
    max-batch search's sizes): a benchmarks.models family at any size and batch."""
    if ":" not in name:
        return MODELS[name]
    family, size, batch = name.split(":")
    return family_model(family, int(size), int(batch))


def small_cnn(pixels=32, blocks=8, channels=16, batch=32):
    """Conv-BN-ReLU blocks: a CNN with batch norm, small enough for tests."""
    def build():
        import keras
        layers = [keras.Input((pixels, pixels, 3))]
        for _ in range(blocks):
            layers += [keras.layers.Conv2D(channels, 3, padding="same"),
                       keras.layers.BatchNormalization(), keras.layers.ReLU()]
        layers += [keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)]
        return keras.Sequential(layers)
    return build, lambda: image_data(batch, pixels)


def _pre_norm_blocks(h, blocks, width, heads):
    """`blocks` pre-norm transformer blocks (attention, then a 4x GELU MLP) on `h`."""
    import keras
    for _ in range(blocks):
        a = keras.layers.LayerNormalization()(h)
        h = h + keras.layers.MultiHeadAttention(heads, width // heads)(a, a)
        f = keras.layers.Dense(4 * width, activation="gelu")(keras.layers.LayerNormalization()(h))
        h = h + keras.layers.Dense(width)(f)
    return h


def transformer_encoder(blocks=4, seq=64, hidden=64, heads=4, batch=8):
    """A stack of pre-norm transformer encoder blocks (attention and FFN) and a head."""
    def build():
        import keras
        inputs = keras.Input((seq, hidden))
        h = _pre_norm_blocks(inputs, blocks, hidden, heads)
        return keras.Model(inputs, keras.layers.Dense(10)(keras.layers.GlobalAveragePooling1D()(h)))
    return build, _sequence_data(batch, seq, hidden)


def small_lstm(steps=16, features=32, units=64, batch=64):
    """Two stacked LSTM layers and a head."""
    def build():
        import keras
        return keras.Sequential([keras.Input((steps, features)),
                                 keras.layers.LSTM(units, return_sequences=True),
                                 keras.layers.LSTM(units), keras.layers.Dense(10)])
    return build, _sequence_data(batch, steps, features)


def vision_transformer(pixels=32, patch=4, width=64, heads=4, blocks=4, batch=16):
    """A small ViT: patches by a strided convolution, a class token joined by
    concatenation, pre-norm attention and GELU blocks, the class token's head."""
    def build():
        import keras
        import tensorflow as tf

        class ClassToken(keras.layers.Layer):
            def build(self, shape):
                self.token = self.add_weight(shape=(1, 1, shape[-1]), initializer="normal")
                self.position = self.add_weight(shape=(1, shape[1] + 1, shape[-1]),
                                                initializer="normal")

            def call(self, patches):
                token = tf.tile(self.token, [tf.shape(patches)[0], 1, 1])
                return tf.concat([token, patches], axis=1) + self.position

        keras.utils.set_random_seed(0)
        inputs = keras.Input((pixels, pixels, 3))
        h = keras.layers.Conv2D(width, patch, strides=patch)(inputs)
        h = ClassToken()(keras.layers.Reshape(((pixels // patch) ** 2, width))(h))
        h = keras.layers.LayerNormalization()(_pre_norm_blocks(h, blocks, width, heads))
        return keras.Model(inputs, keras.layers.Dense(10)(h[:, 0]))
    return build, lambda: image_data(batch, pixels)


def text_classifier(vocabulary=20000, steps=64, units=64, batch=16, classes=5):
    """Embedding, a Bidirectional GRU and max pooling: the table's gradient is
    the rows read (an IndexedSlices), far less than the table."""
    def build():
        import keras
        keras.utils.set_random_seed(0)
        return keras.Sequential([
            keras.Input((steps,), dtype="int32"), keras.layers.Embedding(vocabulary, units),
            keras.layers.Bidirectional(keras.layers.GRU(units, return_sequences=True)),
            keras.layers.GlobalMaxPooling1D(), keras.layers.Dense(classes)])

    def data():
        import numpy as np
        rng = np.random.default_rng(0)
        return (rng.integers(0, vocabulary, size=(batch, steps)).astype(np.int32),
                rng.integers(0, classes, size=batch).astype(np.int32))
    return build, data


def wavenet(steps=1024, channels=32, dilations=(1, 2, 4, 8, 16, 32) * 2, batch=8):
    """WaveNet-style stack: causal dilated Conv1D pairs gated by tanh and sigmoid,
    1x1 residual and skip convolutions, the skips summed into the head."""
    def build():
        import keras
        keras.utils.set_random_seed(0)
        inputs = keras.Input((steps, 1))
        h = keras.layers.Conv1D(channels, 1)(inputs)
        skips = []
        for rate in dilations:
            gate = keras.layers.Multiply()([
                keras.layers.Conv1D(channels, 2, padding="causal", dilation_rate=rate,
                                    activation="tanh")(h),
                keras.layers.Conv1D(channels, 2, padding="causal", dilation_rate=rate,
                                    activation="sigmoid")(h)])
            h = keras.layers.Add()([h, keras.layers.Conv1D(channels, 1)(gate)])
            skips.append(keras.layers.Conv1D(channels, 1)(gate))
        out = keras.layers.Conv1D(channels, 1, activation="relu")(
            keras.layers.ReLU()(keras.layers.Add()(skips)))
        return keras.Model(inputs, keras.layers.Dense(10)(keras.layers.GlobalAveragePooling1D()(out)))
    return build, _sequence_data(batch, steps, 1)


def shared_block_stack(repeats=8, pixels=32, channels=32, batch=16):
    """One Keras sub-model (two Conv-BN-ReLU layers) applied `repeats` times with a
    residual around each, its weights shared (ALBERT-style): each weight's partial
    gradients, one per application, are summed."""
    def build():
        import keras
        keras.utils.set_random_seed(0)
        block_input = keras.Input((pixels, pixels, channels))
        h = block_input
        for _ in range(2):
            h = keras.layers.Conv2D(channels, 3, padding="same", use_bias=False)(h)
            h = keras.layers.ReLU()(keras.layers.BatchNormalization()(h))
        block = keras.Model(block_input, h)
        inputs = keras.Input((pixels, pixels, 3))
        h = keras.layers.Conv2D(channels, 3, padding="same")(inputs)
        for _ in range(repeats):
            h = keras.layers.Add()([h, block(h)])
        return keras.Model(inputs, keras.layers.Dense(10)(keras.layers.GlobalAveragePooling2D()(h)))
    return build, lambda: image_data(batch, pixels)


def shared_dense_stack(repeats=8, width=1024, batch=256):
    """One Dense layer (4 MiB of kernel at width 1024) applied `repeats` times with
    a residual around each (ALBERT-style sharing, as a Keras layer called again
    reads its kernel again): stock holds one kernel-sized gradient per call until
    the last is made; our rewrite adds them as they come (session 79)."""
    def build():
        import keras
        keras.utils.set_random_seed(0)
        shared = keras.layers.Dense(width, activation="tanh")
        inputs = keras.Input((width,))
        h = inputs
        for _ in range(repeats):
            h = keras.layers.Add()([h, shared(h)])
        return keras.Model(inputs, keras.layers.Dense(10)(h))

    def data():
        import numpy as np
        rng = np.random.default_rng(0)
        return (rng.normal(size=(batch, width)).astype(np.float32),
                rng.integers(0, 10, size=batch).astype(np.int32))
    return build, data


def _sequence_data(batch, steps, features):
    def data():
        import numpy as np
        rng = np.random.default_rng(0)
        return (rng.normal(size=(batch, steps, features)).astype(np.float32),
                rng.integers(0, 10, size=batch).astype(np.int32))
    return data


# Small models for the tests (tests/test_memory_model.py).
SMALL_MODELS = {"cnn_bn": small_cnn(), "transformer": transformer_encoder(batch=16),
                "lstm": small_lstm()}
MODELS = {**SMALL_MODELS,
    "mlp": family_model("mlp", 16), "resnet": family_model("resnet", 9),
    "bert": family_model("bert", 2), "rnn": family_model("rnn", 2),
    # issue 15's table: BERT / GPT-2 / Llama-style, 4 layers ("bert" stays at 2, the size
    # docs/planner.md's history measured)
    "bert4": family_model("bert", 4), "gpt2": family_model("gpt2", 4),
    "llama": family_model("llama", 4),
    "mlp256": family_model("mlp", 256),  # issue 15's time target (docs/planner.md)
    "text_bigru": text_classifier(), "vit": vision_transformer(),
    "wavenet": wavenet(), "shared_blocks": shared_block_stack(),
    "shared_dense": shared_dense_stack(),
    **{name: family_model(name, 64) for name in APPLICATIONS + ("unet", "unet_keras_io")},
    **{name: family_model(name, pixels) for name, pixels in HELD_OUT.items()},
}


def loss_and_weights(model, inputs, labels):
    """The training loss and the weights of a Keras model or a benchmark family."""
    import tensorflow as tf
    if hasattr(model, "forward"):
        return model.forward(inputs, labels), model.weights
    logits = model(inputs, training=True)
    loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
        labels, logits, from_logits=True))
    return loss, model.trainable_weights


def model_and_data(model_name, threads):
    """(model, inputs, labels) of `model_by_name(model_name)`, TensorFlow set to
    `threads` inter-op threads first unless it is "default" (before any op runs)."""
    import tensorflow as tf
    if threads != "default":
        tf.config.threading.set_inter_op_parallelism_threads(int(threads))
    build, data = model_by_name(model_name)
    model = build()
    inputs, labels = (tf.constant(a) for a in data())
    return model, inputs, labels


def measure(model_name, methods, threads, jit=False, requested=False):
    """Rows (one per method): predicted and measured activation bytes.

    Measured in this process, one method after the other, each step traced
    and warmed up before its peaks are taken (the statistics are reset per
    call), on the same model and batch.
    """
    model, inputs, labels = model_and_data(model_name, threads)
    traced = {method: _traced_or_error(model, inputs, labels, method, jit) for method in methods}
    steps = {m: t for m, t in traced.items() if "error" not in t}
    seconds = _step_seconds({m: t["step"] for m, t in steps.items()}, inputs, labels)
    rows = [_measure_peak(method, traced[method], inputs, labels) | {"seconds": seconds[method]}
            | _stock_range(method, traced[method], threads)
            if method in steps else {"method": method, "error": traced[method]["error"]}
            for method in methods]
    for row in rows if requested else ():  # profiled after every peak: they share the allocator
        if row["method"] in steps:
            row.update(_requested(traced[row["method"]], inputs, labels))
    return [{"model": model_name, "threads": threads, **({"jit": True} if jit else {}), **row}
            for row in rows]


def _traced_or_error(model, inputs, labels, method, jit):
    """`_traced_step`, or the error (an infeasible budget) for this method only."""
    try:
        return _traced_step(model, inputs, labels, method, jit)
    except ValueError as error:
        lines = str(error).splitlines()
        # A traced step's error quotes its traceback: the message is the "ValueError:" line,
        # not the source line "raise ValueError(".
        reason = ([line for line in lines if line.strip().startswith("ValueError:")]
                  or [line for line in lines if "ValueError" in line] or lines[:1])
        return {"error": reason[0].strip()}


def _traced_step(model, inputs, labels, method, jit):
    """One training step of `method` (a name of `METHODS`, budgetS, withinS, or a
    strategy callable) in a tf.function, traced; its plan and budget."""
    import tensorflow as tf
    import memory_saving_gradients as msg
    found = {}

    @tf.function(jit_compile=jit)
    def step(inputs, labels):
        loss, weights = loss_and_weights(model, inputs, labels)
        checkpoints = "memory" if method == METHODS[0] else method
        named = isinstance(method, str)
        if named and method.startswith("budget"):  # budget0.3: 30% of tf.gradients' memory
            baseline = msg.checkpoint_plan(loss, weights, "speed").estimate.baseline_bytes
            checkpoints = found["budget"] = msg.budget(float(method[6:]) * baseline)
        if named and method.startswith("within"):  # within0.1: memory_within(0.1)
            checkpoints = msg.memory_within(float(method[6:]))
        plan = msg.checkpoint_plan(loss, weights, checkpoints)
        found["plan"] = plan
        if method == METHODS[0]:
            return tf.gradients(loss, weights)
        return msg.gradients(loss, weights, checkpoints=checkpoints)

    step(inputs, labels), step(inputs, labels)
    return {"step": step, **found}


def _measure_peak(method, traced, inputs, labels):
    import memory_saving_gradients as msg
    step = traced["step"]
    peaks = [msg.function_peak_bytes(step, inputs, labels)[0] for _ in range(3)]
    weights = loss_and_weights_bytes(traced["plan"])
    est = traced["plan"].estimate
    stock = method == METHODS[0]
    predicted = est.baseline_bytes if stock else est.peak_bytes
    chunks = est.allocator_baseline_bytes if stock else est.allocator_peak_bytes
    budget = {"budget": int(traced["budget"].max_bytes)} if "budget" in traced else {}
    _, activations = step_peaks(traced["plan"], stock)
    return {"method": method, "predicted": int(predicted),
            "predicted_allocator": int(chunks), **budget,
            "measured": int(statistics.median(peaks)) - weights,
            "measured_all": [int(p) - weights for p in peaks],
            "weight_grads": int(weights), "predicted_activation": int(activations)}


def step_peaks(plan, stock):
    """The timeline's (whole-step peak, activation peak) of `plan`'s step, or of
    stock tf.gradients' (`timeline.step_peaks`)."""
    from memory_saving_gradients.core import timeline
    return timeline.step_peaks(plan.model, None if stock else plan.plan)


def _stock_range(method, traced, threads):
    """tf.gradients' rows: the peak replayed in the executor's order, both out-edge
    orders (`timeline.stock_peak_range`), with the step's inter-op threads and, where
    there are several, with one too: on a loaded machine the thread that finished an op
    runs the next ready one itself while the others wait for a core, which is the
    one-thread order (the 8-block MLP under pytest-xdist in a CI run: 9.6 MiB requested,
    above the two-thread replay's 8.1)."""
    if method != METHODS[0]:
        return {}
    from memory_saving_gradients.core import timeline
    counts = {1, os.cpu_count() if threads == "default" else int(threads)}
    ranges = [timeline.stock_peak_range(traced["plan"].model, count) for count in counts]
    low = min(low for low, _ in ranges)
    high = max(high for _, high in ranges)
    return {"predicted_range": [int(low), int(high)]}


def _requested(traced, inputs, labels):
    """Peak of the bytes requested (BFC's chunk excess left out) minus the weight
    gradients, and the activation peak (the step's results left out while they
    live, `live_set_diff.activation_peak`; bytes requested and chunks), medians
    of 3 profiled calls (benchmarks/live_set_diff.py)."""
    from benchmarks.live_set_diff import activation_peak, allocator_events, requested_peak
    weights = loss_and_weights_bytes(traced["plan"])
    calls = [allocator_events(traced["step"], inputs, labels) for _ in range(3)]
    peaks = [requested_peak(events) - weights for events in calls]
    activations = [activation_peak(events) for events in calls]
    chunks = [activation_peak(events, chunks=True) for events in calls]
    return {"requested": int(statistics.median(peaks)), "requested_all": peaks,
            "requested_activation": int(statistics.median(activations)),
            "requested_activation_all": activations,
            "activation_chunks": int(statistics.median(chunks))}


def _step_seconds(steps, inputs, labels):
    """Median seconds per step of each method, the methods called in turn
    (round-robin, so load on the shared machine hits them alike)."""
    import tensorflow as tf
    seconds = {method: [] for method in steps}
    for _ in range(TIMED_ROUNDS):
        for method, step in steps.items():
            start = time.perf_counter()
            first = step(inputs, labels)[0]  # an embedding's gradient is IndexedSlices
            tf.nest.flatten(first, expand_composites=True)[0].numpy()
            seconds[method].append(time.perf_counter() - start)
    return {method: statistics.median(times) for method, times in seconds.items()}


def loss_and_weights_bytes(plan):
    """Bytes of the weight gradients the step returns (what the model sends to weights)."""
    return plan.model.returned_gradient_bytes()


def run_job(model_name, methods, threads, timeout=900, jit=False, requested=False):
    """Runs `measure` in a fresh subprocess; returns its rows (or error rows)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", TF_CPU_ALLOCATOR_USE_BFC="1")
    command = [sys.executable, "-m", "benchmarks.predicted_vs_measured", "--job",
               json.dumps([model_name, list(methods), threads, jit, requested])]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              env=env, check=False, cwd=pathlib.Path(__file__).parent.parent)
        lines = [line for line in done.stdout.splitlines() if line.startswith("[")]
        if lines:
            return json.loads(lines[-1])
        error = done.stderr.strip().splitlines()[-1:] or ["no output"]
    except subprocess.TimeoutExpired:
        error = [f"timed out after {timeout} s"]
    return [{"model": model_name, "method": m, "threads": threads, "error": error[0]}
            for m in methods]


def write_table(rows, path):
    """Markdown: predicted (bytes requested, and chunks as the allocator counts them)
    beside measured MiB, then the memory ratios per threading."""
    lines = ["| model | method | threads | predicted MiB | predicted, allocator chunks MiB | "
             "measured MiB | predicted/measured | allocator/measured |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['method']} | {r['threads']} | error: "
                         f"{r['error'][:80]} | | | | |")
            continue
        chunks = r.get("predicted_allocator")  # absent in rows older than the allocator replay
        measured = max(r["measured"], 1)
        lines.append(f"| {r['model']} | {r['method']} | {r['threads']} | "
                     f"{r['predicted'] / 2**20:.1f} | {_shown(chunks, 2**20, '.1f')} | "
                     f"{r['measured'] / 2**20:.1f} | {r['predicted'] / measured:.2f} | "
                     f"{_shown(chunks, measured, '.2f')} |")
    path.write_text("\n".join(lines + [""] + ratio_lines(rows) + [""] + peak_lines(rows))
                    + "\n")


def peak_lines(rows):
    """Markdown: the whole step's peak (weight gradients counted as they appear)
    and the activation peak (weight gradients left out while they live),
    predicted by the timeline beside measured, for rows that have them. The
    measured activation peak is profiled (`--requested`), in bytes requested."""
    lines = ["| model | method | threads | whole step: predicted / measured MiB (ratio) | "
             "activation peak: predicted / measured MiB (ratio) | activation peak, "
             "allocator chunks MiB |", "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r or "weight_grads" not in r:
            continue
        predicted, measured = (r[k] + r["weight_grads"] for k in ("predicted", "measured"))
        activation = r.get("requested_activation")
        shown = "" if activation is None else _pair(r["predicted_activation"], activation)
        lines.append(f"| {r['model']} | {r['method']} | {r['threads']} | "
                     f"{_pair(predicted, measured)} | {shown} | "
                     f"{_shown(r.get('activation_chunks'), 2**20, '.1f')} |")
    return lines if len(lines) > 2 else []


def _pair(predicted, measured):
    return (f"{predicted / 2**20:.1f} / {measured / 2**20:.1f} "
            f"({predicted / max(measured, 1):.2f})")


def _shown(value, divisor, spec):
    return "" if value is None else format(value / divisor, spec)


def ratio_lines(rows):
    """Markdown: measured activation memory and step time of each mode / tf.gradients',
    per threading of `rows` (in their order), and how far apart the threadings' memory
    ratios are."""
    found = {(r["model"], r["method"], r["threads"]): r for r in rows if "error" not in r}
    threadings = list(dict.fromkeys(r["threads"] for r in rows))

    def ratio(model, mode, threads, field):
        ours, stock = found.get((model, mode, threads)), found.get((model, METHODS[0], threads))
        if not ours or not stock or not stock.get(field) or field not in ours:
            return None
        return ours[field] / stock[field]

    def label(threads):
        return "default threads" if threads == "default" else f"{threads} inter-op"

    def shown(values):
        return " / ".join("" if v is None else f"{v:.2f}" for v in values)

    named = " / ".join(map(label, threadings))
    lines = [f"| model | mode | memory, {named} | difference | time, {named} | activation "
             f"peak, {named} |", "|---|---|---|---|---|---|"]
    modes = dict.fromkeys(r["method"] for r in rows if r["method"] != METHODS[0])
    for model in dict.fromkeys(r["model"] for r in rows):
        for mode in modes:
            memory = [ratio(model, mode, t, "measured") for t in threadings]
            if None in memory:
                continue
            times = [ratio(model, mode, t, "seconds") for t in threadings]
            # Without the weight gradients at any time (profiled: `--requested`).
            peaks = [ratio(model, mode, t, "requested_activation") for t in threadings]
            lines.append(f"| {model} | {mode} | {shown(memory)} | "
                         f"{max(memory) - min(memory):.2f} | {shown(times)} | "
                         f"{shown(peaks)} |")
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(
        m for m in MODELS if m not in SMALL_MODELS and m not in HELD_OUT))
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--threads", default="default,1",
                        help="default and/or inter-op thread counts, e.g. default,1,8")
    parser.add_argument("--out", default="predicted_vs_measured")
    parser.add_argument("--report", action="store_true",
                        help="only rewrite the .md table from the .jsonl rows")
    parser.add_argument("--jit", action="store_true", help="compile the step with XLA")
    parser.add_argument("--requested", action="store_true",
                        help="also profile 3 calls for the peak of the bytes requested")
    parser.add_argument("--job", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for threads in args.threads.split(","):
        if threads != "default" and not (threads.isdigit() and int(threads) > 0):
            parser.error(f"--threads takes 'default' or inter-op thread counts (1, 4, ...), "
                         f"comma-separated; got {threads!r}")
    if args.job:
        print(json.dumps(measure(*json.loads(args.job))), flush=True)
        return
    if args.report:
        rows = [json.loads(line) for line in (RESULTS / f"{args.out}.jsonl").open()]
        write_table(rows, RESULTS / f"{args.out}.md")
        return
    RESULTS.mkdir(exist_ok=True)
    rows = []
    jsonl = RESULTS / f"{args.out}.jsonl"
    for model_name in args.models.split(","):
        for threads in args.threads.split(","):
            for row in run_job(model_name, args.methods.split(","), threads, jit=args.jit,
                               requested=args.requested):
                rows.append(row)
                print(json.dumps(row), flush=True)
                with jsonl.open("a") as f:
                    f.write(json.dumps(row) + "\n")
    write_table(rows, RESULTS / f"{args.out}.md")


if __name__ == "__main__":
    main()
