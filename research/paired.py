"""Paired Δ tables from research run records (issue 43): for each (task, lr, optimizer), the
relative final validation loss against AdamW at the same task, lr and seed, mean ± s.e.; with
``--against OPT``, each optimizer's Δ minus OPT's Δ on the same seeds (how far a variant moved
from a baseline, paired). With ``--metric val_acc`` a classifier's accuracy instead: Δ in
points, acc - AdamW's acc (the suite's figure for its classifiers).

    cd research/results
    python ../paired.py high_lr_best.jsonl high_lr_head.jsonl
    python ../paired.py --against gefen4+ref high_lr_best.jsonl high_lr_head.jsonl
    python ../paired.py --metric val_acc high_lr_head.jsonl

Records (one JSON per line) need ``task``, ``lr`` (or the suite store's ``settings.hyper.lr``),
``optimizer``, ``seed``, ``status`` and ``final.val_loss``; AdamW's may come from any of the files
given. ``--by-revision`` names every other optimizer with the version of the package it ran (the
suite store's code ``revision``, or for a record with only the HEAD it ran at, ``rev``, the last
commit at or before it that changed ``gefen_dist/`` or ``csrc/``), so two versions of the package
compare paired:

    python research/paired.py --by-revision --against gefen8@eaa63e5 \
        research/results/adamw_floor_suite/*/runs.jsonl
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import subprocess
from collections import defaultdict


@functools.cache
def package(rev: str) -> str:
    """The last commit at or before ``rev`` that changed the package."""
    cmd = ["git", "log", "-1", "--format=%h", rev, "--", "gefen_dist", "csrc"]
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()


def load(
    paths: list[str], metric: str = "val_loss", by_revision: bool = False
) -> dict[tuple, float]:
    out: dict[tuple, tuple[float, str]] = {}
    for path in paths:
        for line in open(path):
            if not line.strip():
                continue
            r = json.loads(line)
            if r.get("status") != "ok" or metric not in r["final"]:
                continue
            lr = r["lr"] if "lr" in r else r["settings"]["hyper"]["lr"]
            opt = r["optimizer"]
            if by_revision and opt != "adamw":
                opt += "@" + (r["revision"][:7] if "revision" in r else package(r["rev"]))
            key = (r["task"], float(lr), opt, int(r["seed"]))
            val = float(r["final"][metric])
            if key in out and out[key][0] != val:
                raise ValueError(
                    f"{key} is {out[key][0]} in {out[key][1]} and {val} in {path}: "
                    "records of different code; pass one of them"
                )
            out[key] = (val, path)
    return {k: v for k, (v, _) in out.items()}


def deltas(runs: dict[tuple, float], points: bool = False) -> dict[tuple, dict[int, float]]:
    """Per (task, lr, optimizer): seed -> Δ vs AdamW in % (``points``: in points of a
    fraction, 100 (x - x_AdamW)), where AdamW ran that seed."""
    out: dict[tuple, dict[int, float]] = defaultdict(dict)
    for (task, lr, opt, seed), val in runs.items():
        base = runs.get((task, lr, "adamw", seed))
        if opt != "adamw" and base is not None:
            out[(task, lr, opt)][seed] = 100.0 * (val - base if points else val / base - 1.0)
    return out


def mean_se(xs: list[float]) -> tuple[float, float]:
    se = statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else 0.0
    return statistics.fmean(xs), se


def table(runs: dict[tuple, float], against: str = "", points: bool = False) -> list[str]:
    head = "Δ vs AdamW" + (" (points)" if points else "")
    head = head if not against else f"Δ minus {against}'s Δ (points)"
    rows = [f"| task | lr | optimizer | seeds | {head} | per seed |", "|---|---|---|---|---|---|"]
    cells = deltas(runs, points)
    for (task, lr, opt), by_seed in sorted(cells.items()):
        if against:
            ref = cells.get((task, lr, against), {})
            by_seed = {s: d - ref[s] for s, d in by_seed.items() if s in ref}
            if opt == against or not by_seed:
                continue
        seeds = sorted(by_seed)
        d = [by_seed[s] for s in seeds]
        mean, se = mean_se(d)
        per = " ".join(f"{x:+.1f}" for x in d)
        unit = "" if against or points else " %"
        rows.append(
            f"| {task} | {lr:g} | {opt} | {','.join(map(str, seeds))} "
            f"| {mean:+.2f} ± {se:.2f}{unit} | {per} |"
        )
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--against", default="", help="a baseline optimizer name, e.g. gefen4+ref")
    ap.add_argument("--metric", default="val_loss", choices=["val_loss", "val_acc"])
    ap.add_argument("--by-revision", action="store_true", help="optimizer@revision, AdamW pooled")
    a = ap.parse_args()
    runs = load(a.files, a.metric, a.by_revision)
    print("\n".join(table(runs, a.against, points=a.metric == "val_acc")))
