"""Time to build a training step's gradients, tf.gradients and "memory" side by side.

    python -m benchmarks.build_time [--family mlp] [--size 256] [--batch 1024]

In one process, traces the benchmark's training step (benchmarks.train_step)
with tf.gradients, then with ours(memory), and prints each one's
`grad_build_s` (the gradient call's wall time, planning included for ours)
and, for ours, the seconds spent in the rewrite's parts (timed in place):
planning, the tf.gradients calls (all, and the first and last phase's),
gates, copies with their stubs, and stubs alone. Run it once per code
version and compare the ratios (issue #15, docs/planner.md).
"""

import argparse
import collections
import functools
import os
import time

PARTS = (("api", "_plan", "plan"), ("rewrite._Backprop", "_differentiate", "tf.gradients calls"),
         ("rewrite._Backprop", "to_checkpoints", "first phase"),
         ("rewrite._Backprop", "to_xs", "last phase"), ("gradient_waits", "gate", "gates"),
         ("copying", "copy_level", "copies and stubs"), ("copying.Boundary", "stub", "stubs"))


def _timed_parts(spent):
    """Wraps each part of PARTS so its wall time adds up in `spent`."""
    import memory_saving_gradients.api as api
    from memory_saving_gradients.tfgraph import copying, gradient_waits, rewrite
    modules = {"api": api, "copying": copying, "gradient_waits": gradient_waits,
               "rewrite": rewrite}
    for owner_path, name, key in PARTS:
        head, *rest = owner_path.split(".")
        owner = functools.reduce(getattr, rest, modules[head])
        setattr(owner, name, _timer(getattr(owner, name), spent, key))


def _timer(fn, spent, key):
    @functools.wraps(fn)
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[key] += time.perf_counter() - start
    return timed


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="mlp")
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1024)
    args = parser.parse_args()
    import tensorflow as tf
    from benchmarks.train_step import build, make_train_step
    spent = collections.Counter()
    _timed_parts(spent)
    for method_name in ("tf.gradients", "ours(memory)"):
        spent.clear()
        job = {"family": args.family, "size": args.size, "method": method_name,
               "batch": args.batch}
        family, options, method, model = build(job)
        inputs, labels = (tf.constant(a) for a in family.sample(args.size, args.batch, **options))
        make_train_step(method, model).get_concrete_function(inputs, labels)
        parts = ", ".join(f"{k} {v:.2f}" for k, v in spent.items())
        print(f"{method_name}: grad build {method.info['grad_build_s']:.2f} s "
              f"(load {os.getloadavg()[0]:.1f}){'; ' + parts if parts else ''}", flush=True)


if __name__ == "__main__":
    main()
