"""Tables of the lower-tail / EMA-reference / EMA-of-R trigger runs (issue 43, helper h43b).

Reads the JSON lines ``research/high_lr_rnn.py --variant trig2`` (logging: every step t >= 2 of
``high_lr_probe.tail_stats`` per blocked tensor) and ``--variant trig2_b1,rule_NAME`` (switching)
write, plus AdamW's records of the earlier study (same keys, same init and data), and prints
markdown:

- per logging run and tensor, the step each candidate rule fires at, recomputed offline from the
  per-step readings (so one logging run answers every rule): the EMA (b2, bias-corrected as v is)
  of the statistic against a reference read either at the first reading (step 2, ``@1``) or at
  the b2 horizon (step 1 + 1 / (1 - b2), ``@h``), with the thresholds of ``high_lr_probe.RULES``
  (a lower-tail mean falling by ln(1 + ALIKE) / 2; the spread growing by (1 + ALIKE); the EMA of
  R above STRUCTURE); ``truth`` applies the lower-tail rule to the per-element EMA's own reading
  (``lt``), which no rule may read;
- per logging run and tensor, the statistics at a few steps (reference, 100, 200, 300, 500);
- Δ vs AdamW per run: ``+trig2`` (logging, the reference backend as built), the earlier
  study's ``+trig`` runs (the same, read from its files) and ``+trig2_b1,rule_NAME``
  (switching), with the state after the switch and the witnesses' own state.

    PYTHONPATH=. python research/high_lr_trigger2.py   # high_lr_trigger2.jsonl + the earlier files
"""

from __future__ import annotations

import json
import math
import sys

from gefen_dist.method import partition

AW_FILES = (
    "research/results/high_lr_trigger.jsonl",
    "research/results/high_lr_trigger_lstm.jsonl",
)
TAIL = ("la1", "la2", "lb", "lbn")
DROP = math.log1p(partition.ALIKE) / 2.0
FAILING = {("lstm", 0.1), ("gru_wide", 0.03)}
"""Cells where Gefen trails AdamW by > 5 % (the rule should fire); the others must stay silent."""
B2 = 0.95  # the recurrent tasks' and gpt2's beta2 (tasks.Hyper)


def load(paths) -> list[dict]:
    out: dict[str, dict] = {}
    for path in paths:
        try:
            lines = open(path).read().splitlines()
        except FileNotFoundError:
            continue
        for line in lines:
            if line.strip():
                r = json.loads(line)
                out[r["key"]] = r
    return list(out.values())


def ema_series(rows: list[list], fields: list[str], col: str, beta2: float = B2):
    """(step, bias-corrected EMA) of column ``col`` (a non-finite reading holds the EMA)."""
    i = fields.index(col)
    e, n, out = 0.0, 0, []
    if rows and len(rows[0]) <= i:
        return []
    for row in rows:
        n += 1
        bc = 1.0 - beta2**n
        x = row[i]
        if x is None or not math.isfinite(x):
            x = e / (1.0 - beta2 ** (n - 1)) if n > 1 else 0.0
        e = beta2 * e + (1.0 - beta2) * x
        out.append((row[0], e / bc))
    return out


def raw_series(rows, fields, col):
    i = fields.index(col)
    return [(row[0], row[i]) for row in rows if len(row) > i]


def fire_step(series, kind: str, ref_at: str, beta2: float = B2):
    """The first step the rule passes its threshold (None: never), and its reference."""
    if not series:
        return None, None
    h = round(1.0 / (1.0 - beta2))
    idx = 0 if ref_at == "1" else min(h - 1, len(series) - 1)
    ref = series[idx][1]
    for step, x in series[idx + 1 :]:
        if kind == "tail" and x < ref - DROP:
            return step, ref
        if kind == "half" and x < ref - DROP / 4.0:
            return step, ref
        if kind == "var" and x > ref + 2.0 * DROP:
            return step, ref
        if kind == "cv" and 1.0 + x > (1.0 + max(ref, 0.0)) * (1.0 + partition.ALIKE):
            return step, ref
    return None, ref


def rule_fires(t: dict, fields: list[str]) -> dict[str, int | None]:
    rows = t["rows"]
    out = {}
    for col in TAIL:
        s = ema_series(rows, fields, col)
        for ra in ("1", "h"):
            out[f"{col}@{ra}"] = fire_step(s, "tail", ra)[0]
    for col in ("cfh", "cfn"):
        s = ema_series(rows, fields, col)
        for ra in ("1", "h"):
            out[f"{col}@{ra}"] = fire_step(s, "var", ra)[0]
    for col in ("qh", "q1"):
        s = ema_series(rows, fields, col)
        for ra in ("1", "h"):
            out[f"{col}@{ra}"] = fire_step(s, "half", ra)[0]
    s = ema_series(rows, fields, "cv")
    for ra in ("1", "h"):
        out[f"cv@{ra}"] = fire_step(s, "cv", ra)[0]
    s = ema_series(rows, fields, "R")
    out["Rema"] = next((st for st, x in s if x > partition.STRUCTURE), None)
    s = raw_series(rows, fields, "lt")
    out["truth@h"] = fire_step(s, "tail", "h")[0]
    out["truthV@h"] = fire_step(raw_series(rows, fields, "vt"), "var", "h")[0]
    out["truthQ@h"] = fire_step(raw_series(rows, fields, "qt"), "half", "h")[0]
    out["witness@h"] = fire_step(raw_series(rows, fields, "lw"), "tail", "h")[0]
    out["witnessE@h"] = fire_step(ema_series(rows, fields, "lw"), "tail", "h")[0]
    out["truthE@h"] = fire_step(ema_series(rows, fields, "lt"), "tail", "h")[0]
    out["truthC@h"] = fire_step(raw_series(rows, fields, "cvt"), "cv", "h")[0]
    out["witnessC@h"] = fire_step(raw_series(rows, fields, "cw"), "cv", "h")[0]
    return out


def fields_of() -> list[str]:
    from research.high_lr_probe import TAIL_FIELDS

    return list(TAIL_FIELDS)


_PARAMS: dict[str, int] = {}


def _logged_tensors(recs: list[dict]):
    """(record, tensor name, its trigger log) of every logging run (``+trig2``), in key order."""
    for r in sorted(recs, key=lambda r: r["key"]):
        if r["optimizer"].endswith("+trig2") and r.get("trigger2"):
            for name, t in r["trigger2"]["tensors"].items():
                yield r, name, t


def _k(r: dict) -> str:
    """The run's key with ' ' for '|' (markdown)."""
    return r["key"].replace("|", " ")


def params_of(task: str) -> int:
    """The task's parameter count (its model built at seed 0)."""
    if task not in _PARAMS:
        from gefen_dist.bench import tasks

        inst = tasks.build(tasks.TASKS[task], 0)
        _PARAMS[task] = sum(p.numel() for p in inst.model.parameters())
    return _PARAMS[task]


def witness_bytes(r: dict) -> float:
    """The witnesses' state over the whole model, B/param: one fp32 own v per block."""
    t2 = r.get("trigger2") or {}
    nw = 0
    for t in t2.get("tensors", {}).values():
        i = fields_of().index("nw")
        nw += t.get("nw") or max((row[i] for row in t["rows"] if len(row) > i), default=0)
    return 4.0 * nw / params_of(r["task"])


def main() -> None:
    paths = sys.argv[1:] or ["research/results/high_lr_trigger2.jsonl", *AW_FILES]
    recs = load(paths)
    aw = {
        (r["task"], r["lr"], r["seed"]): r["final"]["val_loss"]
        for r in load(AW_FILES)
        if r["optimizer"] == "adamw" and r.get("final")
    }
    fields = fields_of()
    rule_names = [f"{c}@{ra}" for c in TAIL + ("cfh", "cfn", "qh", "q1") for ra in ("1", "h")] + [
        "cv@1",
        "cv@h",
        "Rema",
        "truth@h",
        "truthV@h",
        "truthQ@h",
        "witness@h",
        "witnessE@h",
        "truthE@h",
        "truthC@h",
        "witnessC@h",
    ]
    fired_rows = []
    print("## Fire steps per rule (offline, from the logging runs)\n")
    print("| run | tensor | " + " | ".join(rule_names) + " |")
    print("|---|---|" + "---|" * len(rule_names))
    for r, name, t in _logged_tensors(recs):
        f = rule_fires(t, fields)
        fired_rows.append((r, name, f))
        cells = ["—" if f[k] is None else str(f[k]) for k in rule_names]
        print(f"| {_k(r)} | {name} | " + " | ".join(cells) + " |")
    print("\n## Per rule: tensor-runs it fires on (of all), and the range of the steps\n")
    print(
        "| rule | must stay silent: gpt2 3e-3, lstm 0.03, gru_wide 1e-2 "
        "| failing: lstm 0.1, gru_wide 3e-2 |"
    )
    print("|---|---|---|")
    for k in rule_names:
        cell = {True: [0, 0, []], False: [0, 0, []]}
        for r, _name, f in fired_rows:
            fail = (r["task"], r["lr"]) in FAILING
            cell[fail][1] += 1
            if f[k] is not None:
                cell[fail][0] += 1
                cell[fail][2].append(f[k])
        txt = []
        for fail in (False, True):
            n_f, n, steps = cell[fail]
            rng = f" (steps {min(steps)}-{max(steps)})" if steps else ""
            txt.append(f"{n_f} / {n}{rng}")
        print(f"| {k} | " + " | ".join(txt) + " |")
    print("\n## Readings per tensor (EMA, b2) at steps 21 (the horizon), 100, 200, 300, 500\n")
    cols = ["lt", "lw", "cvt", "cw", "vt", "qt", "qh", "cfn", "cv", "R"]
    print("| run | tensor | " + " | ".join(cols) + " |")
    print("|---|---|" + "---|" * len(cols))
    for r, name, t in _logged_tensors(recs):
        cells = []
        for c in cols:
            s = dict(
                raw_series(t["rows"], fields, c)
                if c in ("lt", "vt", "qt", "lw", "cvt", "cw")
                else ema_series(t["rows"], fields, c)
            )
            vals = [s.get(k) for k in (21, 100, 200, 300, 500)]
            cells.append(" ".join("—" if v is None else f"{v:.2f}" for v in vals))
        print(f"| {_k(r)} | {name} | " + " | ".join(cells) + " |")
    print("\n## Δ vs AdamW (same lr, seed, init and data)\n")
    print(
        "| run | val | AdamW | Δ | fired (rule: tensor@step) | B/param after | "
        "witness state B/param (fp32) |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in sorted(recs, key=lambda r: r["key"]):
        opt = r["optimizer"]
        if not (opt.endswith(("+trig", "+per_element")) or "+trig2" in opt):
            continue  # the earlier study's other variants (its own tables)
        if r["task"] in ("gpt2",) and r["lr"] != 0.003:
            continue
        v = r["final"]["val_loss"] if r.get("final") else float("nan")
        a = aw.get((r["task"], r["lr"], r["seed"]), float("nan"))
        t2 = r.get("trigger2") or {}
        rule = t2.get("rule")
        fired = (
            ", ".join(
                f"{n}@{t['fired'][rule]}"
                for n, t in t2.get("tensors", {}).items()
                if rule in t["fired"]
            )
            if rule
            else "(log only)"
        )
        bpp = t2.get("bytes_per_param_after") or r.get("bytes_per_param") or float("nan")
        print(
            f"| {_k(r)} | {v:.4f} | {a:.4f} | {100 * (v / a - 1):+.2f} % | {fired or '—'} "
            f"| {bpp:.3f} | {witness_bytes(r):.4f} |".replace("| 0.0000 |", "| — |")
        )


if __name__ == "__main__":
    main()
