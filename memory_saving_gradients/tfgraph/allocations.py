"""Peak memory of one traced Session run, replayed from its allocation records.

Every allocation and deallocation an op makes (outputs and scratch buffers)
is in the run's step stats; replayed in time order they give the run's own
peak, without touching the allocator's process-wide statistics.
"""

from __future__ import annotations

import contextlib

import tensorflow as tf

from memory_saving_gradients.tfgraph import compat
from memory_saving_gradients.tfgraph import profiled_allocations
from memory_saving_gradients.tfgraph import replicas


def traced_run(sess, fetches, feed_dict=None) -> tuple:
    """`sess.run(fetches)` with full tracing; returns (results, RunMetadata)."""
    options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
    metadata = tf.compat.v1.RunMetadata()
    results = sess.run(fetches, feed_dict=feed_dict, options=options, run_metadata=metadata)
    return results, metadata


def peak_bytes(metadata, device: str | None = None) -> int:
    """Peak bytes alive during a traced run, on every device or on `device` only."""
    records = sorted(
        (record.alloc_micros, record.alloc_bytes)
        for stats in metadata.step_stats.dev_stats
        if device is None or replicas.same_device(stats.device, device)
        for node in stats.node_stats
        for allocator in node.memory
        for record in allocator.allocation_records)
    peak = current = 0
    for _, change in records:
        current += change
        peak = max(peak, current)
    return peak


@contextlib.contextmanager
def probe_graph(device: str):
    """(a new graph, made the default, its ops on `device` and under a name
    scope no other graph of the process has; that scope): the profiler
    reports every thread's allocations, and `requested_run_peak` given the
    scope counts only those of the probe's own ops (two replicas tracing at
    once probe the same kernels, which a graph's default names would not tell
    apart)."""
    graph, scope = tf.Graph(), f"probe{compat.unique_id()}"
    with graph.as_default(), tf.device(device), tf.name_scope(scope):
        yield graph, scope


def requested_run_peak(sess, fetches, feed_dict=None, scope=None) -> int:
    """Peak bytes the ops of one `sess.run` request (run twice: the first may set
    up caches); with `scope` (`probe_graph`'s), only those of its ops, not what
    other threads allocate meanwhile. The bytes requested, from the profiler,
    where it runs: under BFC the allocation records hold chunks, up to twice
    the request, and which one a request gets depends on what the process
    allocated before (a probe's 24.5 MiB convolution scratch was recorded as
    32 MiB). Else the records' peak."""
    sess.run(fetches, feed_dict=feed_dict)
    requested = profiled_allocations.session_requested_peak(sess, fetches, feed_dict, scope)
    if requested is not None:
        return requested
    return peak_bytes(traced_run(sess, fetches, feed_dict)[1])
