"""Issue 15 section 3's budget target, from `predicted_vs_measured` rows: is each budget met?

    python -m benchmarks.budget_table budgets_before_071e31f [more ...] --out budgets_071e31f

Reads results/<name>.jsonl (rows of `predicted_vs_measured --methods budget0.3,...`),
writes results/<out>.md: per model, threading and budget, the measured activation peak
(the allocator's, median of 3 calls, and every call) over the budget, met if at most
1.15; with `--requested` rows also the peak of the bytes requested (BFC's chunk excess
left out, what the timeline predicts) over the budget. A budget is a share of
tf.gradients' *predicted* activation memory (its measured one is not a fixed number:
with one inter-op thread the weight gradients are not all alive at stock's peak).
"""

import argparse
import json
import re

from benchmarks.predicted_vs_measured import RESULTS

TOLERANCE = 1.15  # issue 15: "within the budget plus 15%"
MIB = 2 ** 20


def budget_rows(rows):
    """The rows of budget methods, in their order."""
    return [r for r in rows if r["method"].startswith("budget")]


def table_line(row):
    """One markdown line: the budget, what was predicted and measured, met or not."""
    head = f"| {row['model']} | {row['threads']} | {row['method'][6:]} |"
    if "error" in row:
        smallest = re.search(r"smallest feasible budget on this graph is ([\d.]+) MiB",
                             row["error"])
        reason = f"infeasible (least {smallest.group(1)} MiB)" if smallest else row["error"][:60]
        return f"{head} | | {reason} | | | | |"
    budget = row["budget"]
    calls = ", ".join(f"{m / MIB:.1f}" for m in row["measured_all"])
    ratio = row["measured"] / budget
    requested = (f"{row['requested'] / MIB:.1f} | {row['requested'] / budget:.2f}"
                 if "requested" in row else " | ")
    met = "met" if ratio <= TOLERANCE else "**missed**"
    return (f"{head} {budget / MIB:.1f} | {row['predicted'] / MIB:.1f} | "
            f"{row['measured'] / MIB:.1f} ({calls}) | {ratio:.2f} | {met} | {requested} |")


def write(rows, path):
    lines = ["| model | threads | share | budget MiB | predicted MiB | measured MiB (calls) | "
             "measured / budget | within 15% | requested MiB | requested / budget |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [table_line(r) for r in budget_rows(rows)]
    path.write_text("\n".join(lines) + "\n")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="+", help="results/<name>.jsonl files to read")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    rows = [json.loads(line) for name in args.names
            for line in (RESULTS / f"{name}.jsonl").open() if line.strip()]
    write(rows, RESULTS / f"{args.out}.md")


if __name__ == "__main__":
    main()
