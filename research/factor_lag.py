"""Is AdamW's floor the right fix for gru_wide, or would a factor without its lag do (issue 43)?

Why: the floor took gru_wide at 3x its best lr from +11-13 % to +1.6-5.7 % against AdamW, and
the oracle of ``research/rank_v.py`` located the damage in the factor's one-step lag. The floor
also gave back part of the language models' lead (llama 8-bit at its best lr -2.28 -> -0.67 %).
A factor read after this step's fold (no lag) removes the cause instead of bounding its effect,
at the price of a second read of g in the kernels (the column sums before the update). This
runs Gefen through the reference backend with the two parts switched:

- ``ref``: as built (the lagged factor, the overshoot rule, AdamW's floor);
- ``nofloor``: the floor off (the update before it);
- ``fresh_nofloor``: the factor from v_cross after this step's fold, the floor off;
- ``fresh``: the same with the floor.

Records go to ``--out`` as ``optimizer`` ``gefen8+ARM`` (AdamW as ``adamw``), one JSON line per
run, reused by key; ``research/paired.py`` reads them:

    PYTHONPATH=. python research/factor_lag.py --task llama --lr 0.00099 --seeds 0,1,2,3,4,5 \\
        --arms ref,nofloor,fresh_nofloor --out research/results/factor_lag.jsonl
    python research/paired.py research/results/factor_lag.jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import time
from dataclasses import replace

import torch

from gefen_dist import optimizer as gopt
from gefen_dist.backends import cross, reference
from gefen_dist.bench import suite, tasks
from research.high_lr_rnn import _load, _rev


def _fresh_factor(st, h, mean_sq):
    """``reference.cross_factor`` with c read after this step's fold (no lag)."""
    st.v_cross.mul_(h.beta2).add_(mean_sq, alpha=1.0 - h.beta2)
    total = st.v_cross.mean()
    c = st.v_cross / torch.where(total > 0, total, torch.ones_like(total))
    return c.clamp_(min=reference.CROSS_FLOOR).sqrt_().div_(h.bc2_sqrt)


@contextlib.contextmanager
def arm(name: str):
    """Gefen on the reference backend with arm ``name``'s parts (module docstring)."""
    saved = (gopt.Gefen._impl, reference.adamw_floor, reference.cross_factor, cross.cross_factor)
    gopt.Gefen._impl = lambda self, p, g: "reference"
    if "nofloor" in name:
        reference.adamw_floor = lambda d, g, h: d
    if "fresh" in name:
        reference.cross_factor = cross.cross_factor = _fresh_factor
    try:
        yield
    finally:
        gopt.Gefen._impl, reference.adamw_floor, reference.cross_factor, cross.cross_factor = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--task", default="llama")
    ap.add_argument("--lr", type=float, required=True)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--bits", type=int, default=8)
    ap.add_argument("--arms", default="ref,nofloor,fresh_nofloor")
    ap.add_argument("--out", default="research/results/factor_lag.jsonl")
    a = ap.parse_args()
    torch.set_num_threads(1)
    done = _load(a.out)
    rev = _rev()
    t = tasks.TASKS[a.task]
    t = replace(t, hyper=replace(t.hyper, lr=a.lr))
    for seed in [int(x) for x in a.seeds.split(",")]:
        for name in ["adamw", *a.arms.split(",")]:
            opt = "adamw" if name == "adamw" else f"gefen{a.bits}+{name}"
            key = f"{a.task}|{a.lr:g}|{opt}|{seed}"
            if key in done:
                continue
            t0 = time.time()
            with arm(name) if name != "adamw" else contextlib.nullcontext():
                body = suite.run_one(t, "adamw" if name == "adamw" else f"gefen{a.bits}", seed)
            rec = dict(
                key=key,
                task=a.task,
                lr=a.lr,
                optimizer=opt,
                seed=seed,
                status=body["status"],
                final=body.get("final"),
                seconds=round(time.time() - t0, 1),
                rev=rev,
                machine=f"{platform.machine()} {os.cpu_count()} cpu, torch {torch.__version__}",
            )
            with open(a.out, "a") as f:
                f.write(json.dumps(rec) + "\n")
            print(key, rec["status"], (rec["final"] or {}).get("val_loss"), rec["seconds"], "s")


if __name__ == "__main__":
    main()
