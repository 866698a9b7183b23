"""Which tf.function-style (v2) while loops may be rerun during backprop.

Rerunning a loop late frees the per-iteration state its gradient keeps, most
of a recurrent network's memory. A rerun must see what the forward pass saw:

* its condition and body draw no random numbers and write no state; reading
  variables is allowed;
* no variable it reads can be assigned between the forward pass and the
  rerun;
* its body holds no nested functional op (If, While, Case, function calls):
  the rerun differentiates function graphs rebuilt from their FunctionDefs,
  and those lose what nested control flow needs (resource handle data, the
  gradient functions of inner loops); tf.gradients then raises or silently
  gives wrong gradients.

Anything else is kept, as any stateful op is.
"""

import tensorflow as tf
from tensorflow.python.framework import op_def_registry

LOOP_OP_TYPES = frozenset({"While", "StatelessWhile"})

# Stateful ops that only read a variable: rerunning them gives the same value
# as long as nothing assigns the variable in between.
_READ_OP_TYPES = frozenset({"ReadVariableOp", "VariableShape", "VarIsInitializedOp"})
# Ops that pass a resource handle on unchanged.
_FORWARDING_OP_TYPES = frozenset({"Identity", "IdentityN"})


def is_rerunnable_loop(op):
    """True if `op` is a v2 while loop that gives the same values when rerun."""
    if op.type not in LOOP_OP_TYPES:
        return False
    for part in ("cond", "body"):
        function = _find_function(op.graph, op.get_attr(part).name)
        if function is None or not all(
                _is_plain_read_only(node) for node in function.cached_definition.node_def):
            return False
    return not _assigned_meanwhile(op)


def _find_function(graph, name):
    """The graph function `name`, from `graph` or a graph enclosing it, or None."""
    while graph is not None:
        function = graph._get_function(name)  # pylint: disable=protected-access
        if function is not None:
            return function
        graph = getattr(graph, "outer_graph", None)
    return None


def _called_functions(node):
    """Names of the graph functions a NodeDef runs: by attr or as its op type."""
    names = [value.func.name for value in node.attr.values() if value.func.name]
    names += [f.name for value in node.attr.values() for f in value.list.func]
    if op_def_registry.get(node.op) is None:
        names.append(node.op)
    return names


def _is_plain_read_only(node):
    """True if the NodeDef runs no function and is stateless or a variable read."""
    if _called_functions(node):
        return False
    return node.op in _READ_OP_TYPES or not op_def_registry.get(node.op).is_stateful


def _may_write(op):
    """True if `op` may write a resource it is given (conservative)."""
    if op.type in _READ_OP_TYPES or op.type in _FORWARDING_OP_TYPES:
        return False
    names = _called_functions(op.node_def)
    if names:
        return not all(_only_reads(op.graph, name, set()) for name in names)
    return op.op_def.is_stateful


def _only_reads(graph, name, seen):
    """True if function `name` and those it calls hold no stateful op but reads."""
    if name in seen:
        return True
    seen.add(name)
    function = _find_function(graph, name)
    if function is None:
        return False
    for node in function.cached_definition.node_def:
        called = _called_functions(node)
        if called:
            if not all(_only_reads(graph, n, seen) for n in called):
                return False
        elif node.op not in _READ_OP_TYPES and op_def_registry.get(node.op).is_stateful:
            return False
    return True


def _assigned_meanwhile(loop):
    """True if an op may assign a resource `loop` reads after the loop has run.

    Writers that run before the loop (its ancestors, e.g. through the control
    edges tf.function adds between stateful ops in program order) and variable
    initializers are harmless; any other writer may run between the forward
    pass and the rerun (e.g. a GAN step that updates one model before
    differentiating the other), and a rerun would read the new value.
    """
    handles = [t for t in loop.inputs if t.dtype == tf.resource]
    writers = set()
    while handles:
        for consumer in handles.pop().consumers():
            if consumer.type in _FORWARDING_OP_TYPES:
                handles.extend(consumer.outputs)
            elif consumer is not loop and _may_write(consumer):
                writers.add(consumer)
    writers -= _initializers(loop.graph)
    return bool(writers) and not writers <= _ancestors(loop)


def _initializers(graph):
    """The initializer ops of the graph's tf.compat.v1 variables."""
    variables = (graph.get_collection("variables") + graph.get_collection("local_variables"))
    return {v.initializer for v in variables if getattr(v, "initializer", None) is not None}


def _ancestors(op):
    """Ops `op` waits for, through data and control edges."""
    seen = set()
    stack = [op]
    while stack:
        child = stack.pop()
        for parent in [t.op for t in child.inputs] + list(child.control_inputs):
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return seen
