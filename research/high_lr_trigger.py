"""Tables of the spread trigger's runs (issue 43): Δ vs AdamW per cell, where it fired, memory.

Reads the JSON lines ``research/high_lr_rnn.py`` writes (``--variant trig`` logs the trigger
without acting on it; ``trig_b1`` / ``trig_c`` switch the tensors it fires on, see
``research/high_lr_probe.py``) and prints markdown:

- per task and lr, each optimizer+variant: final val loss per seed, the paired Δ vs AdamW at the
  same lr and seed, their mean ± standard error, the state in bytes per parameter after the
  switch;
- per run, the tensors the trigger fired on (and the step), with the first reading c_0, the
  limit it had to pass and the largest c it reached.

    PYTHONPATH=. python research/high_lr_trigger.py research/results/high_lr_trigger*.jsonl
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict


def load(paths: list[str]) -> list[dict]:
    out: dict[str, dict] = {}
    for path in paths:
        for line in open(path):
            if line.strip():
                r = json.loads(line)
                out[r["key"]] = r
    return list(out.values())


def _val(r: dict) -> float:
    return r["final"]["val_loss"] if r.get("status") == "ok" and r.get("final") else float("nan")


def delta_table(records: list[dict]) -> str:
    adamw = {(r["task"], r["lr"], r["seed"]): _val(r) for r in records if r["optimizer"] == "adamw"}
    cells: dict[tuple, dict[int, dict]] = defaultdict(dict)
    for r in records:
        if r["optimizer"] != "adamw":
            cells[(r["task"], r["lr"], r["optimizer"])][r["seed"]] = r
    rows = [
        "| task | lr | optimizer+variant | AdamW per seed | Δ vs AdamW per seed | mean ± se | "
        "B/param |",
        "|---|---|---|---|---|---|---|",
    ]
    for (task, lr, opt), by_seed in sorted(cells.items()):
        seeds = sorted(by_seed)
        ds, aws = [], []
        for s in seeds:
            a = adamw.get((task, lr, s), float("nan"))
            aws.append(f"{a:.4f}")
            ds.append(100 * (_val(by_seed[s]) / a - 1))
        mean = statistics.fmean(ds)
        se = statistics.stdev(ds) / len(ds) ** 0.5 if len(ds) > 1 else float("nan")
        r0 = by_seed[seeds[0]]
        trig = r0.get("trigger") or {}
        bpp = [
            (by_seed[s].get("trigger") or {}).get("bytes_per_param_after")
            or by_seed[s].get("bytes_per_param")
            for s in seeds
        ]
        bpp_s = " / ".join(f"{b:.2f}" for b in bpp if b is not None)
        del trig
        rows.append(
            f"| {task} | {lr:g} | {opt} | {' '.join(aws)} | "
            f"{' '.join(f'{d:+.1f}' for d in ds)} % | {mean:+.2f} ± {se:.2f} % | {bpp_s} |"
        )
    return "\n".join(rows)


def fire_table(records: list[dict]) -> str:
    rows = [
        "| task | lr | optimizer+variant | seed | fired: tensor @ step (c_0 -> limit) | "
        "not fired: tensor peak c / limit | extra B/param |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in sorted(records, key=lambda r: (r["task"], r["lr"], r["optimizer"], r["seed"])):
        trig = r.get("trigger")
        if not trig:
            continue
        fired, quiet = [], []
        for name, t in trig["tensors"].items():
            if t["numel"] < 4096 or t.get("accept") is None:
                continue
            short = name.replace("transformer.", "").replace(".weight", "")
            if t["fired"] is not None:
                fired.append(f"{short} @{t['fired']} ({t['accept']:.2f} -> {t['limit']:.2f})")
            else:
                quiet.append(f"{short} {t['peak']:.2f}/{t['limit']:.2f}")
        rows.append(
            f"| {r['task']} | {r['lr']:g} | {r['optimizer']} | {r['seed']} | "
            f"{'; '.join(fired) or '—'} | {'; '.join(quiet)} | "
            f"{trig['extra_bytes_per_param']:.3f} |"
        )
    return "\n".join(rows)


def growth_table(records: list[dict]) -> str:
    """From the runs that only log (``+trig``): per cell and tensor, the largest growth of the
    spread over its first reading, (1 + c) / (1 + max(c_0, 0)), per seed, and the step the
    trigger would have fired at (it fires at a growth of 1 + ALIKE = 1.5)."""
    cells: dict[tuple, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for r in sorted(records, key=lambda r: r["seed"]):
        if not r["optimizer"].endswith("+trig") or not r.get("trigger"):
            continue
        for name, t in r["trigger"]["tensors"].items():
            if t["numel"] < 4096 or t.get("accept") is None:
                continue
            short = name.replace("transformer.", "").replace(".weight", "")
            grow = (1 + t["peak"]) / (1 + max(t["accept"], 0.0))
            at = f"@{t['fired']}" if t["fired"] is not None else ""
            cells[(r["task"], r["lr"], r["optimizer"])][short].append(f"{grow:.2f}{at}")
    rows = [
        "| task | lr | optimizer | tensor: peak growth (1 + c) / (1 + c_0) per seed, @ the step "
        "it passed 1.5 |",
        "|---|---|---|---|",
    ]
    for (task, lr, opt), tensors in sorted(cells.items()):
        body = "; ".join(f"{n} {' '.join(v)}" for n, v in tensors.items())
        rows.append(f"| {task} | {lr:g} | {opt} | {body} |")
    return "\n".join(rows)


def main() -> None:
    records = load(sys.argv[1:])
    print(delta_table(records))
    print()
    print(growth_table(records))
    print()
    print(fire_table(records))


if __name__ == "__main__":
    main()
