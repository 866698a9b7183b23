"""tf.gradients' walk of a tf.function's graph, without a scan of its captures per tensor.

Before it makes a gradient op, tf.gradients marks every op reachable from its
xs, asking each tensor it reaches for its consumers
(`gradients_util._Consumers`). That also looks for the tensor among the
captures of each enclosing function graph, by comparing it with every
capture: O(captures) per tensor reached. A training step captures every
variable it reads (1,030 on the 256-block residual MLP), and a rewrite walks
more tensors than one stock call does (its first and last calls walk the
whole graph, each level its own segment): 17,898 lookups against stock's
3,599 there, 1.7 s of the rewrite.

Within `indexed()` the lookup goes through an index of each captures list by
tensor id, built once per list (TensorFlow makes a new list when a capture is
added): the same consumers in the same order, in time linear in the tensors
reached. The stock lookup is back once no `indexed()` block is open.
"""

from __future__ import annotations

import contextlib
import threading

from memory_saving_gradients.tfgraph import compat

_lock = threading.Lock()
_open = 0  # indexed() blocks open, in any thread
_stock = compat.gradient_consumers_lookup()
# function graph -> (its captures list when indexed, {id(outer tensor): [placeholders]});
# emptied when the last block closes, so no graph is kept alive by it.
_indexes: dict = {}


@contextlib.contextmanager
def indexed():
    """Makes tf.gradients' consumer lookups in this block (and in other
    threads meanwhile, which get the same answers) use capture indexes."""
    global _open
    with _lock:
        if _open == 0:
            compat.set_gradient_consumers_lookup(_consumers)
        _open += 1
    try:
        yield
    finally:
        with _lock:
            _open -= 1
            if _open == 0:
                compat.set_gradient_consumers_lookup(_stock)
                _indexes.clear()


def _consumers(tensor, func_graphs) -> list:
    """`gradients_util._Consumers`: the consumers of `tensor`, and those of the
    placeholders standing for it in `func_graphs` (recursively)."""
    consumers = tensor.consumers()
    for func in func_graphs:
        for placeholder in _placeholders_of(func).get(id(tensor), ()):
            consumers.extend(_consumers(placeholder, func_graphs))
    return consumers


def _placeholders_of(func) -> dict:
    """{id(outer tensor): its placeholders in `func`, in capture order}, for
    `func`'s current captures. The index holds the list, so the ids stay valid."""
    pairs = func.captures
    entry = _indexes.get(func)
    if entry is None or entry[0] is not pairs:
        index = {}
        for outer, placeholder in pairs:
            index.setdefault(id(outer), []).append(placeholder)
        entry = _indexes[func] = (pairs, index)
    return entry[1]
