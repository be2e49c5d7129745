"""The table of ``research/gru_warmup.py``'s records: per task, lr, seed and arm, the final val
loss over the init perturbations (mean ± standard error, range) and its gap to AdamW's mean on
that seed. Several files read as one (another study's arms against the AdamW runs stored here).

    PYTHONPATH=. python research/gru_warmup_table.py research/results/gru_warmup.jsonl
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict

from research.gru_warmup import arm


def main(*paths: str) -> None:
    runs: dict[tuple[str, int, str], list[float]] = defaultdict(list)
    for line in (x for path in paths for x in open(path)):
        if line.strip():
            r = json.loads(line)
            cell = f"{r['task']} {r['lr']:g}"
            runs[(cell, r["seed"], arm(r["optimizer"]))].append(r["final"]["val_loss"])
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
