"""The planner's candidate plans for a Keras `fit` step, ranked two ways.

`"memory"` ranks its candidates by their predicted peak with every weight
gradient held to the end (what a `gradients` caller holds), except in Keras
3's own `fit` step, whose optimizer updates each weight once its own gradient
is made (Grappler removes the IdentityN over them all): there by the peak with
each taken as it is made (`pricing.activation_peak`). This prints, for each
model, the cut model's candidates priced both ways with their recompute, and which each
ranking takes first (ties: least recompute). Planner only: one step of `fit`
is run to trace it.

    python -m benchmarks.plan_objectives --models EfficientNetV2B0,bert,cnn

Models as in `benchmarks.keras_fit` (its `build`: 32 images of 96 px, or its
encoder). Prints one table per model; MiB, activation memory.

With `--measure`, each ranking's first plan is also run under `fit` (the
Checkpointing callback with a strategy callable that takes it), beside stock
`fit`, each in a fresh process (`keras_fit.measure`: the allocator's peak over
the steps after the first, the median step time), with TensorFlow's default
threading and with one inter-op thread:

    python -m benchmarks.plan_objectives --models EfficientNetV2B0,bert --measure
"""

import argparse
import json

# How each ranking orders the candidates: its predicted peak, then recompute
# (strategies.HELD and strategies.AS_TAKEN, the counts `"memory"` ranks by).
RANKINGS = ("held", "as taken")


def candidates(model_name):
    """(rows, stock): each candidate's (held, as taken, recompute FLOPs) and
    stock's (held, as taken), for `model_name`'s fit step, traced once by one
    step of `fit` with the Checkpointing callback (its strategy a callable that
    keeps the planner's model and plans as "memory" does)."""
    import memory_saving_gradients.keras as msg_keras
    from benchmarks import keras_fit
    from memory_saving_gradients.core import pricing
    from memory_saving_gradients.core import strategies
    model, x, y = keras_fit.build(model_name)
    models = []

    def memory_keeping_the_model(graph_model):
        models.append(graph_model)
        return strategies.memory(graph_model)

    model.fit(x, y, batch_size=len(x), epochs=1, steps_per_epoch=1, verbose=0,
              callbacks=[msg_keras.Checkpointing(memory_keeping_the_model)])
    graph_model = models[-1]
    rows = [(r.peak_bytes, pricing.activation_peak(graph_model, r.plan), r.recompute_flops)
            for r in strategies.low_peak_candidates(graph_model)]
    baseline = strategies.stock(graph_model, "stock").estimate.baseline_bytes
    return rows, (baseline, pricing.activation_peak(graph_model, None))


def first_of(ranking):
    """A strategy callable for `Checkpointing`: the low-peak candidate that
    `ranking` (one of `RANKINGS`) takes first, ties to the least recompute."""
    from memory_saving_gradients.core import strategies

    def strategy(graph_model):
        return min(strategies.low_peak_candidates(graph_model),
                   key=lambda r: (strategies.counted_peak(graph_model, r, ranking),
                                  r.recompute_flops))
    return strategy


def measured(model_name, ranking, threads, steps):
    """In a fresh process: `keras_fit.measure`'s row for stock `fit` (`ranking`
    "stock") or the first plan of `ranking`, with `threads` inter-op threads
    (0: TensorFlow's default)."""
    from benchmarks import keras_fit
    return keras_fit.child_row("benchmarks.plan_objectives",
                               ["--child", model_name, ranking, str(threads), "--steps",
                                str(steps)], timeout=1800)


def _child(model_name, ranking, threads, steps):
    from benchmarks import keras_fit
    strategy = None if ranking == "stock" else first_of(ranking)
    print(json.dumps(keras_fit.measure(model_name, strategy, steps, "arrays", threads)))


def measure_rankings(model_name, steps):
    """Prints stock's and each ranking's first plan's measured fit step, with
    each threading; ratios against stock's in the same threading."""
    from benchmarks import keras_fit
    for threads in (0, 1):
        stock = measured(model_name, "stock", threads, steps)
        for ranking in RANKINGS:
            row = measured(model_name, ranking, threads, steps)
            r = keras_fit.ratios(row, stock)
            print(f"  measured, {'one inter-op thread' if threads else 'default threading'}, "
                  f"{ranking} first: peak {row['peak_mib']:.1f} MiB (stock "
                  f"{stock['peak_mib']:.1f}) x{r['peak_ratio']:.2f}, activations "
                  f"x{r['activation_ratio']:.2f}, step x{r['time_ratio']:.2f}", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="EfficientNetV2B0,bert,cnn")
    parser.add_argument("--measure", action="store_true",
                        help="also run each ranking's first plan under fit, beside stock fit")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args.child[0], args.child[1], int(args.child[2]), args.steps)
        return
    for name in args.models.split(","):
        rows, (held, taken) = candidates(name)
        first_held = min(rows, key=lambda r: (r[0], r[2]))
        first_taken = min(rows, key=lambda r: (r[1], r[2]))
        print(f"{name}: tf.gradients held {held / 2**20:.1f}, as taken {taken / 2**20:.1f}")
        print("  held MiB  as taken MiB  recompute FLOPs")
        for row in sorted(set(rows), key=lambda r: (r[0], r[2])):
            marks = (" <- held first" if row == first_held else "") + (
                " <- as taken first" if row == first_taken else "")
            print(f"  {row[0] / 2**20:8.1f}  {row[1] / 2**20:12.1f}  {row[2]:15.3g}{marks}")
        if args.measure:
            measure_rankings(name, args.steps)


if __name__ == "__main__":
    main()
