"""Every use of TensorFlow's private modules and attributes, in one place.

A TensorFlow upgrade that moves one of these touches this file only. Each
function is a thin, named accessor; logic lives in the modules that call them.
"""

from __future__ import annotations

import contextlib

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2
from tensorflow.python.eager import backprop_util
from tensorflow.python.eager import forwardprop_util
from tensorflow.python.eager import record
from tensorflow.python.eager import tape as tape_module
from tensorflow.python.framework import auto_control_deps
from tensorflow.python.framework import func_graph as func_graph_module
from tensorflow.python.framework import function_def_to_graph
from tensorflow.python.framework import importer
from tensorflow.python.framework import op_def_registry
from tensorflow.python.framework import ops as tf_ops
from tensorflow.python.ops import control_flow_util
from tensorflow.python.ops import control_flow_util_v2
from tensorflow.python.ops import default_gradient
from tensorflow.python.ops import gradients as gradients_module
from tensorflow.python.ops import gradients_impl
from tensorflow.python.ops import gradients_util
from tensorflow.python.ops import control_flow_v2_func_graphs
from tensorflow.python.ops import handle_data_util
from tensorflow.python.saved_model import save_context

# Captured at import so that patching tf.gradients never makes us call ourselves.
stock_gradients = gradients_impl.gradients
zeros_like_gradient = default_gradient.zeros_like
unique_id = tf_ops.uid


def op_def(op_type: str):
    """The registered OpDef of `op_type`, or None for a graph function's name."""
    return op_def_registry.get(op_type)


def gradient_function(op: tf.Operation):
    """The registered gradient function of `op` (None if not differentiable)."""
    return tf_ops.get_gradient_function(op)


def gradient_overridden(op: tf.Operation) -> bool:
    """True if a gradient_override_map gave `op` another gradient than its type's."""
    return "_gradient_op_type" in op.node_def.attr


def override_tapes_ignore(op: tf.Operation) -> str | None:
    """The name of the gradient a gradient_override_map gave `op`, where a
    GradientTape ignores it (tf.gradients uses it); None if it has none, or
    it is a `tf.custom_gradient`'s, which tapes record too."""
    override = op.node_def.attr.get("_gradient_op_type")
    if override is None or override.s.startswith(b"CustomGradient"):
        return None
    return override.s.decode()


def creation_id(op: tf.Operation) -> int:
    """A number that grows with op creation within a graph."""
    return op._id  # pylint: disable=protected-access


def creation_version(op: tf.Operation) -> int:
    """`op.graph.version` just after `op` was added (versions count added ops)."""
    return op._id - 1  # pylint: disable=protected-access


def wrap_unrecorded_op_makers(wrap) -> None:
    """Replaces each TensorFlow function that makes graph ops no tape records.

    `record.stop_recording` (used around tf.stop_gradient, in init_scope,
    recompute_grad, distribute code) pauses every tape without popping it;
    `import_graph_def` adds ops that never reach a tape. Their callers look
    them up on the module at call time, so `wrap(original)` takes effect.
    """
    for module, name in ((record, "stop_recording"), (importer, "_import_graph_def_internal")):
        setattr(module, name, wrap(getattr(module, name)))


def wrap_tape_recorders(wrap) -> None:
    """Replaces the functions that put an op on every recording tape by hand.

    TensorFlow makes a nested function's call op under `stop_recording`
    and then records it with `record_operation` (its backward function is
    the function's own); `wrap(original)` sees those calls. Callers look
    them up on the module at call time.
    """
    for name in ("record_operation", "record_operation_backprop_only"):
        setattr(record, name, wrap(getattr(record, name)))


def gradient_capture_lookups() -> tuple:
    """tf.gradients' lookups across function captures: (a tensor's consumers,
    `_Consumers(tensor, func_graphs)`; the outer tensor of a placeholder,
    `_MaybeCaptured(tensor)`)."""
    return gradients_util._Consumers, gradients_util._MaybeCaptured  # pylint: disable=protected-access


def set_gradient_capture_lookups(consumers, outer_tensor) -> None:
    """Replaces them; tf.gradients looks them up on its module at call time."""
    gradients_util._Consumers = consumers  # pylint: disable=protected-access
    gradients_util._MaybeCaptured = outer_tensor  # pylint: disable=protected-access


def is_eager_tensor(tensor) -> bool:
    return isinstance(tensor, tf_ops.EagerTensor)


def builds_function(graph) -> bool:
    """True for a function's graph (FuncGraph, or a v1 Defun's), as tf.gradients asks."""
    return isinstance(graph, tf.Graph) and graph._building_function  # pylint: disable=protected-access


def folds_constants(graph) -> bool:
    """Whether Grappler's constant folding simplifies `graph`'s arithmetic
    (`x * 1` becomes x, or a copy of it: `identity_folding`) when it runs: for
    a tf.function's graph with the option on. Measured on a chain of 16
    `tf.nn.silu`: the stock step's peak is 33 MB in a tf.function, 48 MB with
    the option off and 48 MB when the same graph runs in a tf.compat.v1.Session;
    with Grappler switched off as a whole (`disable_meta_optimizer`) 48 MB too,
    which a review found predicted at 34."""
    options = tf.config.optimizer.get_experimental_options()
    return (builds_function(graph) and options.get("constant_folding", True)
            and not options.get("disable_meta_optimizer", False))


def tape_would_record(tensors) -> bool:
    """True if a recording (not paused) GradientTape watches one of `tensors`."""
    return record.should_record_backprop(tensors)


def accumulator_would_record(tensors) -> bool:
    """True if an active ForwardAccumulator carries a tangent of one of `tensors`."""
    return bool(forwardprop_util.pack_tangents(tensors).tangents)


def forward_op_of_gradient(op: tf.Operation):
    """The forward op a gradient op was made for (tf.gradients records it)."""
    return op._original_op  # pylint: disable=protected-access


def control_outputs(op: tf.Operation) -> list:
    """Ops that have `op` as a control input."""
    return op._control_outputs  # pylint: disable=protected-access


def add_control_input(op: tf.Operation, control: tf.Operation) -> None:
    """Makes `op` (one the caller created) wait for `control`."""
    op._add_control_input(control)  # pylint: disable=protected-access


def capturing_graph(outer: tf.Graph, name: str, shape_of=None):
    """An empty graph whose ops may read `outer`'s tensors: each one read is
    captured (a placeholder inside; `captured_pairs` lists them), and nothing
    is added to `outer`. `shape_of(tensor)`, where given, is the shape the
    placeholder of each of `outer`'s own value tensors takes (its dimensions
    sized where the tensor leaves them unknown)."""
    with outer.as_default():
        return _SizedCaptures(name, shape_of)


class _SizedCaptures(func_graph_module.FuncGraph):
    """A FuncGraph whose captures of its outer graph's value tensors take the
    shapes `shape_of` gives (TensorFlow's own capture takes the static shape,
    and ignores the `shape` it is passed)."""

    def __init__(self, name, shape_of):
        super().__init__(name)
        self._shape_of = shape_of

    def capture(self, tensor, name=None, shape=None):
        if (self._shape_of is not None and isinstance(tensor, tf.Tensor)
                and not is_eager_tensor(tensor) and tensor.graph is self.outer_graph
                and tensor.dtype not in (tf.resource, tf.variant)
                and not any(outer is tensor for outer, _ in self.captures)):
            dims = self._shape_of(tensor)
            if dims is not None and dims != tensor.shape.as_list():
                # Outside the control dependencies of the op that reads it, as
                # TensorFlow makes its own captures.
                with self.as_default(), tf.control_dependencies(None):
                    placeholder = tf.compat.v1.placeholder(tensor.dtype, dims, name=name)
                self.add_capture(tensor, placeholder)
                return placeholder
        return super().capture(tensor, name, shape)


def is_trainable(tensor: tf.Tensor) -> bool:
    """Whether tapes differentiate `tensor`: float, complex, a resource, or a
    variant that may hold such values (a TensorList of floats)."""
    return backprop_util.IsTrainable(tensor)


@contextlib.contextmanager
def variables_read():
    """Yields a list filled, on leaving, with the trainable variables read
    inside (as `tf.custom_gradient` finds those its function reads)."""
    read = []
    with record.VariableWatcher() as watcher:
        yield read
        read.extend(watcher.watched_variables())


def note_variables_read(variables: list) -> None:
    """Tells active tapes and variable watchers that `variables` were read."""
    for variable in variables:
        tape_module.variable_accessed(variable)


def captured_pairs(graph: tf.Graph) -> list:
    """(captured tensor, the placeholder or constant standing for it) of a
    function's graph (a `capturing_graph`'s among them; a small eager tensor
    is captured as a constant); [] for any other graph."""
    return list(getattr(graph, "captures", ())) if builds_function(graph) else []


def replace_input(op: tf.Operation, index: int, tensor: tf.Tensor) -> None:
    """Makes `op` (one the caller created) read `tensor` as its input `index`."""
    op._update_input(index, tensor)  # pylint: disable=protected-access


def set_device(op: tf.Operation, device: str) -> None:
    """Places an op created with compute_device=False."""
    op._set_device(device)  # pylint: disable=protected-access


def differentiable_source(variable: tf.Variable) -> tf.Tensor:
    """The tensor tf.gradients differentiates for `variable` as an x: a
    resource variable's handle, a v1 reference variable's reference."""
    if hasattr(variable, "handle"):
        return tf.convert_to_tensor(variable.handle)
    return tf_ops.convert_to_tensor(variable, as_ref=True)


def is_ref_dtype(dtype: tf.DType) -> bool:
    return dtype._is_ref_dtype  # pylint: disable=protected-access


def is_function_op(op: tf.Operation) -> bool:
    """True if `op` calls a graph function by its own op type."""
    return op.graph._is_function(op.type)  # pylint: disable=protected-access


def graph_function(graph: tf.Graph, name: str):
    """The graph function `name` registered in `graph` itself, or None."""
    return graph._get_function(name)  # pylint: disable=protected-access


def control_flow_context(op: tf.Operation, output: bool = False):
    """The tf.compat.v1 control-flow context of `op` (with `output`: of its outputs)."""
    if output:
        return control_flow_util.GetOutputContext(op)
    return op._get_control_flow_context()  # pylint: disable=protected-access


def in_xla_context(graph: tf.Graph) -> bool:
    """True if `graph` or an enclosing graph is compiled by XLA (jit_compile)."""
    return control_flow_util.GraphOrParentsInXlaContext(graph)


# while_v2's first two loop inputs (and outputs, and its functions' first two
# arguments): the iteration counter and its maximum_iterations (-1 for none).
WHILE_COUNTER, WHILE_BOUND = 0, 1


def while_function_graph(loop: tf.Operation, name: str):
    """The FuncGraph of a v2 While op's cond or body function `name`."""
    shapes = [tf.TensorShape(s) for s in loop.get_attr("output_shapes")]
    return control_flow_util_v2.get_func_graph(loop, shapes, name)


def while_function_graph_in(loop: tf.Operation, name: str, graph: tf.Graph):
    """`while_function_graph`, but built inside `graph` (a scratch graph):
    what is built from it then lives there, not in `loop`'s graph. It
    differentiates as the loop's traced function: its resource and list
    arguments carry the handle data of the loop's inputs (a cond's gradient
    makes zeros for a variable one branch does not read, and fails without
    it), and its function calls their traced twins' gradient functions (an
    imported call op has none: "no attribute 'python_grad_func'")."""
    function, owner = _registered_function(loop.graph, name)
    if function is None:
        raise KeyError(f"function {name} of {loop.name} not found")
    definition = function.cached_definition
    _add_called_functions(definition, owner, graph)
    shapes = [tf.TensorShape(s) for s in loop.get_attr("output_shapes")]
    with graph.as_default():
        imported = function_def_to_graph.function_def_to_graph(definition, input_shapes=shapes)
    for outer, argument in zip(loop.inputs, imported.inputs):
        if outer.dtype in (tf.resource, tf.variant):
            copy_handle_data(outer, argument)
    traced = next((g for g in (traced_function_graph(loop, part) for part in ("body", "cond"))
                   if g is not None and g.name == name), None)
    if traced is not None:
        traced_ops = {op.name: op for op in traced.get_operations()}
        for op in imported.get_operations():
            gradient = getattr(traced_ops.get(op.name), "_gradient_function", None)
            if gradient is not None:
                op._gradient_function = gradient  # pylint: disable=protected-access
    return imported


def _registered_function(graph: tf.Graph, name: str) -> tuple:
    """(the function `name`, the graph it is registered in): looked up in
    `graph`, then in the graphs it is built in; (None, None) if none has it."""
    while graph is not None:
        function = graph._get_function(name)  # pylint: disable=protected-access
        if function is not None:
            return function, graph
        graph = getattr(graph, "outer_graph", None)
    return None, None


def _add_called_functions(definition, owner: tf.Graph, graph: tf.Graph) -> None:
    """Registers in `graph` the functions `definition` calls through function
    attributes (a nested loop's cond and body), and those they call, found in
    `owner` or a graph it is built in."""
    todo = [definition]
    while todo:
        for node in todo.pop().node_def:
            for name in called_function_names(node):
                if graph._is_function(name):  # pylint: disable=protected-access
                    continue
                found, _ = _registered_function(owner, name)
                if found is not None:
                    graph._add_function(found)  # pylint: disable=protected-access
                    todo.append(found.cached_definition)


def called_function_names(node_def) -> list:
    """Names of the functions a NodeDef's attributes name: a call's function,
    a cond's branches, a loop's cond and body."""
    return [name for attr in node_def.attr.values()
            for name in ([attr.func.name] if attr.HasField("func")
                         else [f.name for f in attr.list.func]) if name]


def function_definition(graph: tf.Graph, name: str):
    """The FunctionDef of the function `name` registered in `graph` or a graph
    it is built in; None if none has it."""
    function, _ = _registered_function(graph, name)
    return None if function is None else function.cached_definition


def outermost_function_graph(graph: tf.Graph) -> tf.Graph:
    """The function graph `graph` is built in at the outermost (`graph` itself
    if it is not built in one): a tf.function's graph for a cond branch or a
    loop body of it."""
    while builds_function(getattr(graph, "outer_graph", None)):
        graph = graph.outer_graph
    return graph


def compiled_call(op: tf.Operation) -> bool:
    """True for a call of a `jit_compile=True` function (XLA compiles it)."""
    try:
        return bool(op.get_attr("_XlaMustCompile"))
    except ValueError:
        return False


def called_function_graphs(op: tf.Operation) -> tuple:
    """(FuncGraphs of the functions `op` runs, the inputs of `op` their
    arguments are): a (Stateful)PartitionedCall's function, or an If's two
    branches or a Case's (their arguments: its inputs after the predicate
    or branch index), imported with the shapes of those inputs; ((), ())
    for other ops or functions not found in `op`'s graph or one it is built
    in."""
    if op.type in ("PartitionedCall", "StatefulPartitionedCall"):
        names, arguments = [op.get_attr("f").name], list(op.inputs)
    elif op.type in ("If", "StatelessIf"):
        names = [op.get_attr(branch).name for branch in ("then_branch", "else_branch")]
        arguments = list(op.inputs[1:])
    elif op.type in ("Case", "StatelessCase"):
        names = [branch.name for branch in op.get_attr("branches")]
        arguments = list(op.inputs[1:])
    else:
        return (), ()
    shapes = [t.shape for t in arguments]
    scratch = tf.Graph()  # holds what the functions call, for the import
    graphs = []
    for name in names:
        function, where = _registered_function(op.graph, name)
        if function is None:
            return (), ()
        definition = function.cached_definition
        _add_called_functions(definition, where, scratch)
        with scratch.as_default():
            graphs.append(function_def_to_graph.function_def_to_graph(definition,
                                                                       input_shapes=shapes))
    return tuple(graphs), tuple(arguments)


def traced_function_graph(loop: tf.Operation, part: str):
    """The FuncGraph while_v2 traced for `loop`'s `part` ('cond', 'body') in
    Python, whose static shapes are complete; None for an imported loop."""
    return getattr(loop, f"_{part}_graph", None)


def set_while_function_graph(loop: tf.Operation, part: str, func_graph) -> None:
    """Makes while_v2 read `loop`'s `part` function from `func_graph`."""
    setattr(loop, f"_{part}_graph", func_graph)


def create_op_copy(graph: tf.Graph, op: tf.Operation, inputs: list, attrs=None,
                   dtypes=None, keep_shapes=False) -> tf.Operation:
    """A new op of `op`'s type reading `inputs`, not yet placed; with `op`'s
    attributes and output dtypes unless `attrs` / `dtypes` are given.
    `keep_shapes`: its outputs also take the static shapes of `op`'s (which
    may know more than the shape function does from `inputs`)."""
    copy = graph._create_op_internal(  # pylint: disable=protected-access
        op.type, inputs, dtypes=dtypes or [o.dtype for o in op.outputs], name=op.name,
        attrs=attrs or dict(op.node_def.attr), op_def=op.op_def, compute_device=False)
    if keep_shapes:
        for old, new in zip(op.outputs, copy.outputs):
            new.set_shape(old.shape)
    return copy


def new_op(op_type: str, inputs: list, **attrs) -> tf.Operation:
    """An op of `op_type` reading `inputs`, made in the default graph (name
    scope, device and control dependencies as for any op) without the op
    wrappers' argument checks: a third of the time of `tf.raw_ops`, for ops
    made by the thousand. `attrs`: name -> DType, bool or int; the others
    take their defaults."""
    graph = tf.compat.v1.get_default_graph()
    return graph._create_op_internal(  # pylint: disable=protected-access
        op_type, inputs, attrs={k: _attr_value(v) for k, v in attrs.items()})


def _attr_value(value) -> attr_value_pb2.AttrValue:
    if isinstance(value, tf.DType):
        return attr_value_pb2.AttrValue(type=value.as_datatype_enum)
    if isinstance(value, bool):
        return attr_value_pb2.AttrValue(b=value)
    return attr_value_pb2.AttrValue(i=value)


def add_loop_outputs(loop: tf.Operation, cond_graph, body_graph, new_inputs: list) -> None:
    """Gives v2 While `loop` the functions `cond_graph`, `body_graph` (its
    own plus `new_inputs` carried to new outputs), as while_v2's `_WhileGrad`
    adds its accumulators. The old outputs keep their meaning; stock while_v2
    treats the new ones as intermediates (`_num_original_outputs`)."""
    # pylint: disable=protected-access
    count = len(loop.outputs)
    loop._set_func_attr("cond", control_flow_util_v2.create_new_tf_function(cond_graph))
    loop._set_func_attr("body", control_flow_util_v2.create_new_tf_function(body_graph))
    loop._set_type_list_attr("T", body_graph.output_types)
    loop._set_shape_list_attr("output_shapes", body_graph.output_shapes)
    loop._add_while_inputs(new_inputs)
    new_outputs = body_graph.outputs[count:]
    loop._add_outputs([t.dtype for t in new_outputs], [t.shape for t in new_outputs])
    loop._set_attr("_num_original_outputs", attr_value_pb2.AttrValue(i=count))
    loop._cond_graph, loop._body_graph = cond_graph, body_graph  # read by while_v2


def set_loop_condition(loop: tf.Operation, cond_graph) -> None:
    """Gives v2 While `loop` the condition function `cond_graph` (same inputs)."""
    # pylint: disable=protected-access
    loop._set_func_attr("cond", control_flow_util_v2.create_new_tf_function(cond_graph))
    loop._cond_graph = cond_graph  # read by while_v2


def differentiated_by_stock(loop: tf.Operation) -> bool:
    """True if while_v2's gradient made `loop` output accumulators (it renames
    the functions it rewrites so)."""
    return loop.get_attr("body").name.endswith("_rewritten")


def orders_stateful_ops(graph: tf.Graph) -> bool:
    """True for a tf.function graph, which orders stateful ops in program order."""
    return getattr(graph, "_add_control_dependencies", False)


def ordered_uses(op: tf.Operation) -> list:
    """What a tf.function's automatic control dependencies order `op` by: a
    (resource tensor, whether `op` may write it) pair per resource it takes,
    as they see them (a handle through an Identity is its source; a call's
    read-only inputs are reads), in program order with the other uses of that
    resource; or [(None, True)] for a stateful op that takes none (a
    CheckNumerics, a print: chained in program order); [] otherwise."""
    uses = [(t, kind == auto_control_deps.ResourceType.READ_WRITE)
            for t, kind in auto_control_deps._get_resource_inputs(op)]  # pylint: disable=protected-access
    if (not uses and auto_control_deps.op_is_stateful(op)
            and op._control_flow_context is None):  # pylint: disable=protected-access
        return [(None, True)]
    return uses


def set_gradient_override(op: tf.Operation, gradient_name) -> None:
    """Makes tf.gradients use the gradient registered as `gradient_name` for
    `op` (None: its op type's own gradient again)."""
    if gradient_name is None:
        if "_gradient_op_type" in op.node_def.attr:
            op._clear_attr("_gradient_op_type")  # pylint: disable=protected-access
    else:
        op._set_attr("_gradient_op_type",  # pylint: disable=protected-access
                     attr_value_pb2.AttrValue(s=gradient_name.encode()))


@contextlib.contextmanager
def gradients_overridden(ops: list, gradient_name: str):
    """Within, tf.gradients uses the gradient registered as `gradient_name`
    for each of `ops`; their own gradients again after.

    A tf.function call op carries its gradient as a Python attribute, which
    tf.gradients prefers to the registered one: it is set aside meanwhile,
    as is a gradient_override_map's name on the op.
    """
    own = {op: (op._gradient_function,  # pylint: disable=protected-access
                op.node_def.attr["_gradient_op_type"].s.decode()
                if gradient_overridden(op) else None) for op in ops}
    for op in ops:
        set_gradient_override(op, gradient_name)
        op._gradient_function = None  # pylint: disable=protected-access
    try:
        yield
    finally:
        for op in ops:
            function, name = own[op]
            set_gradient_override(op, name)
            op._gradient_function = function  # pylint: disable=protected-access


def empty_attr_value() -> attr_value_pb2.AttrValue:
    return attr_value_pb2.AttrValue()


def copy_handle_data(source: tf.Tensor, target: tf.Tensor) -> None:
    """Gives `target` the resource/TensorList handle data (dtype, shape) of `source`."""
    handle_data_util.copy_handle_data(source, target)


def resource_shape(handle: tf.Tensor):
    """The shape of the variable behind resource tensor `handle` as its handle
    data records it, or None when none is recorded."""
    spec = resource_spec(handle)
    return None if spec is None else spec.shape


def resource_spec(handle: tf.Tensor):
    """The tf.TensorSpec (shape, dtype) of the variable behind resource tensor
    `handle` as its handle data records it, or None when none is recorded."""
    data = handle_data_util.get_resource_handle_data(handle)
    if data is None or not data.is_set or not data.shape_and_type:
        return None
    entry = data.shape_and_type[0]
    return tf.TensorSpec(tf.TensorShape(entry.shape), tf.as_dtype(entry.dtype))


def set_parallel_iterations(loop: tf.Operation, count: int) -> None:
    """Sets how many iterations of a While op may run at once."""
    loop._set_attr("parallel_iterations",  # pylint: disable=protected-access
                   attr_value_pb2.AttrValue(i=count))


def tf1_optimizer_gradients_module():
    """The module whose `gradients` the TF1 optimizers call.

    `tf.compat.v1.train.Optimizer.compute_gradients` calls
    `tensorflow.python.ops.gradients.gradients`, not `tf.gradients`.
    """
    return gradients_module


def any_tape_recording() -> bool:
    """True while any GradientTape or ForwardAccumulator could record new ops."""
    return record.could_possibly_record()


def in_control_flow_body(graph: tf.Graph) -> bool:
    """True for the graph of a v2 while loop's body/condition or a cond branch."""
    return isinstance(graph, control_flow_v2_func_graphs.ControlFlowFuncGraph)


def in_save_context() -> bool:
    """True while tf.saved_model.save traces the functions it writes."""
    return save_context.in_save_context()


# GradientTape's private methods that start and stop its recording (the tape
# hook wraps them to note where in a graph a tape recorded).
TAPE_PUSH, TAPE_POP = "_push_tape", "_pop_tape"


def copy_keras_mask(source: tf.Tensor, target: tf.Tensor) -> None:
    """Gives `target` the Keras mask `source` carries, if any (the private
    attribute where Keras 3 and tf_keras keep a layer output's mask)."""
    mask = getattr(source, "_keras_mask", None)
    if mask is not None:
        target._keras_mask = mask  # pylint: disable=protected-access


def tape_is_spent(tape: tf.GradientTape) -> bool:
    """True for a non-persistent tape whose gradient was taken already."""
    return tape._tape is None  # pylint: disable=protected-access


def tape_is_recording(tape: tf.GradientTape) -> bool:
    """True while the tape's `with` block is open (and not paused)."""
    return tape._recording  # pylint: disable=protected-access


def tape_is_persistent(tape: tf.GradientTape) -> bool:
    return tape._persistent  # pylint: disable=protected-access


def tape_watches_accessed_variables(tape: tf.GradientTape) -> bool:
    return tape._watch_accessed_variables  # pylint: disable=protected-access


def stop_tape(tape: tf.GradientTape) -> None:
    """Ends the tape's recording, as `gradient` does inside its `with` block."""
    getattr(tape, TAPE_POP)()


def spend_tape(tape: tf.GradientTape) -> None:
    """Releases a non-persistent tape after its one gradient, as the stock `gradient` does."""
    tape._watched_variables = tape._tape.watched_variables()  # pylint: disable=protected-access
    tape._tape = None  # pylint: disable=protected-access


def xspace_from_file(path: str):
    """The profiler's XSpace proto read from an `.xplane.pb` file."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2  # pylint: disable=import-outside-toplevel
    space = xplane_pb2.XSpace()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    return space


def replace_control_input(op: tf.Operation, old: tf.Operation, new: tf.Operation) -> None:
    """Makes `op` (one the caller created) wait for `new` where it waited for `old`."""
    kept = [c for c in op.control_inputs if c is not old]
    op._remove_all_control_inputs()  # pylint: disable=protected-access
    op._add_control_inputs(kept + ([new] if new not in kept else []))  # pylint: disable=protected-access


def wraps_for_tf_inspect(target, wrapper):
    """`wrapper` made to report `target`'s signature to TensorFlow's own
    inspection (tf_inspect, which tf_keras reads to decide whether to pass
    `training=` and `mask=`), as `functools.wraps` does for `inspect`."""
    return tf.__internal__.decorator.make_decorator(target, wrapper)
