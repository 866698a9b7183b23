"""Cost of the GradientTape hook while no checkpointing is active.

Entering a tape in a graph of 20,000 ops, stock and with the hook installed
(after one `checkpointing` block). Run: `python -m benchmarks.tape_hook_cost`.
"""

import time

import tensorflow as tf

import memory_saving_gradients as msg


def microseconds_per_tape(ops: int = 20000, tapes: int = 2000) -> float:
    graph = tf.Graph()
    with graph.as_default():
        x = tf.constant(1.0)
        for _ in range(ops):
            x = x + 1.0
        start = time.perf_counter()
        for _ in range(tapes):
            with tf.GradientTape():
                pass
        return (time.perf_counter() - start) / tapes * 1e6


if __name__ == "__main__":
    print(f"stock: {microseconds_per_tape():.1f} us per tape")
    with msg.checkpointing("memory"):
        pass  # installs the hook
    print(f"hooked, checkpointing off: {microseconds_per_tape():.1f} us per tape")
