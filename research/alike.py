"""How alike a tensor's elements are, against how alike they are inside Gefen's blocks.

For each tensor of at least MIN_SHARED_NUMEL elements in the quality suite's tasks, from the
first batch's gradient of each seed: the block size the partition picks, the spread c of the
elements' variances over the whole tensor (``partition.spread``: c = (CV^2(g0^2) - 2) / 3, zero
for noise of one variance) and the same c inside the chosen blocks (g0^2 over its block's mean,
pooled; columns for B < 0). Step 6 of the rule (``partition.ALIKE``) shares a tensor that
steps 1-5 leave at B = 1 when its whole-tensor c is no larger than what the chosen blocks
carry inside them.

    python research/alike.py [--tasks gpt2,llama,mlp,gru,resnet] [--seeds 3]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gefen_dist.bench import tasks  # noqa: E402
from gefen_dist.method import partition  # noqa: E402


def within_blocks(x: torch.Tensor, block: int) -> float:
    """c inside blocks: Var(x / block mean) pooled over blocks, less the noise's 2, over 3."""
    if block == 1:
        return float("nan")
    xb = x.view(-1, -block).t() if block < 0 else x.view(-1, block)
    mean = xb.mean(dim=1, keepdim=True)
    xb, mean = xb[mean[:, 0] > 0], mean[mean[:, 0] > 0]
    return ((xb / mean).var(dim=1, unbiased=True).mean().item() - 2.0) / 3.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", default="gpt2,llama,mlp,gru,resnet")
    ap.add_argument("--seeds", type=int, default=3)
    a = ap.parse_args()
    print("| task | tensor | shape | seed | B | c, whole tensor | c, inside blocks |")
    print("|---|---|---|---|---|---|---|")
    for name in a.tasks.split(","):
        for seed in range(a.seeds):
            inst = tasks.build(tasks.TASKS[name], seed)
            inst.loss(inst.model, next(inst.batches)).backward()
            for n, p in inst.model.named_parameters():
                if p.grad is None or p.numel() < partition.MIN_SHARED_NUMEL:
                    continue
                shape = tuple(p.shape)
                x = p.grad.double().reshape(-1).square()
                cands = partition.candidate_block_sizes(shape)
                stats = partition.segment_stats(
                    p.grad.reshape(-1), 0, cands, partition.column_period(shape)
                )
                block = partition.choose_block_size(stats, p.numel(), partition.row_length(shape))
                c = partition.spread(stats, p.numel())
                print(
                    f"| {name} | {n} | {shape} | {seed} | {block} | {c:.2f} | "
                    f"{within_blocks(x, block):.2f} |"
                )


if __name__ == "__main__":
    main()
