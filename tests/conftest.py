"""Test setup shared by every test file: environment, the runtime fixture, and the
fixtures several test files use (the tape tests' weights, the API tests' chain,
the loop tests' mode).

The stock-versus-ours harness lives in harness.py; shared models in models.py.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Allocator statistics for function_peak_bytes on any CPU (see measure.py).
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "1")
# TensorFlow's own CPU kernels on every host: with oneDNN (on by default where the
# CPU has AVX-512 VNNI or AMX) convolution gradients take no scratch, and the
# memory tests would measure another host's kernels. test_onednn_hosts.py runs
# with oneDNN on.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from harness import RUNTIMES  # noqa: E402
from memory_saving_gradients.core import loop_plans  # noqa: E402
from memory_saving_gradients.core import strategies  # noqa: E402
from memory_saving_gradients.core.planning import LoopModes  # noqa: E402


@pytest.fixture(autouse=True)
def _rewrite_where_stock_is_predicted_lower(request, monkeypatch):
    """Most tests check the rewrite on toy graphs, where 'memory' and 'speed'
    would leave the gradient to tf.gradients (no plan predicted below it);
    tests marked `stock_fallback` check that fallback itself."""
    if request.node.get_closest_marker("stock_fallback") is None:
        monkeypatch.setattr(strategies, "STOCK_FALLBACK", False)


@pytest.fixture(autouse=True)
def _decorator_waits_end_with_the_test():
    """A segment built under RECOMPUTE=1 (which tests switch on by monkeypatch)
    makes Keras optimizers' updates wait for the rest of the run; each test's
    end takes that back, so later tests find the optimizer classes as they were."""
    yield
    layer_decorator = sys.modules.get("memory_saving_gradients.integrations.layer_decorator")
    if layer_decorator is not None:
        optimizer_waits = sys.modules["memory_saving_gradients.integrations.optimizer_waits"]
        optimizer_waits.uninstall(layer_decorator._holds_a_segment)  # pylint: disable=protected-access


@pytest.fixture
def loops_rerun_by_their_levels(monkeypatch):
    """For the tests of a loop a level reruns (or differentiates after the last
    checkpoint): 'memory' may keep a loop in chunks from its forward pass
    where the timeline prices that lower (test_loop_plans.py), so its search
    is left to the default loop mode."""
    monkeypatch.setattr(loop_plans, "settings", lambda model: [LoopModes()])


@pytest.fixture(params=RUNTIMES)
def runtime(request):
    """Each model test runs in a Graph + Session, in a tf.function, and under XLA."""
    return request.param


@pytest.fixture(name="weights")
def _weights():
    """Two tf.Variables for the tape tests: w [8, 8] and u [4, 8]."""
    return (tf.Variable(tf.random.stateless_normal([8, 8], seed=[1, 1]), name="w"),
            tf.Variable(tf.random.stateless_normal([4, 8], seed=[2, 2]), name="u"))


@pytest.fixture
def chain():
    """A 6-layer tanh chain in a fresh default graph: (x, hidden layers, y)."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [8])
        hs = [x]
        for _ in range(6):
            hs.append(tf.tanh(hs[-1]))
        y = tf.reduce_sum(hs[-1])
        yield x, hs[1:], y
