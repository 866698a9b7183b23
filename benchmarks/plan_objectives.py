"""The planner's candidate plans for a Keras `fit` step, ranked two ways.

`"memory"` ranks its candidates by their predicted peak with every weight
gradient held to the end (what a `gradients` caller holds); under `fit` the
optimizer takes each weight gradient as it is made, and the step's peak is
the other count (`pricing.activation_peak`). This prints, for each model, the
cut model's candidates priced both ways with their recompute, and which each
ranking takes first (ties: least recompute). Planner only: one step of `fit`
is run to trace it.

    python -m benchmarks.plan_objectives --models EfficientNetV2B0,bert,cnn

Models as in `benchmarks.keras_fit` (its `build`: 32 images of 96 px, or its
encoder). Prints one table per model; MiB, activation memory.
"""

import argparse


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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="EfficientNetV2B0,bert,cnn")
    args = parser.parse_args(argv)
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


if __name__ == "__main__":
    main()
