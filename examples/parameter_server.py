"""Example: parameter-server training with checkpointing, as a cluster in one process.

    python -m examples.parameter_server [--steps 3]

Starts two workers and one parameter server as in-process gRPC servers on
127.0.0.1 (a real cluster runs them as separate processes and names them in
TF_CONFIG), and trains a tanh chain with
tf.distribute.experimental.ParameterServerStrategy: the coordinator (this
process) schedules each step on a free worker, which reads the weights from
the parameter server, differentiates with `memory_saving_gradients.gradients`
and writes the update back. The same training with stock `tf.gradients`
follows, from the same start, and the largest weight difference is printed.
"""

import argparse
import logging
import socket

import numpy as np
import tensorflow as tf

import memory_saving_gradients as msg


def local_cluster(workers=2, parameter_servers=1):
    """Starts the cluster's servers in this process; returns its ClusterSpec."""
    def free_port():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    jobs = {"worker": workers, "ps": parameter_servers}
    cluster = tf.train.ClusterSpec({job: [f"127.0.0.1:{free_port()}" for _ in range(n)]
                                    for job, n in jobs.items()})
    for job, n in jobs.items():
        for index in range(n):
            tf.distribute.Server(cluster, job_name=job, task_index=index, start=True)
    return cluster


def train(strategy, grad_fn, steps, depth=6, width=16, batch=128, learning_rate=0.01):
    """Trains `steps` scheduled SGD steps; returns the final weights as numpy arrays."""
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        weights = [tf.Variable(tf.random.stateless_normal([width, width], seed=[i, 0]) * 0.3)
                   for i in range(depth)]

    @tf.function
    def train_step():
        def replica_step(inputs):
            h = inputs
            for w in weights:
                h = tf.tanh(tf.matmul(h, w))
            grads = grad_fn(tf.reduce_sum(h * h) / batch, weights)
            for w, g in zip(weights, grads):
                w.assign_sub(learning_rate * g)
        strategy.run(replica_step, args=(tf.ones([batch, width]),))

    for _ in range(steps):
        coordinator.schedule(train_step)
        coordinator.join()  # one step at a time, so the runs are comparable
    return [w.numpy() for w in weights]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    logging.basicConfig(format="%(message)s")
    logging.getLogger("memory_saving_gradients").setLevel(logging.INFO)  # print the plans
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        local_cluster(), rpc_layer="grpc")
    strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
    ours = train(strategy, msg.gradients_memory, args.steps)
    stock = train(strategy, tf.gradients, args.steps)
    difference = max(float(np.max(np.abs(a - b))) for a, b in zip(ours, stock))
    print(f"{args.steps} steps on 2 workers and a parameter server; largest weight "
          f"difference checkpointing vs tf.gradients: {difference:.2e}")


if __name__ == "__main__":
    main()
