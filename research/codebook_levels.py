"""The 4-bit codebook each task's first step learns, as built and under a probe variant
(issue 43, fourth study: ``cbn`` learns it from g0 under ``mcol,gN``'s scales).

    PYTHONPATH=. python research/codebook_levels.py --tasks lstm,resnet,moe,gpt2

prints the non-negative half of the levels (the codebook is learned from a symmetric histogram
and pins -1 and +1).
"""

from __future__ import annotations

import argparse

import torch

from gefen_dist.bench import peers, tasks
from gefen_dist.demo import loop
from research import high_lr_probe as hp


def levels(task: str, variant: str, seed: int = 0) -> list[float]:
    torch.set_num_threads(1)
    t = tasks.TASKS[task]
    h = t.hyper
    with hp.variant(variant):
        inst = tasks.build(t, seed)
        model = inst.model
        opt = peers.build(
            "gefen4", model, h.lr, betas=h.betas, weight_decay=h.weight_decay, **inst.model_info
        )
        loop.plain_step(model, opt, lambda: inst.loss(model, next(inst.batches)), 1.0)
        lv = opt.codebooks[4]
    return [round(float(x), 3) for x in lv[lv.numel() // 2 :]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", default="lstm,resnet,moe,gpt2")
    ap.add_argument("--variants", default="ref;mcol,g64,cbn", help="';'-separated")
    a = ap.parse_args()
    print("| task | variant | levels >= 0 |")
    print("|---|---|---|")
    for task in a.tasks.split(","):
        for v in a.variants.split(";"):
            print(f"| {task} | `{v}` | {' '.join(f'{x:.3f}' for x in levels(task, v))} |")


if __name__ == "__main__":
    main()
