"""Benchmarks: memory_saving_gradients against tf.gradients, GradientTape,
tf.recompute_grad and keras.RematScope on four model families.

    python -m benchmarks.run [--quick]     # the sweep (results/, plots)
    python -m benchmarks.targets           # issue #2's performance targets

Modules, one job each:

* `models`   -- the model families, built from Keras layers on synthetic data.
* `methods`  -- the gradient methods compared, one small class each.
* `worker`   -- measures one (model, size, method, batch) in a fresh process.
* `sweep`    -- runs jobs in fresh subprocesses; ratios to tf.gradients.
* `search`   -- the max-batch search on measured peaks.
* `run`      -- the sweep command line: jobs, progress bar, JSONL/CSV output.
* `plots`    -- matplotlib figures from the result rows.
* `report`   -- the markdown summary table from the result rows.
* `targets`  -- issue #2's acceptance targets.
"""
