"""Monkey-patching: route every tf.gradients call in the process to a mode.

The classic one-liner still works::

    tf.__dict__["gradients"] = memory_saving_gradients.gradients_memory

These helpers do the same for tf.gradients, tf.compat.v1.gradients and the
function the TF1 optimizers call (`Optimizer.compute_gradients`), route
`tf.GradientTape.gradient` inside tf.function through the same mode (see
integrations/tape.py), make a Keras optimizer's update in a traced step wait
for its gradients (integrations/optimizer_waits.py), and put the originals back.

Which mode is in force is asked per thread, because tf.distribute traces each
replica of `strategy.run` in a thread of its own: a patch made in the main
thread holds for the whole process (replica threads included), a patch made
in any other thread (say, inside a replica function) holds for that thread
only, on top of the main thread's. While any patch is in force a dispatcher
stands in for tf.gradients; it answers threads without a patch with the stock
function.
"""

import contextlib
import functools
import inspect
import threading
import weakref
from typing import Callable, List, MutableMapping, Optional, Tuple

import tensorflow as tf

from memory_saving_gradients import api
from memory_saving_gradients.integrations import optimizer_waits
from memory_saving_gradients.integrations import tape
from memory_saving_gradients.tfgraph import compat

_TARGETS = ((tf, "gradients"), (tf.compat.v1, "gradients"),
            (compat.tf1_optimizer_gradients_module(), "gradients"))


class _ThreadKey:
    """Stands for one thread: it lives in that thread's `threading.local`, which
    Python clears when the thread ends, however the thread was started."""

    __slots__ = ("__weakref__",)


class _Patches:
    """Per-thread stacks of `checkpoints` values, and the installed dispatchers.

    Every method holds the lock: replica threads enter and leave patches
    interleaved (a replica pauses at each merge_call while the next runs).
    Stacks are kept by a key living in the thread's own thread-local storage,
    not by thread id (the OS gives an ended thread's id to new ones) nor by
    thread object (a thread started outside `threading` reads as alive for
    good): a thread that ended without undoing its patches loses them with
    its storage, and the originals are back at the next call if it was the
    last. The main thread's storage lasts until the interpreter is torn down,
    so its patches hold for other threads and atexit handlers while it shuts
    down. A thread that C code lends to Python for one callback (ctypes,
    `tf.py_function`) gets fresh storage per callback, so a patch made there
    lasts for that callback. The dispatchers are installed while
    `_originals` holds what they replaced: an ended thread's entry leaves the
    stacks at any moment, without the lock.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._local = threading.local()
        self._stacks: MutableMapping[_ThreadKey, List[object]] = weakref.WeakKeyDictionary()
        self._main: Tuple[Optional[threading.Thread], Optional[_ThreadKey]] = (None, None)
        self._originals: List[Callable] = []  # what the dispatchers replaced

    def push(self, checkpoints) -> None:
        with self._lock:
            self._uninstall_if_unused()
            if not self._originals:
                self._install()
            self._stacks.setdefault(self._current_key(), []).append(checkpoints)

    def pop(self) -> None:
        with self._lock:
            self._uninstall_if_unused()
            key = self._current_key()
            stack = self._stacks.get(key)
            if not stack:
                raise RuntimeError(
                    "tf.gradients is not patched by memory_saving_gradients in this "
                    "thread; call patch_tf_gradients() first (in the same thread)")
            stack.pop()
            if not stack:
                del self._stacks[key]
            if not self._stacks:
                self._uninstall()

    def active(self) -> Optional[object]:
        with self._lock:
            self._uninstall_if_unused()
            for key in (self._current_key(), self._main_thread_key()):
                stack = self._stacks.get(key) if key is not None else None
                if stack:
                    return stack[-1]
            return None

    def _current_key(self) -> _ThreadKey:
        key = getattr(self._local, "key", None)
        if key is None:
            key = self._local.key = _ThreadKey()
        if threading.current_thread() is threading.main_thread():
            self._main = (threading.current_thread(), key)
        return key

    def _main_thread_key(self) -> Optional[_ThreadKey]:
        """The main thread's key, if it has one. After `os.fork` in another
        thread that thread is the child's main thread, and the old one is gone."""
        thread, key = self._main
        if thread is not threading.main_thread():
            self._main = (None, None)
            return None
        return key

    def _uninstall_if_unused(self) -> None:
        """Puts the originals back where every patching thread has ended."""
        if self._originals and not self._stacks:
            self._uninstall()

    def _install(self) -> None:
        self._originals = [getattr(module, name) for module, name in _TARGETS]
        for (module, name), original in zip(_TARGETS, self._originals):
            setattr(module, name, _dispatcher(original))
        optimizer_waits.install(_patched_here)

    def _uninstall(self) -> None:
        for (module, name), original in zip(_TARGETS, self._originals):
            # Leave alone a function the user put there since.
            if getattr(getattr(module, name), "_replaces", None) is original:
                setattr(module, name, original)
        self._originals = []
        optimizer_waits.uninstall(_patched_here)


_patches = _Patches()


def _dispatcher(original: Callable) -> Callable:
    """Calls `gradients` with the calling thread's mode, or `original` if it has none.

    Arguments are bound to `original`'s signature, positional ones included
    (tf.gradients and tf.compat.v1.gradients order them differently after `name`).
    """
    signature = inspect.signature(original)

    @tf.autograph.experimental.do_not_convert
    @functools.wraps(original)
    def dispatch(*args, **kwargs):
        checkpoints = active_checkpoints()
        if checkpoints is None:
            return original(*args, **kwargs)
        arguments = signature.bind(*args, **kwargs).arguments
        return optimizer_waits.planned_for_updates(
            lambda: api.gradients(**arguments, checkpoints=checkpoints),
            tf.nest.flatten(arguments["xs"]))

    dispatch._replaces = original  # pylint: disable=protected-access
    return dispatch


def patch_tf_gradients(checkpoints="memory") -> None:
    """Makes tf.gradients, tf.compat.v1.gradients, the TF1 optimizers and
    GradientTape.gradient inside tf.function checkpoint with `checkpoints`.

    `checkpoints` is any value `gradients` accepts ('memory', 'speed',
    'collection', a list of tensors, `budget(max_bytes)`,
    `memory_within(slack)` or a callable strategy). Undo with
    `unpatch_tf_gradients()` in the same thread. Called in the main thread it
    holds for every thread; called in another thread, for that thread only.
    """
    api.validate_checkpoints(checkpoints)
    tape.install(active_checkpoints)
    _patches.push(checkpoints)


def unpatch_tf_gradients() -> None:
    """Undoes this thread's most recent `patch_tf_gradients`.

    When no patch is left in any thread, tf.gradients and
    tf.compat.v1.gradients are the functions they were before the first.
    """
    _patches.pop()


def active_checkpoints():
    """The `checkpoints` value in force for the calling thread, or None if unpatched.

    That is the innermost patch made in this thread, else the innermost made
    in the main thread (which reaches the replica threads of `strategy.run`).
    Integrations (tape, Keras) read it to know whether, and how, to checkpoint.
    """
    return _patches.active()


def _patched_here() -> bool:
    """Whether a patch is in force for the calling thread (a reason for
    optimizer_waits)."""
    return _patches.active() is not None


@contextlib.contextmanager
def checkpointing(checkpoints="memory"):
    """Context manager: tf.gradients checkpoints with `checkpoints` inside the block.

    Safe to enter around `strategy.run` and inside the replica function too
    (each replica thread has its own block).

    Example:
      >>> with memory_saving_gradients.checkpointing("memory"):
      ...     grads = tf.gradients(loss, params)
    """
    patch_tf_gradients(checkpoints)
    try:
        yield
    finally:
        unpatch_tf_gradients()
