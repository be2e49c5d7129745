"""Paired Δ tables from research run records (issue 43): for each (task, lr, optimizer), the
relative final validation loss against AdamW at the same task, lr and seed, mean ± s.e.

    cd research/results && python ../paired.py high_lr_best.jsonl high_lr_head.jsonl

Records (one JSON per line) need ``task``, ``lr``, ``optimizer``, ``seed``, ``status`` and
``final.val_loss``; AdamW's may come from any of the files given.
"""

from __future__ import annotations

import json
import math
import sys
from collections import defaultdict


def load(paths: list[str]) -> dict[tuple, float]:
    out: dict[tuple, tuple[float, str]] = {}
    for path in paths:
        for line in open(path):
            if not line.strip():
                continue
            r = json.loads(line)
            if r.get("status") != "ok":
                continue
            key = (r["task"], float(r["lr"]), r["optimizer"], int(r["seed"]))
            val = float(r["final"]["val_loss"])
            if key in out and out[key][0] != val:
                raise ValueError(
                    f"{key} is {out[key][0]} in {out[key][1]} and {val} in {path}: "
                    "records of different code; pass one of them"
                )
            out[key] = (val, path)
    return {k: v for k, (v, _) in out.items()}


def table(runs: dict[tuple, float]) -> list[str]:
    cells: dict[tuple, list[tuple[int, float]]] = defaultdict(list)
    for (task, lr, opt, seed), val in runs.items():
        base = runs.get((task, lr, "adamw", seed))
        if opt != "adamw" and base is not None:
            cells[(task, lr, opt)].append((seed, 100.0 * (val / base - 1.0)))
    rows = [
        "| task | lr | optimizer | seeds | Δ vs AdamW | per seed |",
        "|---|---|---|---|---|---|",
    ]
    for (task, lr, opt), ds in sorted(cells.items()):
        ds.sort()
        d = [x for _, x in ds]
        mean = sum(d) / len(d)
        se = (
            math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1) / len(d))
            if len(d) > 1
            else 0.0
        )
        per = " ".join(f"{x:+.1f}" for x in d)
        seeds = ",".join(str(s) for s, _ in ds)
        rows.append(f"| {task} | {lr:g} | {opt} | {seeds} | {mean:+.2f} ± {se:.2f} % | {per} |")
    return rows


if __name__ == "__main__":
    print("\n".join(table(load(sys.argv[1:]))))
