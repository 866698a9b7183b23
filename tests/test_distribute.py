"""tf.distribute: strategies, patches in several threads, multi-worker training.

TensorFlow fixes its devices at its first op, so what needs several devices
or processes runs in fresh processes, each bounded in time and killed if it
overruns: tests/distribute_cases.py on 4 logical CPU devices, the examples
(MirroredStrategy, a parameter-server cluster in one process), and two
MultiWorkerMirroredStrategy workers on localhost. Those are marked slow (one
to four minutes each on a busy 2-core machine).
"""

import _thread
import json
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.ops import gradients_impl

import memory_saving_gradients as msg
from memory_saving_gradients.integrations.patching import active_checkpoints

ROOT = Path(__file__).resolve().parents[1]
UNPATCHED = tf.gradients


def _env(**extra):
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path, TF_CPP_MIN_LOG_LEVEL="2", **extra)


def _python(args, timeout):
    """Runs `python args` from the repository root; killed after `timeout` seconds."""
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=_env(), timeout=timeout,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _recomputed_ops(log):
    """Recompute counts from the plans our logger printed."""
    return [int(n) for n in re.findall(r"recompute (\d+) of \d+ forward ops", log)]


def _chain(weights, inputs):
    h = inputs
    for w in weights:
        h = tf.tanh(tf.matmul(h, w))
    return tf.reduce_sum(h * h)


@pytest.mark.slow
def test_cases_on_four_logical_cpus():
    result = _python(["-m", "pytest", "-q", "-p", "no:cacheprovider",
                      "tests/distribute_cases.py"], timeout=900)
    assert result.returncode == 0, result.stdout[-6000:]


@pytest.mark.slow
@pytest.mark.parametrize("example", [
    ["examples.mirrored", "--devices", "2", "--steps", "2"],
    ["examples.parameter_server", "--steps", "2"]], ids=["mirrored", "parameter_server"])
def test_example_trains_as_stock(example):
    result = _python(["-m", *example], timeout=600)
    assert result.returncode == 0, result.stdout[-4000:]
    difference = re.search(r"checkpointing vs tf.gradients: (\S+)", result.stdout)
    assert difference and float(difference.group(1)) <= 1e-5, result.stdout[-4000:]
    assert any(n > 0 for n in _recomputed_ops(result.stdout)), result.stdout[-4000:]


def _free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@pytest.mark.slow
def test_multi_worker_example_gives_both_workers_stocks_weights(tmp_path):
    """Two workers on 127.0.0.1; they talk over loopback only, but TensorFlow's
    gRPC server listens on every interface (its port is free and short-lived)."""
    cluster = {"worker": [f"127.0.0.1:{port}" for port in _free_ports(2)]}
    outputs = [tmp_path / f"worker{index}.json" for index in range(2)]
    workers = []
    try:
        for index, out in enumerate(outputs):
            config = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})
            workers.append(subprocess.Popen(
                [sys.executable, "-m", "examples.multi_worker", "--out", str(out)],
                cwd=ROOT, env=_env(TF_CONFIG=config), text=True,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 600
        logs = [w.communicate(timeout=max(1.0, deadline - time.monotonic()))[0]
                for w in workers]
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.communicate()
    for worker, log in zip(workers, logs):
        assert worker.returncode == 0, log[-4000:]
        assert any(n > 0 for n in _recomputed_ops(log)), log[-4000:]
    results = [json.loads(out.read_text()) for out in outputs]
    for name in ("ours", "stock"):
        for a, b in zip(results[0][name], results[1][name]):
            np.testing.assert_array_equal(a, b, err_msg=f"{name}: workers differ")
    for a, b in zip(results[0]["ours"], results[0]["stock"]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("make_strategy", [
    tf.distribute.get_strategy, lambda: tf.distribute.OneDeviceStrategy("CPU:0")],
    ids=["default", "one_device"])
def test_single_device_strategies_as_today(make_strategy):
    strategy = make_strategy()
    with strategy.scope():
        weights = [tf.Variable(tf.random.stateless_normal([16, 16], seed=[i, 0]) * 0.3)
                   for i in range(6)]

    @tf.function
    def step(inputs):
        def replica_step(inputs):
            loss = _chain(weights, inputs)
            return (msg.gradients(loss, weights, checkpoints="memory"),
                    gradients_impl.gradients(loss, weights))
        return strategy.run(replica_step, (inputs,))

    inputs = tf.random.stateless_normal([4, 16], seed=[1, 1])
    ours, stock = step(inputs)
    for a, b in zip(ours, stock):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)
    graph = step.get_concrete_function(inputs).graph
    assert any("/recompute_" in op.name for op in graph.get_operations())


def test_threads_patch_at_once_each_its_own_mode(caplog):
    """Four threads are inside their own checkpointing blocks at the same time."""
    modes = ["memory", "speed", "memory", "speed"]
    barrier = threading.Barrier(len(modes), timeout=120)
    seen, errors, grads = {}, [], {}

    def worker(index):
        try:
            graph = tf.Graph()
            with graph.as_default():
                inputs = tf.compat.v1.placeholder(tf.float32, [4, 8])
                weights = [tf.constant(np.full([8, 8], 0.1 * (i + 1), np.float32))
                           for i in range(6)]
                loss = _chain(weights, inputs)
                with msg.checkpointing(modes[index]):
                    barrier.wait()  # every thread has entered its block
                    seen[index] = active_checkpoints()
                    ours = tf.gradients(loss, weights)
                    barrier.wait()  # no thread leaves before all have differentiated
                stock = gradients_impl.gradients(loss, weights)
                with tf.compat.v1.Session(graph=graph) as sess:
                    grads[index] = sess.run([ours, stock], {inputs: np.ones([4, 8]) * index})
        except Exception as error:  # pylint: disable=broad-except
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(modes))]
    with caplog.at_level(logging.INFO, logger="memory_saving_gradients"):
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    assert not errors, errors
    assert seen == dict(enumerate(modes))
    for index, (ours, stock) in grads.items():
        np.testing.assert_allclose(ours, stock, rtol=1e-5, atol=1e-6, err_msg=str(index))
    assert sorted(re.findall(r"mode '(\w+)'", caplog.text)) == sorted(modes)
    assert tf.gradients is UNPATCHED and active_checkpoints() is None


def test_main_thread_patch_holds_in_other_threads_under_their_own():
    seen = []

    def worker():
        seen.append(active_checkpoints())
        with msg.checkpointing("speed"):
            seen.append(active_checkpoints())
        seen.append(active_checkpoints())
        try:
            msg.unpatch_tf_gradients()  # this thread has no patch of its own left
        except RuntimeError as error:
            seen.append(str(error))

    with msg.checkpointing("memory"):
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join(timeout=60)
        assert active_checkpoints() == "memory"
    assert seen[:3] == ["memory", "speed", "memory"]
    assert "not patched" in seen[3] and "same thread" in seen[3]
    assert tf.gradients is UNPATCHED


def _run_in_thread_by_threading(target):
    thread = threading.Thread(target=target)
    thread.start()
    thread.join(timeout=60)


def _run_in_thread_outside_threading(target):
    """As C code's threads are: `threading` sees a `_DummyThread`, alive for good."""
    done = threading.Event()

    def run():
        try:
            target()
        finally:
            done.set()

    _thread.start_new_thread(run, ())
    assert done.wait(timeout=60)


@pytest.mark.parametrize("run_in_thread", [_run_in_thread_by_threading,
                                           _run_in_thread_outside_threading])
def test_a_thread_that_ends_patched_leaves_no_patch_behind(run_in_thread):
    """Its patch is forgotten, the originals are back, and a later thread
    (which the OS may give the ended one's id) is not patched."""
    import keras
    stock_apply = keras.optimizers.Optimizer.apply
    seen = []
    run_in_thread(lambda: msg.patch_tf_gradients("memory"))
    # A thread's storage is cleared just after its function returns.
    deadline = time.monotonic() + 10
    while active_checkpoints() is None and tf.gradients is not UNPATCHED:  # each call looks
        assert time.monotonic() < deadline, "the ended thread's patch is still in force"
        time.sleep(0.01)
    run_in_thread(lambda: seen.append(active_checkpoints()))
    assert seen == [None]
    assert tf.gradients is UNPATCHED and active_checkpoints() is None
    assert keras.optimizers.Optimizer.apply is stock_apply


def test_the_main_threads_patch_holds_while_the_interpreter_shuts_down(monkeypatch):
    """Then the main thread reads as ended; other threads and atexit
    handlers still run, and its patch still holds for them."""
    msg.patch_tf_gradients("memory")
    try:
        monkeypatch.setattr(threading.main_thread(), "is_alive", lambda: False)
        seen = []
        thread = threading.Thread(target=lambda: seen.append(active_checkpoints()))
        thread.start()
        thread.join(timeout=60)
        assert seen == ["memory"] and active_checkpoints() == "memory"
    finally:
        monkeypatch.undo()
        msg.unpatch_tf_gradients()
    assert tf.gradients is UNPATCHED


def test_a_function_put_in_place_by_the_user_is_left_alone():
    mine = msg.gradients_speed
    msg.patch_tf_gradients("memory")
    tf.__dict__["gradients"] = mine
    try:
        msg.unpatch_tf_gradients()
        assert tf.gradients is mine
    finally:
        tf.__dict__["gradients"] = UNPATCHED
