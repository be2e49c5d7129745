"""``python -m gefen_dist.bench.bf16 RUNS.jsonl [...]``: the pure-bf16 table of docs/bf16.md.

Why apart from the suite's report: the question is the whole training state (weights,
gradients and optimizer state per parameter), not the optimizer state alone, and each bf16 run
against AdamW with fp32 weights on the same seed. Reads the suite's stores (``compare --out``
writes OUT/runs.jsonl), in each the records of its last record's revision.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

ORDER = ("adamw", "gefen4", "gefen4_bf16", "gefen4_bf16_sr")


def table(paths: list[Path]) -> str:
    rows: dict[tuple[str, str], dict[int, dict]] = {}
    steps: dict[str, int] = {}
    for path in paths:
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        newest = records[-1]["revision"] if records else None
        for r in records:
            body = r.get("body", r)
            if r["revision"] != newest:
                continue
            if body.get("status") != "ok" or "training_bytes_per_param" not in body:
                continue
            rows.setdefault((r["task"], r["optimizer"]), {})[r["seed"]] = body
            steps[r["task"]] = body["final"]["step"]
    out = [
        "| task (steps) | optimizer | seeds | val loss | vs AdamW (paired) | weights | grads "
        "| opt. state | whole state B/param | of AdamW's |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for task in sorted({t for t, _ in rows}):
        base = rows.get((task, "adamw"), {})
        whole = statistics.mean(b["training_bytes_per_param"] for b in base.values()) if base else 0
        for opt in ORDER:
            runs = rows.get((task, opt))
            if not runs:
                continue
            seeds = sorted(runs)
            loss = [runs[s]["final"]["val_loss"] for s in seeds]
            paired = [
                100 * (runs[s]["final"]["val_loss"] / base[s]["final"]["val_loss"] - 1)
                for s in seeds
                if s in base
            ]
            rel = "" if opt == "adamw" or not paired else _pm(paired, "%")
            b = runs[seeds[0]]
            tb = b["training_bytes_per_param"]
            out.append(
                f"| {task} ({steps[task]}) | {opt} | {len(seeds)} | {_pm(loss)} | {rel} | "
                f"{b['weight_bytes_per_param']:.2f} | {b['grad_bytes_per_param']:.2f} | "
                f"{b['bytes_per_param']:.2f} | {tb:.2f} | "
                f"{tb / whole:.2f} |"
                if whole
                else f"| {task} | {opt} | {len(seeds)} | {_pm(loss)} | | | | | {tb:.2f} | |"
            )
    return "\n".join(out)


def _pm(xs: list[float], unit: str = "") -> str:
    m = statistics.mean(xs)
    if len(xs) < 2:
        return f"{m:+.2f}{unit}" if unit else f"{m:.4f}"
    sd = statistics.stdev(xs)
    return f"{m:+.2f} ± {sd:.2f}{unit}" if unit else f"{m:.4f} ± {sd:.4f}"


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m gefen_dist.bench.bf16 RUNS.jsonl [RUNS.jsonl ...]")
    print(table([Path(a) for a in sys.argv[1:]]))
