"""Block sizes the partition picks on the demo GPT from one real batch, with R(p) per candidate.

    python research/partition_gpt.py [--seeds 0 1 2] [--batch-size 16]

Shows the evidence behind the rule in gefen_dist/method/partition.py: for every tensor the chosen B
(-P: columns of a P-element row), R(p) (normalised within-block heterogeneity) for contiguous
candidates up to 4096 and R_col for the columns, per seed.
"""

from __future__ import annotations

import argparse

import torch

from gefen_dist.demo.corpus import get_batch, load_corpus
from gefen_dist.demo.model import GPT, GPTConfig
from gefen_dist.method import partition as pt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--batch-size", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(1)
    train, _ = load_corpus()
    for seed in args.seeds:
        torch.manual_seed(seed)
        model = GPT(GPTConfig(block_size=64))
        x, y = get_batch(train, args.batch_size, 64, torch.Generator().manual_seed(seed))
        model(x, y)[1].backward()
        print(f"seed {seed}")
        for name, p in model.named_parameters():
            cands = pt.candidate_block_sizes(tuple(p.shape))
            period = pt.column_period(tuple(p.shape))
            stats = pt.segment_stats(p.grad.reshape(-1), 0, cands, period)
            block = pt.choose_block_size(stats, p.numel(), pt.row_length(tuple(p.shape)))
            r = pt.heterogeneity(stats, p.numel()) if cands else []
            shown = " ".join(f"{q}:{v:.2f}" for q, v in zip(cands, r, strict=True) if q <= 4096)
            if period:
                shown += f" col:{pt.column_heterogeneity(stats, p.numel()):.2f}"
            print(f"  {name:36s} {str(tuple(p.shape)):12s} B={block:<6d} {shown}")


if __name__ == "__main__":
    main()
