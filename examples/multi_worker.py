"""Example: a custom training loop with checkpointing on several machines.

Run one process per worker, each with TF_CONFIG naming the cluster and its
own index, e.g. on one host with two workers:

    TF_CONFIG='{"cluster": {"worker": ["localhost:12345", "localhost:12346"]},
                "task": {"type": "worker", "index": 0}}' python -m examples.multi_worker &
    TF_CONFIG='{"cluster": {"worker": ["localhost:12345", "localhost:12346"]},
                "task": {"type": "worker", "index": 1}}' python -m examples.multi_worker

MultiWorkerMirroredStrategy keeps a copy of the weights on every worker and
all-reduces the gradients (collective ops, which checkpointing never
recomputes). The step is a custom loop: Keras 3's `model.fit` fails under this
strategy for any model (see docs/distribute.md). Each worker trains the same
model from the same start twice, with `memory_saving_gradients.gradients` and
with stock `tf.gradients`, and prints (or writes with --out) both final
weights, so a run shows that checkpointing changes nothing but memory.
"""

import argparse
import logging
import json

import numpy as np
import tensorflow as tf

import memory_saving_gradients as msg
from examples import mirrored


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=512, help="global batch size")
    parser.add_argument("--out", help="write the final weights here as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(format="%(message)s")
    logging.getLogger("memory_saving_gradients").setLevel(logging.INFO)  # print the plans
    # Reads the cluster from TF_CONFIG; must come before any other TF op runs.
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    results = {name: mirrored.train(strategy, grad_fn, args.steps, args.batch)
               for name, grad_fn in (("ours", msg.gradients_memory),
                                     ("stock", tf.gradients))}
    difference = max(float(np.max(np.abs(a - b)))
                     for a, b in zip(results["ours"], results["stock"]))
    task = strategy.cluster_resolver.task_id
    print(f"worker {task}: {args.steps} steps on {strategy.num_replicas_in_sync} replicas; "
          f"largest weight difference checkpointing vs tf.gradients: {difference:.2e}")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as file:
            json.dump({name: [w.tolist() for w in weights]
                       for name, weights in results.items()}, file)


if __name__ == "__main__":
    main()
