"""@recompute_grad layers use less activation memory than the same layers
undecorated, with default threading and with one inter-op thread (measured:
allocator peaks, design.md section 4)."""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import memory_saving_gradients as msg
from memory_saving_gradients.keras import recompute_grad


# --- memory -------------------------------------------------------------------------

class WideBlock(keras.layers.Layer):
    """Four dense+relu layers: 8 activation tensors per block kept by stock backprop."""

    def __init__(self, width, **kwargs):
        super().__init__(**kwargs)
        self.layers_ = [keras.layers.Dense(width, activation="relu") for _ in range(4)]

    def call(self, x):
        for layer in self.layers_:
            x = layer(x)
        return x


class RecomputedWideBlock(WideBlock):
    @recompute_grad
    def call(self, x):
        return super().call(x)


def _activation_bytes(block, num_blocks=6, width=256, batch=512, calls=5):
    """The median over `calls` steps of the allocator peak less the weight gradients."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((width,))]
                             + [block(width) for _ in range(num_blocks)])
    x = tf.constant(np.ones((batch, width), "float32"))

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x))
        return tape.gradient(loss, model.trainable_weights)
    step(x)  # trace and warm up
    found = []
    for _ in range(calls):
        peak, grads = msg.function_peak_bytes(step, x)
        found.append(peak - sum(int(np.prod(g.shape)) * 4 for g in grads))
    return int(np.median(found))


def _stock_and_ours():
    stock = _activation_bytes(WideBlock)
    with msg.checkpointing():
        ours = _activation_bytes(RecomputedWideBlock)
    return stock, ours


def test_decorated_stack_uses_less_activation_memory():
    """Measured in a fresh process (design.md section 4): in one that had run
    the suite's first 340 tests, ours once measured 4.2 MB against a usual
    1.8-3.3 MB per call (BFC's chunks), 0.60 of stock."""
    result = subprocess.run([sys.executable, os.path.abspath(__file__)], check=True,
                            capture_output=True, text=True, timeout=600,
                            cwd=os.path.dirname(os.path.abspath(__file__)))
    stock, ours = json.loads(result.stdout.strip().splitlines()[-1])
    # Stock keeps ~4 block-sized tensors per block; ours one per block plus one
    # block's recomputation.
    assert ours < 0.5 * stock, (ours, stock)


def _decorator_activation_ratio(tmp_path, env_update: dict) -> float:
    """Ours' activation memory over stock's in bytes requested, measured by the
    decorator benchmark (a fresh process: thread counts are fixed when TensorFlow
    starts). The allocator's ratios (0.25-0.28 default, 0.33-0.37 one thread)
    vary with the chunks BFC hands out; they once differed by 0.109."""
    out = tmp_path / "threads_{}".format(env_update.get("TF_NUM_INTEROP_THREADS", "default"))
    command = [sys.executable, "-m", "benchmarks.layer_decorator", "--layers", "4", "--seq", "64",
               "--batch", "8", "--steps", "2", "--no-max-batch",
               "--methods", "stock,ours(@recompute_grad)", "--out", str(out)]
    subprocess.run(command, check=True, capture_output=True, timeout=900,
                   env={**os.environ, **env_update},
                   cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    rows = [json.loads(line) for line in open(f"{out}.jsonl")]
    (ours,) = [row for row in rows if row["method"] == "ours(@recompute_grad)"]
    # float32: the rewrite adds the means' gradients by broadcasting, one addition
    # in another order than stock's AddN, and the attention's and layer norms'
    # cancelling gradients amplify that rounding (block 1's value kernel: 1.6e-4
    # relative; the same comparison in float64 is 4e-13).
    assert ours["status"] == "ok" and ours["update_rel_err"] < 1e-3, ours
    return ours["requested_activation_ratio"]


@pytest.mark.slow
def test_saving_holds_with_one_inter_op_thread(tmp_path):
    # With one inter-op thread TensorFlow runs weight gradients late; before
    # each layer's input gradient waited for its weight gradients, every
    # layer's recomputed tensors were alive together (0.54 of stock, 12 blocks).
    default = _decorator_activation_ratio(tmp_path, {})
    single = _decorator_activation_ratio(tmp_path, {"TF_NUM_INTEROP_THREADS": "1"})
    assert single < 0.5, single
    assert abs(default - single) <= 0.1, (default, single)


if __name__ == "__main__":
    print(json.dumps(_stock_and_ours()))
