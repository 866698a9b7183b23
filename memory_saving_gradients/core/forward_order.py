"""The order the planner takes the forward pass to run in: creation order, with
the ops that free memory moved up to where they can run, as TensorFlow's
executor may run them.

No TensorFlow. Ops are made in the order the model's code calls them, and Keras
calls a functional model's layers by depth (`Functional._run_through_graph`): a
branch with a short way to the output is called after the deep path, however
early its inputs exist. A WaveNet's skip convolutions and the running sum of
their outputs come last, so in creation order every layer's gate and skip
output looks alive to the end of the forward pass. The executor runs an op
once its inputs are made; those branches run within their layer.

Moving every op to when it is ready is not the executor's order either (with
one inter-op thread it defers the expensive ops it hands over). Moved here are
the ops whose outputs are no larger than the inputs they are the last reader
of in the forward pass (what backprop holds depends on the plan, which is not
known yet), so moving them frees memory sooner. Such an op
runs as soon as those inputs, and their other readers (so it still frees
them), are made. From its new place to its old one it frees at least what it
makes; only its own step, its inputs and outputs alive together, may land
beside more (at most its outputs more). Where the executor does not run it
early, the model misses what it frees.

Backprop keeps creation order, reversed (`GraphModel.order`): a gradient reaches
first the branches with a short way back from the loss, which Keras called last.
"""

import heapq
from typing import Mapping, Sequence

import networkx as nx


def freeing_ops_sooner(order: Sequence[str], graph: nx.DiGraph, op_of: Mapping[str, str],
                       tensor_bytes: Mapping[str, int], ys=()) -> tuple:
    """Tensor names of `order` (a topological order of `graph`, tensor -> reader's
    tensors) with each op that frees at least what it makes placed as soon as
    what it waits for is (its inputs, and the other readers of the inputs it
    frees; ready ops first in, first out), the other ops in their order. `op_of`:
    tensor -> its op, whose outputs come together in the result; a tensor of `ys`
    is never freed. O((n + e) log n) for n tensors and e edges.

    >>> import networkx as nx
    >>> chain = nx.DiGraph(["ab", "bc", "cd", "de"])  # a main path; p, q branch off it
    >>> g = nx.compose(chain, nx.DiGraph(["ap", "cq", "pr", "qr"]))  # r: p + q, made last
    >>> "".join(freeing_ops_sooner("abcdepqr", g, {t: t for t in g}, dict.fromkeys(g, 1)))
    'abcpdeqr'
    """
    ops = list(dict.fromkeys(op_of[t] for t in order))
    position = {op: i for i, op in enumerate(ops)}
    outputs = {op: [] for op in ops}
    for t in order:
        outputs[op_of[t]].append(t)
    ys = frozenset(ys)
    readers = {t: {op_of[r] for r in graph.successors(t)} for t in order}
    last_reader = {t: max(readers[t], key=position.__getitem__)
                   for t in order if readers[t] and t not in ys}
    waits = {}
    for op in ops:
        inputs = {p for t in outputs[op] for p in graph.predecessors(t)}
        freed = [t for t in inputs if last_reader.get(t) == op]
        made = sum(tensor_bytes[t] for t in outputs[op])
        if freed and made <= sum(tensor_bytes[t] for t in freed):
            waits[op] = ({op_of[t] for t in inputs}
                         | {r for t in freed for r in readers[t]}) - {op}
    waiting_on = {op: len(before) for op, before in waits.items()}
    released = {}
    for op, before in waits.items():
        for other in before:
            released.setdefault(other, []).append(op)
    placed = []
    for op in ops:
        if op in waits:
            continue
        # First ready, first placed (the executor's queue); ties in creation order.
        ready = [(0, position[op])]
        while ready:
            _, index = heapq.heappop(ready)
            placed.append(ops[index])
            for waiting in released.get(ops[index], ()):
                waiting_on[waiting] -= 1
                if not waiting_on[waiting]:
                    heapq.heappush(ready, (len(placed), position[waiting]))
    if len(placed) != len(ops):
        raise ValueError("freeing_ops_sooner: `order` is not a topological order of "
                         "`graph` (an op reads its own output or a tensor not in `order`)")
    return tuple(t for op in placed for t in outputs[op])
