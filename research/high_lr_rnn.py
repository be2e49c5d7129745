"""Gefen vs AdamW above AdamW's best lr on the recurrent tasks (issue 43): an lr sweep, paired.

Why: a GRU LM of other sizes than the suite's fell apart at 3x AdamW's best lr (about +40 %
validation loss with 8-bit) while AdamW trained there. This runs the recurrent bench tasks
(``gefen_dist.bench.recurrent``, and the suite's ``gru``) at a grid of peak lrs, every optimizer
on the same init and data per seed (the suite's ``run_one``; only the peak lr changes, as the
suite's lr sweep does), and writes one JSON line per run to ``--out`` (reusing lines already
there with the same key) and a markdown table of Δ = paired relative final val-loss gap to AdamW
at the same lr and seed.

    PYTHONPATH=. python research/high_lr_rnn.py --task gru_odd --lrs 3e-3,1e-2,3e-2 \
        --seeds 0,1 --optimizers adamw,gefen8,gefen4

``--variant`` runs Gefen with one of the reference-backend switches of
``research/high_lr_probe.py`` (e.g. ``per_element``), recorded under the optimizer's name plus
``+variant``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from dataclasses import replace

import torch

from gefen_dist.bench import suite, tasks


def _rev() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except Exception:
        return "unknown"


def _sizes(text: str) -> dict:
    """``emb=64,hidden=256`` as a dict of ints: overrides of the task's sizes."""
    return {k: int(v) for k, v in (x.split("=") for x in text.split(",") if x)}


def _load(path: str) -> dict[str, dict]:
    out: dict[str, dict] = {}
    if os.path.exists(path):
        for line in open(path):
            if line.strip():
                r = json.loads(line)
                out[r["key"]] = r
    return out


def run(
    task_name: str, lr: float, seed: int, optimizer: str, variant: str, sizes: str = ""
) -> dict:
    torch.set_num_threads(1)
    t = tasks.TASKS[task_name]
    t = replace(t, hyper=replace(t.hyper, lr=lr), sizes=dict(t.sizes, **_sizes(sizes)))
    if variant:
        from research import high_lr_probe

        with high_lr_probe.variant(variant):
            body = suite.run_one(t, optimizer, seed)
            if high_lr_probe.TRIG2_LOG:
                body["trigger2"] = _trigger2_record(dict(high_lr_probe.TRIG2_LOG), body, variant)
            if high_lr_probe.TRIGGER_LOG:
                body["trigger"] = _trigger_record(
                    dict(high_lr_probe.TRIGGER_LOG), body, variant, optimizer
                )
            return body
    return suite.run_one(t, optimizer, seed)


def _trigger_record(log: dict, body: dict, variant: str, optimizer: str) -> dict:
    """The trigger's log with the state it adds: a fired tensor at B = 1 (``trig_b1``) holds
    4 bytes per element (bf16 m and v) instead of its blocked state; under ``trig_c`` it keeps
    its blocked state and adds a bf16 v per element (2 bytes)."""
    tensors = {t["name"]: t for t in body.get("gefen", {}).get("tensors", [])}
    extra = 0.0
    for name, t in log.items():
        if t["fired"] is None or "trig_b1" not in variant and "trig_c" not in variant:
            continue
        rec = next((r for k, r in tensors.items() if f"'{name}'" in k or k == name), None)
        held = rec["state_bytes"] if rec else 0.0
        to_c = "trig_c" in variant and t["block_size"] > 0
        add = 2.0 * t["numel"] if to_c else 4.0 * t["numel"] - held
        t["extra_bytes"] = add
        extra += add
    params = body.get("params") or 1
    return dict(
        tensors=log,
        extra_bytes=extra,
        extra_bytes_per_param=extra / params,
        bytes_per_param_after=(body.get("bytes_per_param") or 0.0) + extra / params,
    )


def _trigger2_record(log: dict, body: dict, variant: str) -> dict:
    """``high_lr_probe.TRIG2_LOG`` with, under ``trig2_b1,rule_NAME``, the state the switch adds:
    a tensor rule NAME fired on holds 4 bytes per element (bf16 m and v at B = 1) instead of its
    blocked state."""
    tensors = {t["name"]: t for t in body.get("gefen", {}).get("tensors", [])}
    rule = next((k[5:] for k in variant.split(",") if k.startswith("rule_")), None)
    extra = 0.0
    if "trig2_b1" in variant and rule:
        for name, t in log.items():
            if rule not in t["fired"]:
                continue
            rec = next((r for k, r in tensors.items() if f"'{name}'" in k or k == name), None)
            held = rec["state_bytes"] if rec else 0.0
            t["extra_bytes"] = 4.0 * t["numel"] - held
            extra += t["extra_bytes"]
    params = body.get("params") or 1
    return dict(
        rule=rule,
        tensors=log,
        extra_bytes=extra,
        extra_bytes_per_param=extra / params,
        bytes_per_param_after=(body.get("bytes_per_param") or 0.0) + extra / params,
    )


def table(records: list[dict]) -> str:
    """Markdown: per task, lr and optimizer, the final val loss per seed and Δ vs AdamW."""
    by = {(r["task"], r["lr"], r["optimizer"], r["seed"]): r for r in records}
    rows = [
        "| task | lr | optimizer | seed | val loss | AdamW | Δ vs AdamW |",
        "|---|---|---|---|---|---|---|",
    ]
    for key in sorted(by):
        task, lr, opt, seed = key
        if opt == "adamw":
            continue
        r, a = by[key], by.get((task, lr, "adamw", seed))
        v = r["final"]["val_loss"] if r["status"] == "ok" else float("nan")
        av = a["final"]["val_loss"] if a and a["status"] == "ok" else float("nan")
        d = 100 * (v / av - 1)
        rows.append(f"| {task} | {lr:g} | {opt} | {seed} | {v:.4f} | {av:.4f} | {d:+.1f} % |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--task", default="gru_odd")
    ap.add_argument("--lrs", default="3e-3,1e-2,3e-2")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--optimizers", default="adamw,gefen8,gefen4")
    ap.add_argument("--sizes", default="", help="overrides of the task's sizes: hidden=256,...")
    ap.add_argument("--variant", default="", help="a switch of research/high_lr_probe.py")
    ap.add_argument("--out", default="research/results/high_lr_rnn.jsonl")
    ap.add_argument("--markdown", default="", help="write the table of every record in --out here")
    a = ap.parse_args()
    if "adamw_clip" in a.optimizers.split(","):
        from research import adamw_clip  # noqa: F401  (registers the peer)
    done = _load(a.out)
    for lr in [float(x) for x in a.lrs.split(",")]:
        for seed in [int(x) for x in a.seeds.split(",")]:
            for opt in a.optimizers.split(","):
                name = opt + (f"+{a.variant}" if a.variant and opt != "adamw" else "")
                task = a.task + (f"[{a.sizes}]" if a.sizes else "")
                key = f"{task}|{lr:g}|{name}|{seed}"
                if key in done:
                    continue
                t0 = time.time()
                body = run(a.task, lr, seed, opt, a.variant if opt != "adamw" else "", a.sizes)
                rec = dict(
                    key=key,
                    task=task,
                    lr=lr,
                    optimizer=name,
                    seed=seed,
                    status=body["status"],
                    final=body.get("final"),
                    curve=body.get("curve"),
                    reason=body.get("reason"),
                    bytes_per_param=body.get("bytes_per_param"),
                    trigger=body.get("trigger"),
                    trigger2=body.get("trigger2"),
                    blocks={
                        t["name"]: t["block_sizes"]
                        for t in body.get("gefen", {}).get("tensors", [])
                    },
                    seconds=round(time.time() - t0, 1),
                    rev=_rev(),
                    machine=f"{platform.machine()} {os.cpu_count()} cpu, torch {torch.__version__}",
                    command="PYTHONPATH=. python research/high_lr_rnn.py "
                    + " ".join(
                        f"--{k.replace('_', '-')} {v}"
                        for k, v in vars(a).items()
                        if v and k != "markdown"
                    ),
                )
                done[key] = rec
                with open(a.out, "a") as f:
                    f.write(json.dumps(rec) + "\n")
                fv = rec["final"]["val_loss"] if rec["final"] else None
                print(key, rec["status"], fv, rec["seconds"], "s", flush=True)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(table(list(_load(a.out).values())) + "\n")


if __name__ == "__main__":
    main()
