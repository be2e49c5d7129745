"""Time the block partition of one large tensor (issue: seconds, not minutes, at 50M elements).

    python benchmarks/partition_speed.py [--rows 50000 --cols 1000] [--threads 1]

Planted row structure (rows of distinct scale), so the rule has real work to do; prints the
block size found and the wall time of statistics + rule on one thread.
"""

from __future__ import annotations

import argparse
import time

import torch

from gefen_dist.method import partition


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=50_000)
    ap.add_argument("--cols", type=int, default=1_000)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.rows, args.cols, generator=g)
    x.mul_(torch.exp(torch.randn(args.rows, 1, generator=g)))
    t = time.perf_counter()
    block = partition.block_size_for(x)
    dt = time.perf_counter() - t
    print(f"{x.numel() / 1e6:.0f}M elements ({args.rows}x{args.cols}): B = {block}, {dt:.2f} s")


if __name__ == "__main__":
    main()
