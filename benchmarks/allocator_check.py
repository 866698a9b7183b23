"""core/allocator.py against TensorFlow's own BFC allocator, on known sizes.

    python -m benchmarks.allocator_check

Each case is a tf.function making a chain of float32 tensors of given sizes
(each a tiling of the one before's first element, so every one is a new
buffer), all concatenated at the end (so all are alive until the concat's
output, of their total size, is allocated), then summed. It runs in a
fresh process (TF_CPU_ALLOCATOR_USE_BFC=1), is called twice to warm up, and
the allocator's peak over a third call (statistics reset before it) is
compared with `allocator.peak_chunk_bytes` over the same allocations, and
with the bytes requested.
"""

import json
import os
import subprocess
import sys

KIB = 2**10

# Sizes in KiB: where the allocator hands out whole chunks, and where it splits.
CASES = {
    "three of 1200 KiB": [1200] * 3,
    "1536 then 1536 KiB": [1536, 1536],
    "1 MiB then 3 MiB": [1024, 3072],
    "growing 700..2800 KiB": [700, 1400, 2800],
    "ten of 300 KiB": [300] * 10,
}


def measured_peak(sizes_kib):
    """Peak bytes above the start of the third call of the chain (this process)."""
    import tensorflow as tf
    from memory_saving_gradients import measure

    @tf.function
    def chain(seed):  # an input, or Grappler folds the chain into constants
        tensors = [tf.fill([sizes_kib[0] * KIB // 4], seed)]
        for size in sizes_kib[1:]:
            # A new buffer of `size` KiB: the one before's first element, tiled.
            first = tf.reshape(tensors[-1], [-1])[:1] * seed
            tensors.append(tf.tile(first, [size * KIB // 4]))
        return tf.reduce_sum(tf.concat(tensors, 0))  # all alive until the concat

    seed = tf.constant(1.0)
    chain(seed), chain(seed)
    return measure.function_peak_bytes(chain, seed)[0]


def predicted(sizes_kib):
    """(chunk peak, requested peak) of the chain's large allocations: its
    tensors, then the concat of them all (the one-element slices left out)."""
    from memory_saving_gradients.core import allocator
    events = [("alloc", n, size * KIB) for n, size in enumerate(sizes_kib)]
    events.append(("alloc", "concat", sum(sizes_kib) * KIB))
    return allocator.peak_chunk_bytes(events), 2 * sum(sizes_kib) * KIB


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--case":
        print(json.dumps(measured_peak(json.loads(sys.argv[2]))))
        return
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="1", TF_CPP_MIN_LOG_LEVEL="3")
    print("| case | requested KiB | predicted chunks KiB | measured KiB |")
    print("|---|---|---|---|")
    for name, sizes in CASES.items():
        done = subprocess.run([sys.executable, "-m", "benchmarks.allocator_check", "--case",
                               json.dumps(sizes)], capture_output=True, text=True, env=env,
                              check=True)
        measured = json.loads(done.stdout.strip().splitlines()[-1])
        chunks, requested = predicted(sizes)
        print(f"| {name} | {requested // KIB} | {chunks / KIB:.0f} | {measured / KIB:.1f} |")


if __name__ == "__main__":
    main()
