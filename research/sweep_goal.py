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

from gefen_dist.bench.sweep import TRAINS_WITHIN as WITHIN_BEST
from gefen_dist.bench.sweep import final_loss

GOAL = 0.05


def load(path: str, revision: str | None) -> tuple[str, list[dict]]:
    recs = [json.loads(line) for line in open(path) if line.strip()]
    recs = [r for r in recs if final_loss(r) is not None]
    rev = revision or max(recs, key=lambda r: r["time"])["revision"]
    return rev, [r for r in recs if r["revision"].startswith(rev)]


def table(recs: list[dict], optimizers: list[str]) -> list[str]:
    loss: dict[tuple, float] = {}
    for r in recs:
        loss[(r["task"], r["optimizer"], r["lr_factor"], r["seed"])] = final_loss(r)
    # AdamW's seeds per (task, grid factor): the grid, and the seeds every pairing runs over
    seeds: dict[tuple[str, float], list[int]] = defaultdict(list)
    for task, opt, f, s in sorted(loss):
        if opt == "adamw":
            seeds[(task, f)].append(s)
    head = "| task | lr (x task lr) | AdamW (seeds) | vs its best | "
    head += " | ".join(f"{o} - AdamW" for o in optimizers) + " |"
    out = [head, "|" + "---|" * (4 + len(optimizers))]
    means = {
        k: statistics.mean(loss[(k[0], "adamw", k[1], s)] for s in ss) for k, ss in seeds.items()
    }
    for task in sorted({t for t, _ in seeds}):
        best = min(m for (t, _), m in means.items() if t == task)
        for f in sorted(f for t, f in seeds if t == task):
            above = means[(task, f)] / best - 1
            cells = []
            for o in optimizers:
                gaps = [
                    100 * (loss[(task, o, f, s)] / loss[(task, "adamw", f, s)] - 1)
                    for s in seeds[(task, f)]
                    if (task, o, f, s) in loss
                ]
                cells.append(_cell(gaps, above <= WITHIN_BEST))
            trains = "" if above <= WITHIN_BEST else " (AdamW off)"
            mean, n = means[(task, f)], len(seeds[(task, f)])
            row = f"| {task} | x{f:g} | {mean:.4f} ({n}) | {100 * above:+.1f} %{trains}"
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
