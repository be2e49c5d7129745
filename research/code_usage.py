"""Where a blocked tensor's first moment sits in the codebook as a run goes on (issue 43).

Why: at 4 bits Gefen trails its own 8-bit run by ~3 points on the lstm task at 3x AdamW's best
lr, and exact (fp32) m closes that excess; this reads, from the stored codes alone, what share
of each blocked tensor's elements sits in the codebook's innermost cell (|level| < 0.06: the two
levels next to zero), i.e. how many elements' m is under a sixteenth of its block's absmax and
carried by stochastic rounding between those two levels.

    PYTHONPATH=. python research/code_usage.py --task lstm --lr 0.1 --bits 4 --seed 0
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch

from gefen_dist.bench import peers, tasks
from gefen_dist.demo import loop
from gefen_dist.method import codes as mcodes

INNER = 0.06


def usage(task: str, lr: float, bits: int, seed: int, at: set[int]) -> list[dict]:
    torch.set_num_threads(1)
    t = tasks.TASKS[task]
    t = replace(t, hyper=replace(t.hyper, lr=lr))
    h = t.hyper
    inst = tasks.build(t, seed)
    model = inst.model
    opt = peers.build(
        f"gefen{bits}", model, h.lr, betas=h.betas, weight_decay=h.weight_decay, **inst.model_info
    )
    opt._impl = lambda p, g: "reference"
    names = {p: n for n, p in model.named_parameters()}
    out = []
    for s in range(1, h.steps + 1):
        peers.set_lr(opt, tasks.lr_factor(s - 1, h))
        loop.plain_step(model, opt, lambda: inst.loss(model, next(inst.batches)), h.grad_clip)
        if s not in at:
            continue
        levels = opt.codebooks[bits]
        for p, st in opt.state.items():
            if st["codes"].numel() == 0:
                continue
            q = levels[mcodes.read_codes(st["codes"], 0, p.numel(), bits).long()].abs()
            out.append(
                dict(
                    step=s,
                    tensor=names[p],
                    inner=round(float((q < INNER).float().mean()), 3),
                    median=round(float(q.median()), 3),
                )
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="lstm")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", default="50,150,300,500")
    a = ap.parse_args()
    at = {int(x) for x in a.steps.split(",")}
    print("| step | tensor | share in the innermost cell | median abs level |")
    print("|---|---|---|---|")
    for r in usage(a.task, a.lr, a.bits, a.seed, at):
        print(f"| {r['step']} | {r['tensor']} | {r['inner']:.3f} | {r['median']:.3f} |")


if __name__ == "__main__":
    main()
