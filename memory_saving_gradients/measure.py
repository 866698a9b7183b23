"""Measurement: peak memory of a Session run or of a tf.function call.

Used by the tests, the demo and the benchmarks, and by users who want to see
what checkpointing saved on their own model.
"""

import tensorflow as tf


def session_peak_bytes(sess, fetches, feed_dict=None):
    """Runs `fetches` once with full tracing; returns (peak bytes, results).

    The peak is replayed from the allocation records of the run's step stats
    (every allocation and deallocation, in time order), summed over devices.
    It counts everything the run allocated: activations, gradients, and
    outputs, but not variables, which live outside the step.
    """
    options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
    metadata = tf.compat.v1.RunMetadata()
    results = sess.run(fetches, feed_dict=feed_dict, options=options,
                       run_metadata=metadata)
    records = sorted(
        (record.alloc_micros, record.alloc_bytes)
        for device in metadata.step_stats.dev_stats
        for node in device.node_stats
        for allocator in node.memory
        for record in allocator.allocation_records)
    peak = current = 0
    for _, change in records:
        current += change
        peak = max(peak, current)
    return peak, results


def function_peak_bytes(fn, *args, device="CPU:0", **kwargs):
    """Calls `fn(*args, **kwargs)` once; returns (peak bytes above the start, result).

    Uses the allocator's own statistics (tf.config.experimental memory info),
    reset before the call, so call a traced tf.function once before measuring
    if tracing should not count.
    """
    tf.config.experimental.reset_memory_stats(device)
    start = tf.config.experimental.get_memory_info(device)["current"]
    result = fn(*args, **kwargs)
    peak = tf.config.experimental.get_memory_info(device)["peak"]
    return peak - start, result
