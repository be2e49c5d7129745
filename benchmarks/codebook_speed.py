"""Time learn_codebook on a full histogram (every bin non-empty, the DP's worst case).

Goal: 8 bits from 4096 bins in under 2 s on one core, excluding numba compilation. The first call
includes compilation unless numba's on-disk cache (cache=True) already holds the kernel.

    python benchmarks/codebook_speed.py [--bins 4096] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gefen_dist.method import codebook as cb  # noqa: E402


def full_histogram(bins: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1 << 20, generator=g).reshape(-1, 64)
    x = x / x.abs().amax(dim=1, keepdim=True)
    return cb.histogram(x, bins=bins) + 1.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bins", type=int, default=cb.DEFAULT_BINS)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)

    counts = full_histogram(args.bins)
    print(f"bins={args.bins} (all non-empty), torch threads={torch.get_num_threads()}")
    print(f"{'bits':>4} {'levels':>6} {'first call s':>13} {'median s':>9} {'err/uniform':>12}")
    for bits in (8, 4):
        t0 = time.perf_counter()
        levels = cb.learn_codebook(counts, bits)
        first = time.perf_counter() - t0
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            levels = cb.learn_codebook(counts, bits)
            times.append(time.perf_counter() - t0)
        ratio = cb.quantization_error(counts, levels) / cb.quantization_error(
            counts, cb.uniform_levels(bits)
        )
        median = statistics.median(times)
        print(f"{bits:>4} {2**bits:>6} {first:>13.3f} {median:>9.4f} {ratio:>12.3f}")


if __name__ == "__main__":
    main()
