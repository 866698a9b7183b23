"""Pausing Python's cyclic garbage collector while the planner works.

Reading a graph and pricing plans make hundreds of thousands of short-lived
tuples and dicts. Those alive when the collector's young generations are
swept are promoted to the oldest one and, counted there, trigger full
collections; a full collection walks every object of the process, which with
TensorFlow loaded is about 500,000 (0.2-0.3 s of CPU each, measured on the
1,000-block benchmark of `benchmarks/solver_speed.py`). The planner makes no
reference cycles it relies on the collector to free, so it runs with the
collector paused; what it leaves behind is collected as usual afterwards.
"""

import functools
import gc


def paused(fn):
    """`fn` run with the cyclic collector off, turned back on only if it was on.

    Nested or concurrent calls are safe: a call that found the collector off
    leaves it to the call that turned it off.
    """
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        was_on = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if was_on:
                gc.enable()
    return wrapper
