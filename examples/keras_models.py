"""Small real Keras models and a per-step memory meter, shared by the demo, tests and benchmarks."""

import statistics
import time


def mobilenet(size=32, classes=4):
    """keras.applications.MobileNetV2 (batch norm, depthwise convolutions), alpha 0.35, untrained."""
    import keras
    return keras.applications.MobileNetV2(input_shape=(size, size, 3), alpha=0.35,
                                          weights=None, classes=classes,
                                          classifier_activation=None)


def bert_like(vocab=50, width=32, layers=2, classes=4):
    """A BERT-style encoder: token embeddings, then attention and GELU feed-forward blocks
    (post-layer-norm, dropout 0.1), classifying from the first token."""
    import keras
    tokens = keras.Input((None,), dtype="int32")
    h = keras.layers.Dropout(0.1)(keras.layers.Embedding(vocab, width)(tokens))
    for _ in range(layers):
        attended = keras.layers.MultiHeadAttention(2, width // 2, dropout=0.1)(h, h)
        h = keras.layers.LayerNormalization()(h + keras.layers.Dropout(0.1)(attended))
        hidden = keras.layers.Dense(width * 2, activation="gelu")(h)
        hidden = keras.layers.Dropout(0.1)(keras.layers.Dense(width)(hidden))
        h = keras.layers.LayerNormalization()(h + hidden)
    return keras.Model(tokens, keras.layers.Dense(classes)(h[:, 0]))


def step_meter():
    """A Keras callback recording each training batch's allocator peak (bytes) and time (s).

    Needs allocator statistics (memory_saving_gradients.enable_cpu_allocator_stats()).
    `summary()` gives (max peak, median time) over the batches after the first,
    which traces the train function.
    """
    import keras
    import tensorflow as tf

    class StepMeter(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.peaks, self.times = [], []
            self._start, self._clock = 0, 0.0

        def on_train_batch_begin(self, batch, logs=None):
            tf.config.experimental.reset_memory_stats("CPU:0")
            self._start = tf.config.experimental.get_memory_info("CPU:0")["current"]
            self._clock = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.times.append(time.perf_counter() - self._clock)
            self.peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"]
                              - self._start)

        def summary(self):
            return max(self.peaks[1:]), statistics.median(self.times[1:])

    return StepMeter()
