"""Where in a graph ops were made that no GradientTape recorded.

`record.stop_recording` pauses every tape without popping it (TensorFlow
wraps tf.stop_gradient, init_scope, recompute_grad and distribute code in
it) and `import_graph_def` adds ops no tape sees. The tape hook wraps both
(compat.wrap_unrecorded_op_makers(noting)) and asks `spans(graph)`. A nested
tf.function's call op is made in such a pause and then recorded by hand
(`record_operation`, wrapped by compat.wrap_tape_recorders(noting_recorded)):
`recorded_by_hand(graph)` holds those ops.
"""

import functools
import weakref
from typing import List, Tuple

import tensorflow as tf

from memory_saving_gradients.tfgraph import compat

# graph -> [(start, end)]: ops with start < creation version <= end were not recorded.
_spans = weakref.WeakKeyDictionary()
# graph -> names of ops a tape recorded by hand, though made in such a span.
_by_hand = weakref.WeakKeyDictionary()


def spans(graph) -> List[Tuple[int, int]]:
    """The graph-version spans of `graph` whose ops no tape recorded."""
    return _spans.get(graph, [])


def recorded_by_hand(graph) -> set:
    """Names of the ops of `graph` that a tape recorded after they were made."""
    return _by_hand.get(graph, set())


def noting_recorded(record_operation):
    """`record_operation`, noting the ops of its outputs when a tape takes them."""
    @functools.wraps(record_operation)
    def wrapped(op_type, output_tensors, input_tensors, *args, **kwargs):
        if not tf.executing_eagerly() and compat.tape_would_record(input_tensors):
            for tensor in output_tensors:
                if tf.is_symbolic_tensor(tensor):
                    _by_hand.setdefault(tensor.graph, set()).add(tensor.op.name)
        return record_operation(op_type, output_tensors, input_tensors, *args, **kwargs)
    return wrapped


def noting(make):
    """`make` (a function or a context manager factory), noting the versions it spans."""
    @functools.wraps(make)
    def wrapped(*args, **kwargs):
        if tf.executing_eagerly():
            return make(*args, **kwargs)
        graph = tf.compat.v1.get_default_graph()
        start = graph.version
        result = make(*args, **kwargs)
        if not hasattr(result, "__enter__"):
            _spans.setdefault(graph, []).append((start, graph.version))
            return result
        return _Noted(result, graph)
    return wrapped


class _Noted:
    """A context manager whose body's ops are noted as unrecorded."""

    def __init__(self, inner, graph):
        self.inner, self.graph, self.start = inner, graph, None

    def __enter__(self):
        self.start = self.graph.version
        return self.inner.__enter__()

    def __exit__(self, *exc):
        _spans.setdefault(self.graph, []).append((self.start, self.graph.version))
        return self.inner.__exit__(*exc)
