"""A model's `"memory"` step with the rewrite's copies of transposed convolutions
as the stock op and scratch-free, beside tf.gradients: `step_time_parts` with
those three variants, one fresh process per threading.

    python -m benchmarks.transposed_copies [--models unet] [--threads default,1] [--out NAME]

"memory, stock copies" is `"memory"` traced with
`transposed_copies.recomputes_scratch_free` off (plan and copies as before the
scratch-free copies). Rows are step_time_parts' (activation memory measured
and predicted, recompute, median times of 15 calls made in turn across the
three), appended to results/NAME.jsonl. Rows written before this was a
variant of step_time_parts have `measured`, `seconds` where these have
`activation_bytes`, `wall_s`.
"""

import argparse
import os
import subprocess
import sys

ROUNDS = 15
VARIANTS = ("tf.gradients", "memory, stock copies", "memory")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="unet")
    parser.add_argument("--threads", default="default,1",
                        help="inter-op threads per process: default or a number")
    parser.add_argument("--out", default="transposed_copies")
    args = parser.parse_args(argv)
    for model_name in args.models.split(","):
        for threads in args.threads.split(","):
            env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
            env.pop("TF_NUM_INTEROP_THREADS", None)
            if threads != "default":
                env["TF_NUM_INTEROP_THREADS"] = threads
            subprocess.run([sys.executable, "-m", "benchmarks.step_time_parts",
                            "--model", model_name, "--rounds", str(ROUNDS), "--out", args.out,
                            "--variants", *VARIANTS], env=env, check=True, timeout=1800)


if __name__ == "__main__":
    main()
