"""Optimizer updates that wait for their gradients, in every checkpointed step.

While a tf.function is traced with checkpointing in force for the calling
thread (`patch_tf_gradients`, `checkpointing`, or a step
`memory_saving_gradients.keras` checkpoints), or into a graph that holds a
layer `@recompute_grad` made a segment under RECOMPUTE=1, a Keras optimizer's
update (Keras 3's `apply`,
which `apply_gradients` and `minimize` call; tf_keras's `apply_gradients`)
makes its work that needs no gradient wait for the gradient it serves
(tfgraph/update_waits.py): else momentum SGD's `m * momentum`, RMSprop's
decayed average and AdamW's weight decay run at the step's start and hold a
weight-sized buffer per variable through backprop. That holds for the user's
own training loop as for `fit`. And each gate (gradient_waits.gate) that
waits for a gradient, before the next level's recomputation or a decorated
layer's input gradient, waits too for that gradient's update
(`hold_next_levels_for_updates`): else with one inter-op thread the executor
may run backprop's chain on to its end and queue the updates until then,
every weight gradient held. Values do not change.

Nothing waits where the step runs eagerly, under a distribution strategy
(whose replicas trace into one graph at once), or for gradients that are not
tensors of the traced graph (accumulated gradients kept in variables).

A user's own step learns here whether its optimizer takes each weight
gradient as it is made. Where a Keras 3 optimizer that updates each variable
from its own gradient alone (`takes_each_gradient`) is handed, for every
variable, the very gradient our `gradients` made for it, those variables are
noted for the function being traced (by its name, which tf.function's traces
share; an update there that does not take them so withdraws the note), and a
later trace of it (a tf.function traces again once its first trace created the
optimizer's variables) plans its gradients of them as
`fit`'s step does: ranked by the peak with each weight gradient taken as it is
made (`planned_for_updates`). A gradient clipped by a global norm, or any
other value made from the gradients, is not ours: nothing is noted then.

Each way in installs a reason (a callable saying whether the step being traced
is one of its own): `install()` wraps those methods when the first reason comes
(the first patch, integrations/patching.py; the first segment under
RECOMPUTE=1, integrations/layer_decorator.py, which stays for the run), and
`uninstall()` puts them back when the last reason goes. tf_keras is wrapped only
if imported by then.
"""

import contextlib
import functools
import importlib
import inspect
import logging
import sys
import threading
import weakref
from typing import Callable, Dict, List, Set, Tuple

import tensorflow as tf

from memory_saving_gradients import api
from memory_saving_gradients.tfgraph import gradient_waits
from memory_saving_gradients.tfgraph import update_waits
from memory_saving_gradients.tfgraph import variables as tf_variables

logger = logging.getLogger("memory_saving_gradients")

_reasons: List[Callable[[], bool]] = []  # what installed the wrappers, in order
_lock = threading.Lock()
_local = threading.local()  # .updating: inside a wrapped update already
_OURS = "_memory_saving_gradients_waits"  # marks our wrappers
# Per graph: id of a weight gradient our `gradients` returned -> id of its tf.Variable.
_made_for = weakref.WeakKeyDictionary()
# id of a tf.Variable -> (a weak reference to it: ids are reused once it is gone;
# the names of the traced functions whose optimizer took its gradient one by one).
_taken_one_by_one: Dict[int, Tuple[weakref.ref, Set[str]]] = {}


def install(reason: Callable[[], bool]) -> None:
    """Adds `reason` (does the calling thread trace a step it checkpoints?)
    and wraps the optimizers' update methods (whatever stands there, unless it
    is our wrapper)."""
    with _lock:
        if reason not in _reasons:
            _reasons.append(reason)
        for cls, name in _update_methods():
            current = cls.__dict__[name]
            if not _is_ours(current):
                setattr(cls, name, _waiting(current, takes_pairs=name == "apply_gradients"))


def uninstall(reason: Callable[[], bool]) -> None:
    """Drops `reason`; with none left, takes our wrappers off the update
    methods. A method other code put over ours is left (ours inside it acts
    only for a reason); the next call takes ours off once that code has put
    it back."""
    with _lock:
        if reason in _reasons:
            _reasons.remove(reason)
        if _reasons:
            return
        for cls, name in _update_methods():
            current = cls.__dict__.get(name)
            if _is_ours(current):
                while _is_ours(current):
                    current = current._replaces  # pylint: disable=protected-access
                setattr(cls, name, current)


def takes_each_gradient(optimizer) -> bool:
    """Whether a Keras 3 optimizer's update, being traced, applies each weight
    gradient as it is made: outside a distribution strategy (whose all-reduce
    takes them together), with an optimizer that updates each variable from
    its own gradient (not a global-norm clip, a loss-scale check of every
    gradient, nor accumulation under a cond). The `IdentityN` Keras puts over
    all of them is passed by as the step is traced (`pass_gradients_straight`).
    tf_keras's optimizers are not assumed to."""
    return (optimizer is not None and not tf.distribute.has_strategy()
            and getattr(optimizer, "global_clipnorm", None) is None
            and not getattr(optimizer, "gradient_accumulation_steps", None)
            and not any(c.__name__ == "LossScaleOptimizer" for c in type(optimizer).__mro__))


def planned_for_updates(gradients_of: Callable[[], list], sources: list) -> list:
    """`gradients_of()`, our gradients of `sources`: planned as taken one by one
    (`api.weight_gradients_taken`) where every source is a variable an optimizer
    took its gradient for one by one in an earlier trace of the function being
    traced (a function of the same name: tf.function's traces share it), and
    noted for the optimizer's update, which may take them so."""
    found = [tf_variables.as_tf_variable(s) for s in sources]
    variables = [v for v in found if isinstance(v, tf.Variable)]
    taken = (bool(variables) and len(variables) == len(found)
             and not tf.distribute.has_strategy()  # its all-reduce takes them together
             and all(_was_taken_one_by_one(v) for v in variables))
    with api.weight_gradients_taken() if taken else contextlib.nullcontext():
        grads = gradients_of()
    made = _made_for.setdefault(tf.compat.v1.get_default_graph(), {})
    for variable, grad in zip(found, grads):
        if isinstance(variable, tf.Variable) and grad is not None:
            made[id(gradient_waits.gradient_values(grad))] = id(variable)
    return grads


def _was_taken_one_by_one(variable: tf.Variable) -> bool:
    ref, functions = _taken_one_by_one.get(id(variable), (None, ()))
    return (ref is not None and ref() is variable
            and tf.compat.v1.get_default_graph().name in functions)


def _note_taken_one_by_one(optimizer, gradients: list, variables) -> None:
    """Notes, for the function being traced, `variables` where `optimizer`
    takes each of `gradients` as it is made and each is the one our
    `gradients` made for its variable; else withdraws that function's notes
    of them (another optimizer, or gradients made into something else)."""
    if variables is None:
        return
    graph = tf.compat.v1.get_default_graph()
    found = [v for v in map(tf_variables.as_tf_variable, variables) if isinstance(v, tf.Variable)]
    made = _made_for.get(graph, {})
    taken = (takes_each_gradient(optimizer) and len(found) == len(gradients) and all(
        g is not None and made.get(id(gradient_waits.gradient_values(g))) == id(v)
        for g, v in zip(gradients, found)))
    for variable in found:
        ref, functions = _taken_one_by_one.get(id(variable), (None, set()))
        if ref is None or ref() is not variable:
            if not taken:
                continue
            ref, functions = _weak_entry(variable), set()
        if taken:
            functions.add(graph.name)
        else:
            functions.discard(graph.name)
        _taken_one_by_one[id(variable)] = (ref, functions)


def _weak_entry(variable: tf.Variable) -> weakref.ref:
    """A weak reference to `variable` that drops its entry once it is gone."""
    key = id(variable)

    def forget(gone):
        if _taken_one_by_one.get(key, (None,))[0] is gone:
            _taken_one_by_one.pop(key, None)
    return weakref.ref(variable, forget)


def _is_ours(method) -> bool:
    # `is True`: a Mock standing there answers every attribute with a truthy Mock.
    return getattr(method, _OURS, False) is True


def _update_methods() -> List[Tuple[type, str]]:
    """The classes (and their method) that apply a Keras optimizer's gradients."""
    found = []
    keras = _module("keras")
    if keras is not None:
        found.append((_defining(keras.optimizers.Optimizer, "apply"), "apply"))
    tf_keras = sys.modules.get("tf_keras")
    if tf_keras is not None:
        found += [(tf_keras.optimizers.Optimizer, "apply_gradients"),
                  (tf_keras.optimizers.legacy.Optimizer, "apply_gradients")]
    return found


def _module(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _defining(cls: type, name: str) -> type:
    """The class of `cls`'s MRO whose own `name` `cls` uses."""
    return next(c for c in cls.__mro__ if name in c.__dict__)


def _waiting(stock: Callable, takes_pairs: bool) -> Callable:
    """`stock` (an optimizer's update taking gradients, or (gradient, variable)
    pairs, first), making the ops it adds wait where `_waits_here`."""
    signature = inspect.signature(stock)
    first = list(signature.parameters)[1]  # after self: grads, or grads_and_vars

    @functools.wraps(stock)
    def update(*args, **kwargs):
        if getattr(_local, "updating", False) or not _waits_here():
            return stock(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        given = bound.arguments[first] = list(bound.arguments[first])  # often a zip
        graph = tf.compat.v1.get_default_graph()
        start = len(graph.get_operations())
        _local.updating = True  # tf_keras subclasses reach the base class's update
        try:
            result = stock(*bound.args, **bound.kwargs)
        finally:
            _local.updating = False
        gradients = [_of_graph(g, graph) for g in ([g for g, _ in given] if takes_pairs
                                                    else given)]
        if not takes_pairs:  # Keras 3's `apply(grads, trainable_variables)`
            _note_taken_one_by_one(args[0], gradients,
                                   bound.arguments.get("trainable_variables"))
        made = graph.get_operations()[start:]
        uses = {}  # found once for the three: rewiring gradients changes no resource's use
        update_waits.pass_gradients_straight(gradients, made, uses)
        waiting = update_waits.wait_for_gradients(gradients, made, uses)
        held = update_waits.hold_next_levels_for_updates(gradients, made, uses)
        logger.debug("memory_saving_gradients: %d ops of %s's update wait for their gradient; "
                     "the next level waits for %d variables' updates", waiting,
                     type(args[0]).__name__, held)
        return result

    update._replaces = stock  # pylint: disable=protected-access
    setattr(update, _OURS, True)
    return update


def _waits_here() -> bool:
    return (not tf.executing_eagerly() and not tf.distribute.has_strategy()
            and any(reason() for reason in list(_reasons)))


def _of_graph(gradient, graph: tf.Graph):
    """`gradient` if it is a Tensor or IndexedSlices of `graph`, else None
    (a variable, a value from outside): nothing is made to wait for it."""
    values = gradient_waits.gradient_values(gradient)
    # An eager tensor has no graph: its `graph` raises AttributeError.
    return gradient if getattr(values, "graph", None) is graph else None
