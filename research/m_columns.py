"""How m is laid out inside a blocked matrix's rows as a run goes on (issue 43, fourth study).

Why: at 3x AdamW's best lr on the lstm task, fp32 m for the output head alone closes Gefen
4-bit's excess over 8-bit; this reads the head's (and the recurrent matrices') m before it is
coded, at a few steps, and prints per tensor: the median over rows of absmax / RMS (the row's
crest factor), the five largest and the median column means of |m| / row absmax, and the share
of rows whose absmax sits in those five columns.

    PYTHONPATH=. python research/m_columns.py --lr 0.1 --seed 0
"""

from __future__ import annotations

import argparse

import torch

from research import high_lr_probe as hp

TENSORS = ("head.weight", "rnn.weight_hh_l0", "rnn.weight_ih_l0")


def layout(m: torch.Tensor) -> dict:
    a = m.abs()
    r = a.amax(dim=1, keepdim=True).clamp(min=1e-30)
    crest = (a.amax(dim=1) / a.square().mean(dim=1).sqrt().clamp(min=1e-30)).median()
    cols = (a / r).mean(dim=0)
    top = cols.topk(5)
    in_top = torch.isin(a.argmax(dim=1), top.indices).float().mean()
    return dict(
        crest=round(float(crest), 1),
        top5=[round(float(x), 2) for x in top.values],
        median=round(float(cols.median()), 3),
        argmax_in_top5=round(float(in_top), 2),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="lstm")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--steps", default="50,300,500")
    a = ap.parse_args()
    hp.DUMP_STEPS.update(int(x) for x in a.steps.split(","))
    r = hp.probe(a.task, a.lr, a.seed, f"gefen{a.bits}", "ref", sorted(hp.DUMP_STEPS))
    print(f"{a.task} lr {a.lr:g} seed {a.seed} gefen{a.bits}: val {r['val']:.4f}")
    print("| tensor | step | row crest | top-5 column means | median column | argmax in top 5 |")
    print("|---|---|---|---|---|---|")
    for (name, step), d in sorted(hp.DUMP.items()):
        if name in TENSORS:
            x = layout(d["m"])
            top = " ".join(f"{v:.2f}" for v in x["top5"])
            print(
                f"| {name} | {step} | {x['crest']} | {top} | {x['median']:.3f} "
                f"| {x['argmax_in_top5']:.2f} |"
            )


if __name__ == "__main__":
    main()
