"""Measurement: peak memory of a Session run or of a tf.function call.

Used by the tests, the demo and the benchmarks, and by users who want to see
what checkpointing saved on their own model.
"""

from __future__ import annotations

import os

import tensorflow as tf

from memory_saving_gradients.tfgraph import allocations

# TensorFlow's default CPU allocator keeps statistics only when oneDNN is on,
# which TF enables by default on some Intel CPUs only (not on AMD): the BFC
# allocator keeps them everywhere, and counts every allocation.
_STATS_ENV = "TF_CPU_ALLOCATOR_USE_BFC"


def enable_cpu_allocator_stats() -> None:
    """Makes TensorFlow's CPU allocator keep the statistics `function_peak_bytes` reads.

    Sets TF_CPU_ALLOCATOR_USE_BFC=1 unless the environment sets it already.
    TensorFlow picks its CPU allocator when it runs its first op, so call this
    after `import tensorflow` but before any op runs; later it changes nothing.
    """
    os.environ.setdefault(_STATS_ENV, "1")


def session_peak_bytes(sess, fetches, feed_dict=None, device: str | None = None) -> tuple:
    """Runs `fetches` once with full tracing; returns (peak bytes, results).

    The peak is replayed from the allocation records of the run's step stats
    (every allocation and deallocation, in time order), summed over devices,
    or of `device` only (e.g. 'CPU:1': one replica of a MirroredStrategy;
    logical CPU devices share one allocator, whose statistics
    `function_peak_bytes` reads, so only this tells them apart).
    It counts everything the run allocated: activations, gradients, and
    outputs, but not variables, which live outside the step. Under the BFC
    allocator a record holds the chunk handed out, up to twice the request,
    and which chunk depends on what the process allocated before.
    """
    results, metadata = allocations.traced_run(sess, fetches, feed_dict)
    return allocations.peak_bytes(metadata, device), results


def function_peak_bytes(fn, *args, device: str = "CPU:0", **kwargs) -> tuple:
    """Calls `fn(*args, **kwargs)` once; returns (peak bytes above the start, result).

    Uses the allocator's own statistics (tf.config.experimental memory info),
    reset before the call, so call a traced tf.function once before measuring
    if tracing should not count. On CPU it needs `enable_cpu_allocator_stats()`
    first on most machines; it raises RuntimeError saying so otherwise.
    """
    try:
        tf.config.experimental.reset_memory_stats(device)
    except ValueError as error:
        raise RuntimeError(
            f"TensorFlow keeps no allocator statistics for {device} in this process "
            f"(on CPU it keeps them only with oneDNN on, or with the BFC allocator): "
            f"call memory_saving_gradients.enable_cpu_allocator_stats(), or set "
            f"{_STATS_ENV}=1 in the environment, before TensorFlow runs its first "
            f"op") from error
    start = tf.config.experimental.get_memory_info(device)["current"]
    result = fn(*args, **kwargs)
    peak = tf.config.experimental.get_memory_info(device)["peak"]
    return peak - start, result
