"""Markdown tables from result rows (printed by `run`, pasted into the README).

    python -m benchmarks.report [benchmarks/results/sweep]   # rewrite sweep.md, print it
"""

import json
import sys

from benchmarks.methods import BASELINE, KNOWN_WRONG, METHODS, NO_REMAT
from benchmarks.models import FAMILIES

MIB = 2 ** 20


def _num(value, fmt):
    return "" if value is None else format(value, fmt)


def _status(r):
    if r.get("status") != "ok":
        return f"{r.get('status')}: {short_error(r.get('error'))}"
    if r.get("flagged"):
        known = KNOWN_WRONG.get((r["method"], r["family"]))
        return "WRONG GRADIENTS" + (f" (known: {known})" if known else "")
    if r.get("remat_wrapped") == 0:
        return "remat applied to no layer"
    ratio = r.get("activation_ratio")
    if r["method"] not in NO_REMAT and ratio is not None and ratio >= 0.95:
        return "saves nothing" if ratio <= 1.05 else "uses more memory than tf.gradients"
    return "ok"


def short_error(error, width=160):
    """The message of an error in one line: for Keras' 'Exception encountered
    when calling X.call()' the layer and the underlying message."""
    text = str(error or "").replace("\x1b[1m", "").replace("\x1b[0m", "")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return ""
    first = lines[0]
    if "Exception encountered when calling" in first and len(lines) > 1:
        layer = first.split("calling ")[-1].rstrip(".")
        first = f"{first.split(':')[0]} in {layer}: {lines[1]}"
    return first[:width]


def _measure_rows(rows):
    return [r for r in rows if "cap_bytes" not in r]


def _order(r):
    names = list(METHODS)
    return (list(FAMILIES).index(r["family"]), r["size"],
            names.index(r["method"]) if r["method"] in names else 99)


def _mib(value):
    return None if value is None else value / MIB


def table(rows, sizes=None):
    """One line per (model, size, method) measurement; with `sizes`
    ({family: size}), only those sizes."""
    head = ("| model | size | method | peak MiB | activations MiB | act. vs tf | "
            "step s | time vs tf | grad rel. err | kept | recomputed ops | grad build s | "
            "result |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in sorted(_measure_rows(rows), key=_order):
        if sizes is not None and r["size"] != sizes.get(r["family"]):
            continue
        lines.append(
            f"| {r['family']} | {r['size']} | {r['method']} | "
            f"{_num(_mib(r.get('peak_bytes')), '.1f')} | "
            f"{_num(_mib(r.get('activation_bytes')), '.1f')} | "
            f"{_num(r.get('activation_ratio'), '.2f')} | {_num(r.get('step_s'), '.3f')} | "
            f"{_num(r.get('time_ratio'), '.2f')} | {_num(r.get('grad_rel_err'), '.1e')} | "
            f"{_num(r.get('checkpoints'), 'd')} | {_num(r.get('recomputed_ops'), 'd')} | "
            f"{_num(r.get('grad_build_s'), '.2f')} | {_status(r)} |")
    return "\n".join(lines)


def _wrong(rows):
    """(model, method) pairs whose gradients were flagged at some size."""
    return {(r["family"], r["method"]) for r in rows if r.get("flagged")}


def _pivot(rows, cell, wrong):
    """Markdown table, a line per method and a column per model (at the size
    of its rows), cells from `cell(row, (model, method) in wrong)`."""
    families = [f for f in FAMILIES if any(r["family"] == f for r in rows)]
    sizes = {r["family"]: r["size"] for r in rows}
    by_key = {(r["family"], r["method"]): r for r in rows}
    lines = ["| method | " + " | ".join(f"{f}-{sizes[f]}" for f in families) + " |",
             "|---|" + "---|" * len(families)]
    for method in [m for m in METHODS if any(r["method"] == m for r in rows)]:
        cells = []
        for f in families:
            r = by_key.get((f, method))
            if r is None:
                cells.append("")
            elif r.get("status") != "ok":
                cells.append(f"raises {str(r.get('error')).split(':')[0]}"
                             if r.get("status") == "error" else r.get("status"))
            else:
                cells.append(cell(r, (f, method) in wrong))
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ratio_table(rows, sizes):
    """Activation memory and step time relative to tf.gradients, per method and model."""
    def cell(r, wrong):
        text = f"{_num(r.get('activation_ratio'), '.2f')} / {_num(r.get('time_ratio'), '.2f')}"
        return text + (" (wrong gradients)" if wrong else "")
    chosen = [r for r in _measure_rows(rows) if r["size"] == sizes.get(r["family"])]
    return ("Activation memory / step time, each relative to tf.gradients' "
            "(each model at its largest size):\n\n" + _pivot(chosen, cell, _wrong(rows)))


def max_batch_table(rows):
    """Largest batch under the cap per method and model, and its ratio to tf.gradients'."""
    found = [r for r in rows if "cap_bytes" in r]
    if not found:
        return ""

    def cell(r, wrong):
        limit = "≥" if r["max_batch"] >= r["limit"] else ""
        ratio = r.get("max_batch_ratio")
        return (f"{limit}{r['max_batch']}" + (f" ({ratio:.2f})" if ratio is not None else "")
                + (" (wrong gradients)" if wrong else ""))
    return (f"Largest batch whose training step peaks under {found[0]['cap_bytes'] / MIB:.0f}"
            f" MiB (ratio to tf.gradients' in brackets):\n\n"
            + _pivot(found, cell, _wrong(rows)))


def summary(rows, meta):
    """Header, the ratio table and the max-batch table."""
    largest = {}
    for r in _measure_rows(rows):
        if r.get("status") == "ok" and r["method"] == BASELINE:
            largest[r["family"]] = max(largest.get(r["family"], 0), r["size"])
    parts = [f"Run {meta.get('date')}, TensorFlow {meta.get('tf_version')}, Keras "
             f"{meta.get('keras_version')}, {meta.get('cpu')} ({meta.get('cores')} cores), "
             f"{meta.get('minutes')} min: `{meta.get('command')}`", "",
             ratio_table(rows, largest), "",
             "Each model at its largest size in the sweep:", "", table(rows, largest)]
    batch = max_batch_table(rows)
    if batch:
        parts += ["", batch]
    return "\n".join(parts)


def load(base):
    with open(base + ".jsonl") as f:
        rows = [json.loads(line) for line in f]
    try:
        with open(base + ".meta.json") as f:
            meta = json.load(f)
    except OSError:
        meta = {}
    return rows, meta


def write(rows, meta, base):
    """Writes `<base>.md`: the summary, then every measurement; returns the summary."""
    text = summary(rows, meta)
    with open(base + ".md", "w") as f:
        f.write(text + "\n\nAll measurements:\n\n" + table(rows) + "\n")
    return text


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    base = argv[0] if argv else "benchmarks/results/sweep"
    rows, meta = load(base)
    print(write(rows, meta, base))


if __name__ == "__main__":
    main()
