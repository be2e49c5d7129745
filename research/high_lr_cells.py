"""Where inside LSTM ``weight_hh`` the shared denominator errs (issue 43): per gate, diagonal
(a hidden unit's weight onto itself, i = j) against off-diagonal, and how much of log g^2 a
rank-1 (row x column) fit leaves.

Why: ``research/high_lr_probe.py`` shows the within-row spread of own v against v_b * c_j
growing to e^2.3 on weight_hh at lr 0.1 while the column factor stays accurate and unlagged;
the rank-1 fit must then miss a structure of the g^2 matrix. A unit's gradient onto its own
recurrence, sum_t delta_i(t) h_i(t-1), correlates its two factors, which no row x column product
describes: a candidate. This runs Gefen (reference backend, probe ``ref``) and dumps the
tensor's statistics at a few steps.

    PYTHONPATH=. python research/high_lr_cells.py --seed 0 --steps 200,300,500
"""

from __future__ import annotations

import argparse
import json

import torch

from research import high_lr_probe as hp


def analyse(d: dict, gates: int) -> dict:
    """Per gate: diagonal vs off-diagonal mean log amp, over-stepping share; rank-1 residual."""
    own, denom, over = d["own"], d["denom"], d["over"]
    rows, width = own.shape
    lam = ((own + 1e-8) / denom).log()
    h = rows // gates
    out: dict = {"gates": []}
    eye = torch.eye(width, dtype=torch.bool)[:h] if h == width else None
    for k in range(gates):
        sl = slice(k * h, (k + 1) * h)
        lk, ok, vk = lam[sl], over[sl], own[sl].square().clamp(min=1e-30)
        rec = dict(lam_mean=float(lk.mean()), over=float(ok.float().mean()))
        if eye is not None:
            rec.update(
                lam_diag=float(lk[eye].mean()),
                lam_off=float(lk[~eye].mean()),
                over_diag=float(ok[eye].float().mean()),
                over_off=float(ok[~eye].float().mean()),
                over_share_diag=float(ok[eye].sum() / max(1, int(ok.sum()))),
                v_diag_over_off=float(vk[eye].mean() / vk[~eye].mean()),
            )
        lv = vk.log()
        fit = lv.mean(dim=1, keepdim=True) + lv.mean(dim=0, keepdim=True) - lv.mean()
        res = lv - fit
        rec["rank1_log_resid_rms"] = float(res.square().mean().sqrt() / 2)
        if eye is not None:
            rec["rank1_resid_diag"] = float(res[eye].mean() / 2)
            rec["rank1_resid_off_rms"] = float(res[~eye].square().mean().sqrt() / 2)
        # concentration: share of the row's g^2 held by its largest 1 % of elements
        top = max(1, width // 100)
        rec["top1pct_share"] = float((vk.topk(top, dim=1).values.sum(dim=1) / vk.sum(dim=1)).mean())
        out["gates"].append({a: round(b, 4) for a, b in rec.items()})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--task", default="lstm")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--optimizer", default="gefen8")
    ap.add_argument("--variant", default="ref")
    ap.add_argument("--steps", default="100,200,300,500")
    ap.add_argument("--tensor", default="rnn.weight_hh_l0")
    ap.add_argument("--gates", type=int, default=4)
    ap.add_argument("--out", default="research/results/high_lr_cells.jsonl")
    a = ap.parse_args()
    steps = tuple(int(x) for x in a.steps.split(","))
    hp.DUMP.clear()
    hp.DUMP_STEPS.update(steps)
    r = hp.probe(a.task, a.lr, a.seed, a.optimizer, a.variant, list(steps), a.gates)
    res = {s: analyse(hp.DUMP[(a.tensor, s)], a.gates) for s in steps if (a.tensor, s) in hp.DUMP}
    rec = dict(vars(a), val=r["val"], analysis=res)
    with open(a.out, "a") as f:
        f.write(json.dumps(rec) + "\n")
    print("val", round(r["val"], 4))
    for s, x in res.items():
        for k, g in enumerate(x["gates"]):
            print(s, "ifgo"[k] if a.gates == 4 else k, json.dumps(g))


if __name__ == "__main__":
    main()
