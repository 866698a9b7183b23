"""Runs worker jobs, each in a fresh Python subprocess, and collects their rows.

One method's traced graphs, caches and allocations must not share a process
with another method's, so every job is a new `python -m benchmarks.worker`
process. A crash (segfault, out of memory) or a timeout becomes a row with
status 'crashed' or 'timeout', not an exception.
"""

import json
import os
import re
import subprocess
import sys
import tempfile
import time

from benchmarks.methods import BASELINE

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_job(job, timeout=None):
    """Runs `job` (a dict) in a fresh worker process; returns its result.

    `timeout` (s) defaults to 900, and to 2700 for a max-batch search, whose
    bisection down to one batch takes a dozen probes of the largest batches.
    """
    if timeout is None:
        timeout = 2700 if job.get("kind") == "max_batch" else 900
    with tempfile.TemporaryDirectory(prefix="msg_bench_") as tmp:
        job_path, out_path = os.path.join(tmp, "job.json"), os.path.join(tmp, "out.json")
        with open(job_path, "w") as f:
            json.dump(job, f)
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=os.pathsep.join(
            p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
        start = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, "-m", "benchmarks.worker", job_path, out_path],
                                  cwd=REPO, env=env, capture_output=True, text=True,
                                  timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            return _failed(job, "timeout", f"no result after {timeout} s")
        wall = time.perf_counter() - start
        if proc.returncode != 0 or not os.path.exists(out_path):
            return _failed(job, "crashed", f"exit code {proc.returncode}: "
                           f"{without_dirs(proc.stderr.strip()[-1500:])}")
        with open(out_path) as f:
            result = json.loads(without_dirs(f.read()))
    result["wall_s"] = round(wall, 2)
    return result


def without_dirs(text):
    """`text` with the directories of file paths dropped (tracebacks in the
    results must not name this machine's directories)."""
    return re.sub(r"(?:/[\w.+-]+)+/([\w.+-]+\.py)", r"\1", text)


def _failed(job, status, error):
    row = {k: v for k, v in job.items() if k in ("family", "size", "method", "batch", "cap_bytes")}
    row.update(status=status, error=error)
    return row


def measure_jobs(family, size, methods, batch, steps, options=None):
    """Jobs measuring each of `methods` on one model."""
    return [dict(family=family, size=size, method=m, batch=batch, steps=steps,
                 options=options or {}) for m in methods]


def max_batch_jobs(family, size, methods, batch, cap_bytes, options=None):
    """Jobs searching each method's largest batch under `cap_bytes`."""
    return [dict(kind="max_batch", family=family, size=size, method=m, batch=batch,
                 cap_bytes=cap_bytes, options=options or {}) for m in methods]


def add_ratios(rows):
    """Adds memory and max-batch ratios to the tf.gradients row of the same
    model (measured in another process: memory does not drift with machine
    load as time does; the worker takes the time ratio side by side)."""
    def key(r):
        return r["family"], r["size"], r.get("batch"), "cap_bytes" in r

    base = {key(r): r for r in rows if r["method"] == BASELINE and r.get("status") == "ok"}
    for r in rows:
        b = base.get(key(r))
        if b is None or r.get("status") != "ok":
            continue
        for value, ratio in (("peak_bytes", "peak_ratio"),
                             ("activation_bytes", "activation_ratio"),
                             ("max_batch", "max_batch_ratio")):
            if r.get(value) is not None and b.get(value):
                r[ratio] = round(r[value] / b[value], 4)
    return rows
