"""The stock-versus-ours harness: build a model once, get tf.gradients and ours side by side.

`gradients_vs_stock(runtime, build, inputs)` builds the model with `build` in a
tf.compat.v1 Graph run by a Session (runtime 'session') or inside a
tf.function (runtime 'function', or 'xla' with jit_compile), computes stock
`tf.gradients` and `memory_saving_gradients.gradients` for every mode in that
same graph, and evaluates all of them in ONE run (one `session.run`, one
function call), so stateful ops such as dropout masks are shared between
stock and ours. `assert_matches_stock` then compares them.
"""

import contextlib
import dataclasses
import functools
import re

import numpy as np
import tensorflow as tf
from tensorflow.python.framework.indexed_slices import IndexedSlicesValue

import memory_saving_gradients as msg
from memory_saving_gradients.tfgraph import allocations
from memory_saving_gradients.tfgraph import gradient_waits

# The unpatched tf.gradients, whatever other tests do to tf.gradients.
from memory_saving_gradients.tfgraph.compat import stock_gradients  # noqa: E402,F401

RUNTIMES = ("session", "function", "xla")
MODES = ("memory", "speed")


@dataclasses.dataclass
class Model:
    """What a model-building function returns.

    Attributes:
      ys, xs, grad_ys: as for tf.gradients.
      lists: name -> list of tensors, each an explicit checkpoint list to try
        (reported as mode 'list:<name>').
      kwargs: extra tf.gradients keyword arguments, given to stock and ours.
      fetch: name -> tensor, forward values to evaluate as well.
    """
    ys: list
    xs: list
    grad_ys: list = None
    lists: dict = dataclasses.field(default_factory=dict)
    kwargs: dict = dataclasses.field(default_factory=dict)
    fetch: dict = dataclasses.field(default_factory=dict)


class Context:
    """Handed to model-building functions: creates each variable once.

    A tf.function may be traced more than once, and variables must be created
    only once and outside the function body; `tf.init_scope` does that (and in
    a plain Graph it keeps the variable in that graph).
    """

    def __init__(self):
        self.variables = {}

    def variable(self, name, value, **kwargs):
        if name not in self.variables:
            with tf.init_scope():
                self.variables[name] = tf.Variable(value, name=name, **kwargs)
        return self.variables[name]


@dataclasses.dataclass
class Outcome:
    """Everything one run produced, as numpy values (IndexedSlicesValue for sparse).

    Attributes:
      stock: stock tf.gradients, one entry per x.
      ours: mode -> our gradients, one entry per x.
      forward: ys ('y0', 'y1', ...) and fetches from the run with all gradients.
      forward_stock_only: the same from a run of the graph with stock
        tf.gradients only, before our gradients were added.
      variables: variable name -> value after the run with gradients.
      graph: the graph (or FuncGraph) that holds the gradients.
      forward_ops: names of the ops the model-building function made in it.
    """
    stock: list
    ours: dict
    forward: dict
    forward_stock_only: dict
    variables: dict
    graph: object
    forward_ops: frozenset


def _numpy(value):
    if value is None:
        return None
    if isinstance(value, tf.IndexedSlices):
        return IndexedSlicesValue(
            value.values.numpy(), value.indices.numpy(),
            None if value.dense_shape is None else value.dense_shape.numpy())
    if isinstance(value, IndexedSlicesValue):
        return value
    return np.asarray(value)


def _forward(model):
    values = {f"y{i}": y for i, y in enumerate(model.ys)}
    values.update(model.fetch)
    return values


def _stock(model):
    return stock_gradients(model.ys, model.xs, model.grad_ys, **model.kwargs)


def _ours(model, modes):
    """Our gradients for every mode and explicit list, in the current graph."""
    ours = {}
    for mode in modes:
        # Strategy objects (budgets, callables) are reported by name: tf.nest wants str keys.
        name = mode if isinstance(mode, str) else getattr(mode, "__name__", repr(mode))
        ours[name] = msg.gradients(model.ys, model.xs, model.grad_ys,
                                   checkpoints=mode, **model.kwargs)
    for name, tensors in model.lists.items():
        ours[f"list:{name}"] = msg.gradients(model.ys, model.xs, model.grad_ys,
                                             checkpoints=tensors, **model.kwargs)
    return ours


def _build(build, ctx, tensors, forward_ops):
    """Runs `build`, adding the names of the ops it creates to `forward_ops`."""
    graph = tf.compat.v1.get_default_graph()
    before = len(graph.get_operations())
    model = build(ctx, **tensors)
    forward_ops.update(op.name for op in graph.get_operations()[before:])
    return model


def _session_run(sess, fetches, feed_dict):
    """`sess.run` that passes None entries through, as a tf.function does."""
    flat = tf.nest.flatten(fetches)
    values = iter(sess.run([f for f in flat if f is not None], feed_dict))
    return tf.nest.pack_sequence_as(fetches, [None if f is None else next(values)
                                              for f in flat])


def gradients_vs_stock(runtime, build, inputs, modes=MODES, shapes=None):
    """Builds `build(ctx, **input_tensors) -> Model` once and runs it with gradients.

    Args:
      runtime: 'session' (tf.compat.v1 Graph + Session, inputs are
        placeholders), 'function' (tf.function, inputs are arguments) or
        'xla' (the same with jit_compile=True).
      build: the model-building function; it must create variables with
        `ctx.variable` so they are made once and initialised the same way.
      inputs: name -> numpy array fed as that input.
      modes: string modes to run besides the model's explicit lists.
      shapes: name -> static shape for an input (default: the array's shape);
        use None dims to get dynamic shapes.

    Every run starts from the variables' initial values.
    """
    shapes = {name: (shapes or {}).get(name, value.shape) for name, value in inputs.items()}
    specs = {name: tf.TensorSpec(shapes[name], tf.as_dtype(value.dtype))
             for name, value in inputs.items()}
    ctx = Context()
    forward_ops = set()
    if runtime == "session":
        run = _run_in_session
    elif runtime in ("function", "xla"):
        run = functools.partial(_run_in_function, jit=runtime == "xla")
    else:
        raise ValueError(runtime)
    results, forward_stock_only, variables, graph = run(
        build, ctx, specs, inputs, modes, forward_ops)
    return Outcome(
        stock=[_numpy(g) for g in results["stock"]],
        ours={mode: [_numpy(g) for g in grads] for mode, grads in results["ours"].items()},
        forward={k: _numpy(v) for k, v in results["forward"].items()},
        forward_stock_only={k: _numpy(v) for k, v in forward_stock_only.items()},
        variables={k: _numpy(v) for k, v in variables.items()},
        graph=graph, forward_ops=frozenset(forward_ops))


def _run_in_session(build, ctx, specs, inputs, modes, forward_ops):
    """(results, forward values with stock only, variables, graph) in a Graph + Session."""
    graph = tf.Graph()
    with graph.as_default():
        feeds = {name: tf.compat.v1.placeholder(spec.dtype, spec.shape, name=name)
                 for name, spec in specs.items()}
        model = _build(build, ctx, feeds, forward_ops)
        stock = _stock(model)
        init = tf.compat.v1.global_variables_initializer()
        feed_dict = {feeds[name]: value for name, value in inputs.items()}
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(init)
            forward_stock_only = _session_run(
                sess, {"stock": stock, "forward": _forward(model)}, feed_dict)["forward"]
        ours = _ours(model, modes)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(init)
            results = _session_run(
                sess, {"stock": stock, "ours": ours, "forward": _forward(model)}, feed_dict)
            variables = sess.run(ctx.variables)
    return results, forward_stock_only, variables, graph


def _run_in_function(build, ctx, specs, inputs, modes, forward_ops, jit):
    """(results, forward values with stock only, variables, graph) in a tf.function."""
    names = sorted(specs)

    def stock_only(*args):
        model = _build(build, ctx, dict(zip(names, args)), set())
        return {"stock": _stock(model), "forward": _forward(model)}

    def with_gradients(*args):
        model = _build(build, ctx, dict(zip(names, args)), forward_ops)
        return {"stock": _stock(model), "ours": _ours(model, modes),
                "forward": _forward(model)}

    signature = [specs[name] for name in names]
    args = [tf.constant(inputs[name]) for name in names]
    # No autograph: the graph holds exactly the ops the model function makes.
    stock_fn = tf.function(stock_only, input_signature=signature, autograph=False,
                           jit_compile=jit)
    gradients_fn = tf.function(with_gradients, input_signature=signature,
                               autograph=False, jit_compile=jit)
    stock_fn.get_concrete_function()  # creates the variables
    initial = {name: v.numpy() for name, v in ctx.variables.items()}
    forward_stock_only = stock_fn(*args)["forward"]
    for name, v in ctx.variables.items():
        v.assign(initial[name])
    concrete = gradients_fn.get_concrete_function()
    results = gradients_fn(*args) if jit else concrete(*args)
    return results, forward_stock_only, ctx.variables, concrete.graph


def dense(value):
    """A gradient value as a dense numpy array (IndexedSlices summed per row)."""
    if isinstance(value, IndexedSlicesValue):
        out = np.zeros(value.dense_shape, value.values.dtype)
        np.add.at(out, value.indices, value.values)
        return out
    return value


def assert_matches_stock(outcome, rtol=1e-5, atol=1e-6, forward_unchanged=True,
                         forward_tolerance=None):
    """Each mode's gradients equal stock's: same None-ness, same sparsity, close values.

    With `forward_unchanged`, also checks that adding our gradients to the
    graph leaves the forward values as they were with stock tf.gradients
    alone (use False for random models). Within the same tolerance, not
    bit for bit: Grappler's arithmetic rewrites of the forward ops depend on
    their consumers, so extra consumers can change the last bit.
    `forward_tolerance(name, value)`: (rtol, atol) for one forward value, where
    it differs from the gradients' (a second order summed in float16).
    """
    assert outcome.ours, "no mode was run"
    for mode, grads in outcome.ours.items():
        assert len(grads) == len(outcome.stock), mode
        for i, (ours, stock) in enumerate(zip(grads, outcome.stock)):
            where = f"mode {mode}, x #{i}"
            if stock is None:
                assert ours is None, f"{where}: tf.gradients gives None, ours {ours!r}"
                continue
            assert ours is not None, f"{where}: ours is None, tf.gradients is not"
            stock_sparse = isinstance(stock, IndexedSlicesValue)
            ours_sparse = isinstance(ours, IndexedSlicesValue)
            assert ours_sparse == stock_sparse, (
                f"{where}: IndexedSlices {ours_sparse}, tf.gradients {stock_sparse}")
            assert dense(ours).dtype == dense(stock).dtype, where
            np.testing.assert_allclose(
                dense(ours).astype(np.float64), dense(stock).astype(np.float64),
                rtol=rtol, atol=atol, err_msg=where)
    if forward_unchanged:
        assert outcome.forward.keys() == outcome.forward_stock_only.keys()
        for name, value in outcome.forward.items():
            reference = outcome.forward_stock_only[name]
            value_rtol, value_atol = (forward_tolerance(name, reference) if forward_tolerance
                                      else (rtol, atol))
            np.testing.assert_allclose(value, reference, rtol=value_rtol, atol=value_atol,
                                       err_msg=name)


def _original_name(op):
    """The op `op` copies, named '<gradients scope>/recompute_<level>/<original>', or None."""
    match = re.search(r"/recompute_\d+/(.+)$", op.name)
    return match.group(1) if match else None


def recompute_copies(outcome):
    """(copy, original) pairs for the forward ops our rewrite copied (a copy has
    its original's type and attributes)."""
    graph = outcome.graph
    pairs = []
    for op in graph.get_operations():
        name = _original_name(op)
        if name in outcome.forward_ops:
            original = graph.get_operation_by_name(name)
            if original.type == op.type and original.node_def.attr == op.node_def.attr:
                pairs.append((op, original))
    return pairs


@contextlib.contextmanager
def control_flow_v1():
    """Builds tf.while_loop / tf.cond as v1 Switch/Merge/Enter/Exit ops inside the block."""
    tf.compat.v1.disable_control_flow_v2()
    try:
        yield
    finally:
        tf.compat.v1.enable_control_flow_v2()


def copied_forward_loops(graph, forward_ops):
    """Names of the loops among `forward_ops` that were copied (recompute_copies
    misses them: differentiating a loop changes its attributes)."""
    return {_original_name(op) for op in graph.get_operations()
            if op.type in ("While", "StatelessWhile") and _original_name(op) in forward_ops}


def one_thread_session_config():
    """A Session config with an inter-op thread of its own. Without
    `use_per_session_threads` a Session runs on the process's global pool, which the
    first Session of the process sized: two threads here if an earlier test made a
    Session with the default config."""
    return tf.compat.v1.ConfigProto(inter_op_parallelism_threads=1,
                                    use_per_session_threads=True)


def requested_session_peak(sess, fetches, feed):
    """(peak bytes requested, values) of `fetches` run in `sess`: like
    `msg.session_peak_bytes`, but the bytes the ops asked for. Under BFC the
    records hold the chunks handed out, up to twice a request, and which chunk
    depends on what the process allocated before (a buffer or two either way)."""
    values = sess.run(fetches, feed)
    return allocations.requested_run_peak(sess, fetches, feed), values


def run_session(fetches, feed):
    """`fetches` evaluated in a new Session of the default graph."""
    with tf.compat.v1.Session() as sess:
        return sess.run(fetches, feed)


# True if `later` depends on `first` through data or control edges.
waits_for = gradient_waits.depends_on


def ancestors(tensors) -> set:
    """The ops `tensors` wait for, through data and control edges, their own included."""
    found, todo = set(), [t.op for t in tensors]
    while todo:
        op = todo.pop()
        if op not in found:
            found.add(op)
            todo.extend(gradient_waits.runs_after(op))
    return found


def assert_an_order_of_runs(ordered):
    """Each op of `ordered` comes after the ops of `ordered` it waits for."""
    position = {op: i for i, op in enumerate(ordered)}
    for op in ordered:
        assert all(position[before] < position[op] for before in gradient_waits.runs_after(op)
                   if before in position), op.name


def stock_gradient_ops(ys, xs) -> tuple:
    """(tf.gradients(ys, xs), the ops that call made in creation order), in the default graph."""
    graph = tf.compat.v1.get_default_graph()
    first = len(graph.get_operations())
    grads = stock_gradients(ys, xs)
    return grads, graph.get_operations()[first:]


def spy(monkeypatch, module, name: str, count) -> list:
    """Wraps `module.name` while the test runs: each call's `count(args, result)` is
    appended to the list returned."""
    counts = []
    original = getattr(module, name)

    def wrapper(*args):
        result = original(*args)
        counts.append(count(args, result))
        return result
    monkeypatch.setattr(module, name, wrapper)
    return counts


def module_result(module: str, threads: str) -> dict:
    """The JSON a `python -m module` measuring script prints last, run in a fresh
    process with allocator statistics on and TensorFlow's default threading
    (`threads` "default") or one inter-op thread ("1")."""
    import json
    import os
    import pathlib
    import subprocess
    import sys
    root = pathlib.Path(__file__).resolve().parent.parent
    env = {**os.environ, "TF_CPU_ALLOCATOR_USE_BFC": "1", "PYTHONPATH": str(root)}
    env.pop("TF_NUM_INTEROP_THREADS", None)
    if threads == "1":
        env["TF_NUM_INTEROP_THREADS"] = "1"
    done = subprocess.run([sys.executable, "-m", module], env=env, cwd=root,
                          capture_output=True, text=True, timeout=600, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])
