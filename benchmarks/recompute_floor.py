"""The least recompute the planner finds at each memory share: is a (memory, time) target reachable?

    python -m benchmarks.recompute_floor [--model mlp256] [--forward-share 0.31] [--target 1.25]

Traces the model's training step once (no step is run) and, for shares of
tf.gradients' predicted activation memory, asks the planner for the plan of
least predicted recompute that fits (`strategies.fitting_plan`, the budgets'
search, judged by bytes requested), beside the `"memory"` plan itself.
Recompute is in forward passes (FLOPs recomputed / FLOPs of one forward pass).

The extra step time of a plan is about its recompute times a forward pass's
share of tf.gradients' step (`--forward-share`, measured by
`benchmarks.step_time_parts` as the `forward` row's ratio: CPU 0.31-0.33 on the
256-block MLP): a step-time target T is out of reach, for CPU time and with
one inter-op thread, at every share whose least recompute is above
(T - 1) / forward share. With default threading a recompute that runs beside
other ops could hide some of it in wall time (not modelled).
"""

import argparse

from benchmarks.predicted_vs_measured import MODELS, loss_and_weights

SHARES = (0.03, 0.05, 0.08, 0.15, 0.3, 0.5)


def planner_model(name):
    """The planner's GraphModel of the model's step, and the "memory" plan's report."""
    import tensorflow as tf
    import memory_saving_gradients as msg
    build, data = MODELS[name]
    model = build()
    inputs, labels = (tf.constant(a) for a in data())
    found = []

    @tf.function
    def step(inputs, labels):
        loss, weights = loss_and_weights(model, inputs, labels)
        found.append(msg.checkpoint_plan(loss, weights, "memory"))
        return loss

    step.get_concrete_function(inputs, labels)
    return found[0].model, found[0]


def floor_rows(model, memory_report, shares=SHARES):
    """(label, predicted share of tf.gradients' activations, recompute in forward passes)."""
    from memory_saving_gradients.core import strategies
    estimate = memory_report.estimate
    baseline, forward = estimate.baseline_bytes, max(estimate.forward_flops, 1)
    memory = (estimate.peak_bytes / baseline, estimate.recompute_flops / forward)
    rows = [('"memory"', *memory)]
    problem = strategies.cut_problem(model)
    for share in shares:
        fit = strategies.fitting_plan(model, problem, share * baseline, f"fit {share}")
        found = None if fit is None else (fit.peak_bytes / baseline,
                                          fit.recompute_flops / forward)
        # The search can miss a plan that fits (its retries run out): "memory" is one.
        if memory[0] <= share and (found is None or memory[1] < found[1]):
            found = memory
        rows.append((f"least recompute at <= {share}", *(found or (None, None))))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp256", choices=sorted(MODELS))
    parser.add_argument("--forward-share", type=float, default=0.31)
    parser.add_argument("--target", type=float, default=1.25, help="step-time ratio")
    args = parser.parse_args(argv)
    model, report = planner_model(args.model)
    allowed = (args.target - 1) / args.forward_share
    print(f"{args.model}: a step within {args.target}x allows {allowed:.2f} forward passes "
          f"of recompute at a forward share of {args.forward_share}")
    print("| plan | predicted activations vs tf.gradients | recompute (forward passes) "
          "| step time ~ 1 + recompute x forward share |")
    print("|---|---|---|---|")
    for label, share, recompute in floor_rows(model, report):
        if share is None:
            print(f"| {label} | no plan fits | - | - |")
        else:
            print(f"| {label} | {share:.3f} | {recompute:.3f} "
                  f"| {1 + recompute * args.forward_share:.2f}x |")


if __name__ == "__main__":
    main()
