"""Issue 43's goal read off an lr sweep's records: Gefen against AdamW at every grid lr where AdamW
trains.

Why: the sweep's report (``gefen_dist.bench.sweep``) compares each optimizer at its own best lr
and Gefen at AdamW's; the issue asks more, that at every grid lr where AdamW's mean final val
loss is within 20 % of its best, Gefen is within 5 % of AdamW at that lr. This takes the sweep's
records as stored (every seed at a grid point, sweep and confirm seeds alike, paired by seed) and
prints that table. Only records of one code revision are read (the newest in the file, or
``--revision``), as the report does.

    python research/sweep_goal.py results/bench/lr_sweep_recurrent/runs.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import defaultdict

WITHIN_BEST, GOAL = 0.20, 0.05


def load(path: str, revision: str | None) -> tuple[str, list[dict]]:
    recs = [json.loads(line) for line in open(path) if line.strip()]
    recs = [r for r in recs if r.get("status") == "ok" and r.get("final")]
    rev = revision or max(recs, key=lambda r: r["time"])["revision"]
    return rev, [r for r in recs if r["revision"].startswith(rev)]


def table(recs: list[dict], optimizers: list[str]) -> list[str]:
    loss: dict[tuple, float] = {}
    for r in recs:
        loss[(r["task"], r["optimizer"], r["lr_factor"], r["seed"])] = r["final"]["val_loss"]
    grid: dict[str, set[float]] = defaultdict(set)
    for task, opt, f, _ in loss:
        if opt == "adamw":
            grid[task].add(f)
    head = "| task | lr (x task lr) | AdamW (seeds) | vs its best | "
    head += " | ".join(f"{o} - AdamW" for o in optimizers) + " |"
    out = [head, "|" + "---|" * (4 + len(optimizers))]
    for task in sorted(grid):
        means = {}
        for f in grid[task]:
            seeds = [s for (t, o, g, s) in loss if (t, o, g) == (task, "adamw", f)]
            means[f] = statistics.mean(loss[(task, "adamw", f, s)] for s in seeds)
        best = min(means.values())
        for f in sorted(grid[task]):
            above = means[f] / best - 1
            seeds = sorted(s for (t, o, g, s) in loss if (t, o, g) == (task, "adamw", f))
            cells = []
            for o in optimizers:
                gaps = [
                    100 * (loss[(task, o, f, s)] / loss[(task, "adamw", f, s)] - 1)
                    for s in seeds
                    if (task, o, f, s) in loss
                ]
                cells.append(_cell(gaps, above <= WITHIN_BEST))
            trains = "" if above <= WITHIN_BEST else " (AdamW off)"
            n = len(seeds)
            row = f"| {task} | x{f:g} | {means[f]:.4f} ({n}) | {100 * above:+.1f} %{trains}"
            out.append(row + " | " + " | ".join(cells) + " |")
    return out


def _cell(gaps: list[float], judged: bool) -> str:
    if not gaps:
        return "-"
    mean = statistics.mean(gaps)
    se = statistics.stdev(gaps) / math.sqrt(len(gaps)) if len(gaps) > 1 else float("nan")
    text = f"{mean:+.2f} ± {se:.2f} % ({len(gaps)})"
    return f"**{text}**" if judged and mean > 100 * GOAL else text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", help="a sweep's runs.jsonl")
    ap.add_argument("--optimizers", default="gefen8,gefen4")
    ap.add_argument("--revision", help="a code revision's prefix (default: the newest record's)")
    args = ap.parse_args()
    rev, recs = load(args.runs, args.revision)
    print(f"revision {rev}; {len(recs)} records; bold: a mean gap above {100 * GOAL:g} % where")
    print(f"AdamW is within {100 * WITHIN_BEST:g} % of its best (mean ± standard error, seeds)\n")
    print("\n".join(table(recs, args.optimizers.split(","))))


if __name__ == "__main__":
    main()
