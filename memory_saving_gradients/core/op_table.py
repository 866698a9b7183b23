"""Per-op facts the planner asks for many times, worked out once per model.

No TensorFlow. A strategy prices a dozen candidate plans, and each replay of
the timeline asks every op (forward, recomputed and differentiated) for its
activation inputs, what its gradient reads and which gradients it makes.
Those depend on the model only; deriving them from the graph on every
question (networkx predecessor walks) was most of the planning time on
10,000-op models. `rows(model)` derives them in one pass and keeps them while
the model is in use.

Models are treated as immutable once planned (as the strategies do).
"""

from __future__ import annotations

import dataclasses

from memory_saving_gradients.core.model import GraphModel

_MAX_MODELS = 16  # models whose tables are kept (a process plans a few at a time)
_CACHE = {}       # id(model) -> (model, {what: value}); the model is held, so ids stay unique


@dataclasses.dataclass(frozen=True)
class OpRow:
    """What the timeline needs of one op.

    Attributes:
      inputs: activation tensors it reads, each once, in graph order.
      outputs: its activation outputs.
      reads: activations its gradient reads (`gradient_reads`), then the tensors
        made outside the region it reads (`GraphModel.outside_reads`).
      grads: (input, bytes) for each floating input its gradient makes a gradient for.
      passed: (input, output) pairs: the input's gradient is that output's
        gradient itself (`GraphModel.passed_grads`).
      op_type: the type of the op (of its first output).
      cost: FLOPs of running it once.
      forwards: output -> inputs whose buffer it may take (`GraphModel.forwarding`).
      grad_forwards: input -> candidates whose buffer its gradient may take
        (`GraphModel.forwarded_grads`).
      scratch_forwards: (candidate, bytes) the gradient's scratch shrinks by
        where the candidate dies with it (`GraphModel.workspace_forwards`).
      stock_grad_forwards, stock_scratch_forwards: the same for stock
        tf.gradients (the model's `stock_` fields where they differ).
    """
    inputs: tuple
    outputs: tuple
    reads: tuple
    grads: tuple
    op_type: str
    cost: int
    passed: tuple = ()
    forwards: dict = dataclasses.field(default_factory=dict)
    grad_forwards: dict = dataclasses.field(default_factory=dict)
    scratch_forwards: tuple = ()
    stock_grad_forwards: dict = dataclasses.field(default_factory=dict)
    stock_scratch_forwards: tuple = ()


def per_model(model: GraphModel, what: str, build):
    """`build(model)`, computed once per model and `what` while the model is cached."""
    entry = _CACHE.get(id(model))
    if entry is None or entry[0] is not model:
        if len(_CACHE) >= _MAX_MODELS:
            _CACHE.clear()
        entry = _CACHE[id(model)] = (model, {})
    if what not in entry[1]:
        entry[1][what] = build(model)
    return entry[1][what]


def rows(model: GraphModel) -> dict:
    """Op name -> its `OpRow`, for every op of the model. O(size of the model) once."""
    return per_model(model, "rows", _build_rows)


def order(model: GraphModel) -> tuple:
    """Op names in topological order (by their first output in `model.order`)."""
    return per_model(model, "order",
                     lambda m: tuple(dict.fromkeys(m.tensors[n].op for n in m.order)))


def forward_order(model: GraphModel) -> tuple:
    """Op names in the order the forward pass runs them (by their first output in
    `model.forward_order`, or in `model.order` where that is empty)."""
    return per_model(model, "forward_order", lambda m: tuple(dict.fromkeys(
        m.tensors[n].op for n in m.forward_order or m.order)))


def _build_rows(model):
    graph, tensors = model.graph, model.tensors
    table = {}
    for op, outputs in model.op_outputs.items():
        inputs = tuple(dict.fromkeys(p for o in outputs for p in graph.predecessors(o)))
        reads = model.grad_reads[op] if op in model.grad_reads else inputs + tuple(outputs)
        reads = tuple(reads) + model.outside_reads.get(op, ())
        first = tensors[outputs[0]]
        ungraded = model.ungraded.get(op, ())
        table[op] = OpRow(
            inputs=inputs, outputs=tuple(outputs), reads=tuple(reads),
            grads=tuple((t, tensors[t].bytes) for t in inputs
                        if tensors[t].is_float and t not in ungraded),
            op_type=first.op_type, cost=first.cost, passed=tuple(model.passed_grads.get(op, ())),
            forwards=dict(model.forwarding.get(op, ())),
            grad_forwards=dict(model.forwarded_grads.get(op, ())),
            scratch_forwards=tuple(model.workspace_forwards.get(op, ())),
            stock_grad_forwards=dict(model.stock_forwarded_grads.get(
                op, model.forwarded_grads.get(op, ()))),
            stock_scratch_forwards=tuple(model.stock_workspace_forwards.get(
                op, model.workspace_forwards.get(op, ()))))
    return table
