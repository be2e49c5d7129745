"""The table of ``research/gru_warmup.py``'s records: per task, lr, seed and arm, the final val
loss over the init perturbations (mean ± standard error, range) and its gap to AdamW's mean on
that seed. Several files read as one (another study's arms against the AdamW runs stored here).
Where the records span more than one version of the package (``gefen_dist/``, ``csrc/``), each
Gefen arm is named with the package's version it ran (``@`` its last change before the record's
``rev``); AdamW's runs are torch's and pool across versions.

    PYTHONPATH=. python research/gru_warmup_table.py research/results/gru_warmup.jsonl
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict

from research.gru_warmup import arm
from research.paired import package


def main(*paths: str) -> None:
    records = [json.loads(x) for path in paths for x in open(path) if x.strip()]
    versions = {package(r["rev"]) for r in records}
    runs: dict[tuple[str, int, str], list[float]] = defaultdict(list)
    for r in records:
        cell = f"{r['task']} {r['lr']:g}"
        name = arm(r["optimizer"])
        if len(versions) > 1 and not name.startswith("adamw"):
            name += f" @{package(r['rev'])}"
        runs[(cell, r["seed"], name)].append(r["final"]["val_loss"])
    print("| task, lr | seed | arm | runs | val loss | range | vs AdamW's mean |")
    print("|---|---|---|---|---|---|---|")
    for cell, seed, name in sorted(runs, key=lambda k: (k[0], k[1], k[2] != "adamw", k[2])):
        v = runs[(cell, seed, name)]
        a = runs.get((cell, seed, "adamw"))
        ref = statistics.mean(a) if a else float("nan")
        se = statistics.stdev(v) / len(v) ** 0.5 if len(v) > 1 else float("nan")
        m = statistics.mean(v)
        print(
            f"| {cell} | {seed} | {name} | {len(v)} | {m:.4f} ± {se:.4f} "
            f"| {min(v):.4f}-{max(v):.4f} | {100 * (m / ref - 1):+.1f} % |"
        )


if __name__ == "__main__":
    main(*sys.argv[1:])
