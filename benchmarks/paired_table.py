"""Paired table of a ``sharing_ablation.py --out`` JSONL: every (optimizer, config, rounding,
second moment) at one task and lr factor against AdamW of the same seed.

    python benchmarks/paired_table.py results/mlp_high_lr.jsonl --task mlp --lr-factor 33

Per row, over the seeds that both have: the mean val loss; Δ vs AdamW as the paired difference
of val loss (absolute), as 100 ln(loss / AdamW's) (a relative difference that does not grow
from noise alone, as the mean of loss / AdamW's - 1 does: E[X / Y] > 1 for X, Y alike but
noisy), and as the mean of 100 (loss / AdamW's - 1) (what ``sharing_ablation.py`` prints); the
same ln-difference against the optimizer's as-built run of the seed; val acc in points. Each as
mean ± standard error over seeds, t = mean / SE. A record is taken whatever source hash it ran
under; the last one of a key wins (``sharing_ablation.py`` keeps runs of equal keys, and the
losses it repeats across hashes are identical).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics


def _ms(xs: list[float], fmt: str) -> str:
    m = statistics.mean(xs)
    if len(xs) < 2:
        return (fmt % m) + " (1 seed)"
    se = statistics.stdev(xs) / len(xs) ** 0.5
    return f"{fmt % m} ± {fmt.replace('+', '') % se} (t {m / se:+.1f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("jsonl")
    ap.add_argument("--task", default="mlp")
    ap.add_argument("--lr-factor", type=float, default=33.0)
    ap.add_argument("--min-seeds", type=int, default=1)
    args = ap.parse_args()
    recs: dict[tuple, dict] = {}
    for line in open(args.jsonl):
        r = json.loads(line)
        if r["task"] != args.task or float(r["lr_factor"]) != args.lr_factor:
            continue
        key = (r["optimizer"], r["config"], r["rounding"], r["second_moment"])
        recs.setdefault(key, {})[r["seed"]] = r
    base = recs.pop(("adamw", "", "as-built", "as-built"), {})
    loss = {s: r["final"]["val_loss"] for s, r in base.items()}
    print(
        f"task {args.task}, lr x{args.lr_factor:g}; AdamW: {len(loss)} seeds, mean val loss "
        f"{statistics.mean(loss.values()):.4f}, median {statistics.median(loss.values()):.4f}"
    )
    print(
        "| optimizer | config | rounding | second moment | seeds | val loss (mean) | "
        "Δ vs AdamW (abs) | Δ vs AdamW, 100 ln | mean of rel. Δ (%) | Δ vs as built, 100 ln | "
        "Δ val acc (pt) | bytes/param |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for key in sorted(recs):
        runs = recs[key]
        seeds = sorted(set(runs) & set(loss))
        if len(seeds) < args.min_seeds:
            continue
        v = {s: runs[s]["final"]["val_loss"] for s in seeds}
        built = recs.get((key[0], "", "as-built", "as-built"), {})
        vs_built = [
            100 * math.log(v[s] / built[s]["final"]["val_loss"]) for s in seeds if s in built
        ]
        acc = [100 * (runs[s]["final"]["val_acc"] - base[s]["final"]["val_acc"]) for s in seeds]
        cells = [
            key[0],
            key[1] or "as built",
            key[2],
            key[3],
            str(len(seeds)),
            f"{statistics.mean(v.values()):.4f}",
            _ms([v[s] - loss[s] for s in seeds], "%+.4f"),
            _ms([100 * math.log(v[s] / loss[s]) for s in seeds], "%+.1f"),
            _ms([100 * (v[s] / loss[s] - 1) for s in seeds], "%+.1f"),
            _ms(vs_built, "%+.1f") if vs_built and key[1:] != ("", "as-built", "as-built") else "",
            _ms(acc, "%+.2f"),
            f"{runs[seeds[0]]['bytes_per_param']:.3f}",
        ]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
