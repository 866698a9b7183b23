"""tf.gradients in a tf.function's graph, without a scan of its captures per tensor.

tf.gradients crosses function boundaries through captures with two lookups
that compare a tensor with every capture of a function graph, O(captures)
each: a tensor's consumers, asked for every tensor its first walk reaches
(`gradients_util._Consumers`, through the placeholders capturing it), and
the outer tensor a placeholder input stands for, asked for every input of
every op it differentiates (`_MaybeCaptured`). A training step captures
every variable it reads (1,030 on the 256-block residual MLP), and a
rewrite walks more tensors than one stock call does (its first and last
calls walk the whole graph, each level its own segment): 17,898 consumer
lookups against stock's 3,599 there, 1.7 s of the rewrite.

Within `indexed()` both look the tensor up by id in an index of each
captures list, built once per list (TensorFlow makes a new list when a
capture is added): the same answers in the same order, in time linear in
the tensors reached. The stock lookups are back once no block is open.
"""

from __future__ import annotations

import contextlib
import threading

from memory_saving_gradients.tfgraph import compat

_lock = threading.Lock()
_open = 0  # indexed() blocks open, in any thread
_stock = compat.gradient_capture_lookups()
# function graph -> (its captures list when indexed, {id(outer tensor):
# [placeholders]}, {id(placeholder): outer tensor}); emptied when the last
# block closes, so no graph is kept alive by it.
_indexes: dict = {}


@contextlib.contextmanager
def indexed():
    """Makes tf.gradients' capture lookups in this block (and in other
    threads meanwhile, which get the same answers) use capture indexes."""
    global _open
    with _lock:
        if _open == 0:
            compat.set_gradient_capture_lookups(_consumers, _outer_tensor)
        _open += 1
    try:
        yield
    finally:
        with _lock:
            _open -= 1
            if _open == 0:
                compat.set_gradient_capture_lookups(*_stock)
                _indexes.clear()


def _consumers(tensor, func_graphs) -> list:
    """`gradients_util._Consumers`: the consumers of `tensor`, and those of the
    placeholders standing for it in `func_graphs` (recursively)."""
    consumers = tensor.consumers()
    for func in func_graphs:
        for placeholder in _index_of(func)[1].get(id(tensor), ()):
            consumers.extend(_consumers(placeholder, func_graphs))
    return consumers


def _outer_tensor(tensor):
    """`gradients_util._MaybeCaptured`: the outer tensor a function graph's
    placeholder captures (recursively), else `tensor` itself."""
    if (not compat.is_eager_tensor(tensor) and compat.builds_function(tensor.op.graph)
            and tensor.op.type == "Placeholder"):
        outer = _index_of(tensor.op.graph)[2].get(id(tensor))
        if outer is not None:
            return _outer_tensor(outer)
    return tensor


def _index_of(func) -> tuple:
    """(captures, placeholders by outer tensor id, outer tensor by placeholder
    id) for `func`'s current captures, in capture order (the first wins, as
    in the stock scans). The entry holds the list, so the ids stay valid."""
    pairs = func.captures
    entry = _indexes.get(func)
    if entry is None or entry[0] is not pairs:
        placeholders, outers = {}, {}
        for outer, placeholder in pairs:
            placeholders.setdefault(id(outer), []).append(placeholder)
            outers.setdefault(id(placeholder), outer)
        entry = _indexes[func] = (pairs, placeholders, outers)
    return entry
