"""Demo: Keras `model.fit` with the Checkpointing callback, stock `fit` beside it.

    python -m examples.demo [--model bert|cnn] [--modes memory,speed] [--batch 32] [--steps 4]

Trains the same model (same seeds, same data) a few steps with stock `fit`
and with `fit(..., callbacks=[Checkpointing(mode)])`, and prints
each training step's allocator peak, its activation memory and its time side
by side. The model code is not changed: the callback is all it takes.
"""

import argparse

import numpy as np

import memory_saving_gradients as msg


def build(model_name, batch, steps):
    """A compiled model and `steps` batches of synthetic data."""
    import keras
    from examples import keras_models
    keras.utils.set_random_seed(0)
    rng = np.random.RandomState(0)
    if model_name == "cnn":
        model = keras_models.mobilenet(size=96, classes=10)
        x = rng.rand(batch * steps, 96, 96, 3).astype("float32")
    else:
        model = keras_models.bert_like(vocab=1000, width=128, layers=4, classes=10)
        x = rng.randint(1, 1000, (batch * steps, 128))
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model, x, rng.randint(0, 10, len(x))


def run(model_name, modes, batch, steps):
    """One row per method: (name, peak bytes, step seconds, gradient bytes, final loss)."""
    import memory_saving_gradients.keras as msg_keras
    from examples import keras_models
    rows = []
    for checkpoints in [None] + modes:
        name = f"Checkpointing({checkpoints!r})" if checkpoints else "stock fit"
        model, x, y = build(model_name, batch, steps)
        meter = keras_models.step_meter()
        callbacks = [meter] + ([msg_keras.Checkpointing(checkpoints)] if checkpoints else [])
        history = model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False,
                            callbacks=callbacks)
        grad_bytes = sum(w.numpy().nbytes for w in model.trainable_weights)
        rows.append((name, *meter.summary(), grad_bytes, history.history["loss"][-1]))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("bert", "cnn"), default="bert",
                        help="bert: 4-layer encoder; cnn: MobileNetV2 (alpha 0.35, 96x96)")
    parser.add_argument("--modes", default="memory",
                        help="comma-separated checkpoints modes to run beside stock fit")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3, help="training steps per method")
    args = parser.parse_args(argv)
    msg.enable_cpu_allocator_stats()  # before TensorFlow's first op picks the allocator
    import tensorflow as tf
    what = "MobileNetV2, 96x96 images" if args.model == "cnn" else "BERT-like, 128 tokens"
    print(f"model.fit of {args.model} ({what}), batch {args.batch}, {args.steps} steps per "
          f"method, TensorFlow {tf.__version__}\n")
    rows = run(args.model, args.modes.split(","), args.batch, args.steps)
    base_act, base_time = rows[0][1] - rows[0][3], rows[0][2]
    print(f"{'callback':<24} {'peak MiB':>9} {'activations MiB':>16} {'vs stock':>9} "
          f"{'step s':>7} {'vs stock':>9}  final loss")
    for name, peak, step_s, grad_bytes, loss in rows:
        act = peak - grad_bytes
        print(f"{name:<24} {peak / 2**20:>9.1f} {act / 2**20:>16.1f} {act / base_act:>9.2f} "
              f"{step_s:>7.3f} {step_s / base_time:>9.2f}  {loss:.4f}")
    print("\npeak: allocator peak of one training step (after the first, which traces); "
          "activations: peak minus the weights' gradients. Equal final losses: the same "
          "training, with less memory.")


if __name__ == "__main__":
    main()
