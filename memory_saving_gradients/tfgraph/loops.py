"""Which tf.function-style (v2) while loops may be rerun during backprop.

Rerunning a loop late frees the per-iteration state its gradient keeps, most
of a recurrent network's memory. A rerun must see what the forward pass saw:

* its condition and body draw no random numbers and write no state; reading
  variables is allowed;
* its body holds no nested functional op (If, While, Case, function calls):
  the rerun differentiates function graphs rebuilt from their FunctionDefs,
  and those lose what nested control flow needs (resource handle data, the
  gradient functions of inner loops); tf.gradients then raises or silently
  gives wrong gradients;
* no variable it reads may be assigned between the forward pass and the
  rerun, through any handle that may point to it.

Anything else is kept, as any stateful op is.
"""

import tensorflow as tf
from tensorflow.python.framework import op_def_registry

from memory_saving_gradients.tfgraph import effects

LOOP_OP_TYPES = frozenset({"While", "StatelessWhile"})

# Stateful ops that only read a variable: rerunning them gives the same value
# as long as nothing assigns the variable in between.
_READ_OP_TYPES = frozenset({"ReadVariableOp", "VariableShape", "VarIsInitializedOp"})
# Ops that run Python, which may assign any variable without taking its handle.
_PYTHON_OP_TYPES = frozenset({"PyFunc", "EagerPyFunc"})


def rerunnable_loops(ops):
    """The v2 while loops among `ops` (of one graph) that give the same values when rerun."""
    loops = [op for op in ops if op.type in LOOP_OP_TYPES]
    if not loops:
        return set()
    state = _GraphState(loops[0].graph)
    return {op for op in loops if state.body_is_plain(op) and not state.assigned_meanwhile(op)}


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


def _stateless_or_read(op_type):
    """True if a registered op type reruns identically or only reads a variable."""
    return op_type in _READ_OP_TYPES or effects.reruns_identically(op_def_registry.get(op_type))


def _resources(tensors):
    return [t for t in tensors if t.dtype == tf.resource]


class _GraphState:
    """What a graph does to its resources, read once for all of its loops."""

    def __init__(self, graph):
        self._graph = graph
        self._only_reads_memo = {}
        self._after = {}  # writer -> the ops that wait for it
        self._group = {}  # handle tensor name -> a representative (union-find)
        self._writers = []  # (op, group representatives it may write, or None for any)
        ops = graph.get_operations()
        self._group_handles(ops)
        for op in ops:
            if op.type not in LOOP_OP_TYPES and self._may_write(op):
                handles = _resources(op.inputs)
                # Without a handle input, only Python or a function may find a
                # variable (by its shared name); stateful ops like random ones write none.
                self._writers.append((op, {self._find(t.name) for t in handles} if handles
                                      else None))
        variables = graph.get_collection("variables") + graph.get_collection("local_variables")
        self._initializers = {getattr(v, "initializer", None) for v in variables}

    def body_is_plain(self, loop):
        """True if the loop's cond and body run only stateless ops and variable reads."""
        for part in ("cond", "body"):
            function = _find_function(self._graph, loop.get_attr(part).name)
            if function is None:
                return False
            for node in function.cached_definition.node_def:
                if _called_functions(node) or not _stateless_or_read(node.op):
                    return False
        return True

    def assigned_meanwhile(self, loop):
        """True if an op may assign a resource `loop` reads after the loop has run.

        Harmless writers: variable initializers, writers the loop waits for, and
        in a tf.function writers of the very handle the loop reads made before
        it (tf.function orders those in program order when tracing ends). Any
        other writer may run between the forward pass and the rerun (e.g. a
        GAN step that updates one model before differentiating the other).
        """
        handles = _resources(loop.inputs)
        if not handles:
            return False
        names = {t.name for t in handles}
        read = {self._find(n) for n in names}
        ordered = getattr(self._graph, "_add_control_dependencies", False)
        for writer, written in self._writers:
            if written is not None and not written & read:
                continue
            if writer is loop or writer in self._initializers:
                continue
            if (ordered and writer._id < loop._id  # pylint: disable=protected-access
                    and names & {t.name for t in writer.inputs}):
                continue
            if loop not in self._waiting_for(writer):
                return True
        return False

    # -- which handles may point to the same resource --

    def _find(self, name):
        root = self._group.setdefault(name, name)
        while root != self._group[root]:
            root = self._group[root]
        self._group[name] = root
        return root

    def _union(self, names):
        roots = [self._find(n) for n in names]
        for root in roots[1:]:
            self._group[root] = roots[0]

    def _group_handles(self, ops):
        """Joins handles that may alias: what an op's resource outputs point to
        may be any of its resource inputs (Identity, calls, If, While, Switch,
        Enter...); VarHandleOps with one shared name are one variable; any two
        resource arguments of a tf.function may be the same variable."""
        by_shared_name = {}
        arguments = []
        captured = {id(t) for t in getattr(self._graph, "internal_captures", ())}
        for op in ops:
            outputs = [t.name for t in _resources(op.outputs)]
            if not outputs:
                continue
            if op.type == "VarHandleOp":
                key = (op.get_attr("container"), op.get_attr("shared_name") or op.name)
                by_shared_name.setdefault(key, []).extend(outputs)
            elif op.type == "Placeholder":
                if id(op.outputs[0]) not in captured:
                    arguments.extend(outputs)
            else:
                self._union(outputs + [t.name for t in _resources(op.inputs)])
        for names in list(by_shared_name.values()) + [arguments]:
            self._union(names)

    # -- who writes --

    def _may_write(self, op):
        """True if `op` may assign a variable (conservative)."""
        if op_def_registry.get(op.type) is not None and _stateless_or_read(op.type):
            return False
        names = _called_functions(op.node_def)
        if names:
            return not all(self._only_reads(name, set()) for name in names)
        return bool(_resources(op.inputs)) or op.type in _PYTHON_OP_TYPES

    def _only_reads(self, name, seen):
        """True if function `name` and those it calls hold no stateful op but reads."""
        if name in self._only_reads_memo:
            return self._only_reads_memo[name]
        if name in seen:
            return True
        seen.add(name)
        function = _find_function(self._graph, name)
        result = function is not None
        for node in function.cached_definition.node_def if result else ():
            called = _called_functions(node)
            if called:
                result = all(self._only_reads(n, seen) for n in called)
            else:
                result = _stateless_or_read(node.op)
            if not result:
                break
        self._only_reads_memo[name] = result
        return result

    def _waiting_for(self, writer):
        """Ops that run after `writer`: its descendants by data and control edges."""
        if writer not in self._after:
            after = set()
            stack = [writer]
            while stack:
                op = stack.pop()
                for child in [c for t in op.outputs for c in t.consumers()] + op._control_outputs:  # pylint: disable=protected-access
                    if child not in after:
                        after.add(child)
                        stack.append(child)
            self._after[writer] = after
        return self._after[writer]
