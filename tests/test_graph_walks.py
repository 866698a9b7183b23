"""graph_walks: the data-edge walks the TF room shares."""

import tensorflow as tf

from memory_saving_gradients.tfgraph import graph_walks


def _diamond():
    """x -> a -> (b, c) -> d, and an unrelated e."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2], name="x")
        a = tf.sin(x, name="a")
        b = tf.cos(a, name="b")
        c = tf.stop_gradient(a, name="c")
        d = tf.add(b, c, name="d")
        e = tf.exp(x, name="e")
    return x, a, b, c, d, e


def test_ops_reading_follows_consumers_and_stays_within():
    x, a, b, c, d, e = _diamond()
    assert graph_walks.ops_reading([a]) == {b.op, c.op, d.op}
    assert graph_walks.ops_reading([x], within={a.op, b.op}) == {a.op, b.op}


def test_tensors_feeding_walks_back_where_allowed():
    x, a, b, c, d, e = _diamond()
    assert graph_walks.tensors_feeding([d], lambda t: True) == {id(t) for t in (d, b, c, a, x)}
    not_through_stops = graph_walks.tensors_feeding(
        [d], lambda t: t.op.type != "StopGradient")
    assert not_through_stops == {id(t) for t in (d, b, c, a, x)}  # a is reached through b
    neither = graph_walks.tensors_feeding([d], lambda t: t.op.type not in ("Cos", "StopGradient"))
    assert neither == {id(t) for t in (d, b, c)}
    stopped_at_d = graph_walks.tensors_feeding([d], lambda t: t is not d)
    assert stopped_at_d == {id(d)}
    assert id(e) not in graph_walks.tensors_feeding([d, x], lambda t: True)


def test_tensors_feeding_visits_each_tensor_once():
    x, a, b, c, d, e = _diamond()
    asked = []
    graph_walks.tensors_feeding([d], lambda t: asked.append(t) or True)
    assert sorted(t.name for t in asked) == sorted(t.name for t in (d, b, c, a, x))
