"""Measured kernel scratch is the bytes requested, whatever the allocator
(tfgraph/workspace.py, allocations.requested_run_peak, profiled_allocations).

Under TF_CPU_ALLOCATOR_USE_BFC=1 (set for every test by conftest.py) a traced
run's allocation records hold BFC's chunks: a 3x3 convolution gradient's
19.7 MiB im2col buffer was recorded as a whole 32 MiB region, so the model's
scratch depended on the allocator and its state, and the allocator replay
(core/allocator.py) rounded an already rounded size up again (the small CNN's
stock step: 96 MiB predicted, 62-64 measured). Without BFC the records are
the bytes requested; the probe must agree with them. The probes run with
oneDNN's kernels off (TF_ENABLE_ONEDNN_OPTS=0): on CPUs where TensorFlow
turns them on, its convolution gradients take no scratch from TensorFlow's
allocator, and Eigen's kernels are the ones whose im2col buffer is measured.
"""

import json
import os
import pathlib
import subprocess
import sys
import threading

import numpy as np
import tensorflow as tf

from memory_saving_gradients.tfgraph import allocations
from memory_saving_gradients.tfgraph import profiled_allocations

# A 3x3 convolution whose gradient kernels take an im2col buffer well under the
# 32 MiB region BFC would grow for it: 8 x 8 x 8 x 128 -> 32 channels.
_PROBE = """
import json
import tensorflow as tf
from memory_saving_gradients.tfgraph import workspace
with tf.Graph().as_default():
    x = tf.compat.v1.placeholder(tf.float32, [8, 8, 8, 128])
    y = tf.nn.conv2d(x, tf.zeros([3, 3, 128, 32]), 1, "SAME")
    print(json.dumps(workspace.gradient_workspace_bytes(y.op)))
"""


def _probe(environment, temporary):
    """The probe's scratch, run in a fresh process whose temporary files go to
    `temporary` (the profiler writes its trace there: it must be removed)."""
    root = pathlib.Path(__file__).resolve().parent.parent  # this checkout's package
    done = subprocess.run([sys.executable, "-c", _PROBE],
                          env={**environment, "PYTHONPATH": str(root), "TMPDIR": str(temporary),
                               "TF_ENABLE_ONEDNN_OPTS": "0"},
                          check=True, capture_output=True, text=True, timeout=300)
    return json.loads(done.stdout.splitlines()[-1])


def test_convolution_scratch_does_not_depend_on_the_allocator(tmp_path):
    with_bfc = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="1")
    without = {k: v for k, v in os.environ.items() if k != "TF_CPU_ALLOCATOR_USE_BFC"}
    requested = _probe(without, tmp_path)
    assert 8 * 2**20 < requested < 30 * 2**20  # a real scratch, under a 32 MiB region
    assert _probe(with_bfc, tmp_path) == requested  # was 32 MiB: the chunk
    assert not list(tmp_path.iterdir())  # the profiler's trace directories are gone


def test_requested_peak_leaves_out_feeds_and_other_ops_when_asked():
    # (time, +/-chunk, addr, op, shape, requested): another thread frees a
    # buffer made before the call; a feed (no op), an op's buffer, another
    # thread's op's buffer.
    events = [(0, -2048, 9, "", "", 2048), (1, 512, 1, "", "", 300),
              (2, 1024, 2, "probe7/conv", "", 1000), (3, 4096, 3, "Fill", "", 4000),
              (4, -4096, 3, "", "", 0), (5, -1024, 2, "", "", 0), (6, -512, 1, "", "", 0)]
    assert profiled_allocations.requested_peak(events) == 5300 - 2048
    assert profiled_allocations.requested_peak(events, ops_only=True) == 5000 - 2048
    assert profiled_allocations.requested_peak(events, scope="probe7") == 1000
    # What Grappler makes from a probe's op keeps its scope; a longer name is another's.
    made = [(7, 64, 4, "ConstantFolding/probe7/c", "", 60), (8, 64, 5, "myprobe7/c", "", 60)]
    assert profiled_allocations.requested_peak(events[:3] + made, scope="probe7") == 1060


def test_session_peak_is_none_while_another_profiler_runs(tmp_path):
    graph = tf.Graph()
    with graph.as_default():
        out = tf.zeros([1000]) + 1.0
    tf.profiler.experimental.start(str(tmp_path))
    try:
        with tf.compat.v1.Session(graph=graph) as sess:
            assert profiled_allocations.session_requested_peak(sess, out) is None
    finally:
        tf.profiler.experimental.stop()


def test_a_probe_counts_its_own_ops_only_while_another_thread_allocates():
    """The profiler reports every thread's allocations: a probe's run counted
    another thread's 4 MB eager tensors as its own 1 MB op's (a 0.5 MB op
    read 4-8 MB in 4 of 5 runs before session 51; Keras's `fit` traces its step while its data
    pipeline allocates, and replicas of a tf.distribute strategy trace at
    once)."""
    with allocations.probe_graph("CPU:0") as (graph, scope):
        x = tf.compat.v1.placeholder(tf.float32, [8, 32, 32, 16])
        out = tf.concat([x, x], 0)  # never written over the feed
    feed = {x: np.zeros([8, 32, 32, 16], np.float32)}
    stop = threading.Event()

    def allocate_elsewhere():
        while not stop.is_set():
            tf.zeros([1000, 1000]) + 1.0  # pylint: disable=expression-not-assigned
            stop.wait(0.0005)

    with tf.compat.v1.Session(graph=graph) as sess:
        alone = allocations.requested_run_peak(sess, out.op, feed, scope)
        other = threading.Thread(target=allocate_elsewhere)
        other.start()
        try:
            beside = [allocations.requested_run_peak(sess, out.op, feed, scope)
                      for _ in range(5)]
        finally:
            stop.set()
            other.join()
    assert alone == 2 * 8 * 32 * 32 * 16 * 4
    assert beside == [alone] * 5
