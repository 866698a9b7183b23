"""Identical ops run as one (tfgraph/duplicate_ops.py): the memory model counts one buffer.

NASNet's cells each apply their own ReLU, then their own zero padding, to one
tensor; TensorFlow runs such twins as one op. Counted apart, tf.gradients'
activation peak of NASNetMobile was predicted at 1.33x its measured peak.
"""

import dataclasses

import pytest
import tensorflow as tf

import memory_saving_gradients as msg
from benchmarks.live_set_diff import activation_peak
from benchmarks.live_set_diff import allocator_events
from memory_saving_gradients.core import timeline
from memory_saving_gradients.tfgraph import duplicate_ops

MIB = 2**20


def test_twins_merge_into_the_first_and_their_twins_too():
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4, 6, 6, 2])
        relus = [tf.nn.relu(x) for _ in range(3)]
        # Each pad has a paddings constant of its own, equal in value.
        pads = [tf.pad(r, [[0, 0], [1, 1], [1, 1], [0, 0]]) for r in relus]
        wider = tf.pad(relus[1], [[0, 0], [2, 2], [2, 2], [0, 0]])
        leaky = [tf.nn.leaky_relu(x, alpha=a) for a in (0.1, 0.2)]
        noisy = [x + tf.random.normal([4, 6, 6, 2]) for _ in range(2)]
        with tf.control_dependencies([wider.op]):
            waiting = tf.nn.relu(x)
    ops = graph.get_operations()
    wanted = {t.name for op in ops for t in op.outputs}
    merged = duplicate_ops.merged_outputs(ops, wanted)
    assert merged[relus[1].name] == relus[0].name
    assert merged[relus[2].name] == relus[0].name
    # Their pads read the same merged tensor and equal constants.
    assert merged[pads[1].name] == pads[0].name and merged[pads[2].name] == pads[0].name
    # Other paddings, other attributes, random draws, other control inputs: apart.
    assert wider.name not in merged
    assert leaky[1].name not in merged
    assert noisy[1].name not in merged
    assert waiting.name not in merged


def _twin_relus_step():
    """Four ReLUs of one 2 MiB tensor, each read by its own matmul's weight
    gradient (so kept to backprop): (step, its plan, x)."""
    weights = [tf.Variable(tf.random.stateless_normal([512, 512], seed=[k, 1], stddev=0.05))
               for k in range(4)]
    found = {}

    @tf.function
    def step(x, _):
        h = tf.sin(x)
        outs = [tf.matmul(tf.nn.relu(h), w) for w in weights]
        loss = tf.add_n([tf.reduce_sum(tf.tanh(o)) for o in outs])
        found["plan"] = msg.checkpoint_plan(loss, [x] + weights, [])
        return tf.gradients(loss, [x] + weights)

    x = tf.random.stateless_normal([1024, 512], seed=[3, 4])
    step(x, None), step(x, None)
    return step, found["plan"], x


def test_the_stock_peak_counts_twins_once():
    step, plan, x = _twin_relus_step()
    assert len(plan.model.merged) == 3
    measured = activation_peak(allocator_events(step, x, None))
    _, predicted = timeline.step_peaks(plan.model)
    # 12.0 MiB predicted; 12.0 measured alone, 10.0 beside another test
    # process (backprop's order then frees one ReLU gradient sooner).
    assert predicted == pytest.approx(measured, rel=0.25), (predicted / MIB, measured / MIB)
    # Counted apart, three more 2 MiB ReLU outputs: 18 MiB.
    _, apart = timeline.step_peaks(dataclasses.replace(plan.model, merged={}))
    assert apart > 1.45 * measured, (apart / MIB, measured / MIB)
