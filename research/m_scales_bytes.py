"""Bytes per parameter of Gefen 4-bit state as built, and under the m scales of issue 43's fifth
study (``research/results/high_lr_design.md``): on every block longer than 64 elements, a bf16
absmax per run of 64 elements instead of the block's fp32 absmax, and on every tensor of
contiguous blocks one column scale (fp32 or bf16) per position of its blocks (learned from g0,
kept for the run), as ``research/high_lr_probe.py``'s ``mcol,g64,mcol0,bf16g[,bf16s]`` applies
them.

A count of bytes on each task's real layout (the partition after one step), not a measurement
of memory.

    PYTHONPATH=. python research/m_scales_bytes.py --tasks lstm,gru_wide,gpt2,llama,moe,resnet
"""

from __future__ import annotations

import argparse
import math

from gefen_dist import Gefen
from gefen_dist.bench import tasks  # the package's import registers lstm, gru_wide and moe

GROUP = 64


def count(task: str, seed: int = 0) -> dict[str, float]:
    inst = tasks.build(tasks.TASKS[task], seed)
    opt = Gefen(inst.model.parameters(), lr=1e-3, bits=4)
    inst.loss(inst.model, next(inst.batches)).backward()
    opt.step()
    params = sum(p.numel() for p in inst.model.parameters())
    groups = scales = 0
    for p in inst.model.parameters():
        for _, numel, _, block, _ in opt.state[p]["layout"].tolist():
            if block > GROUP:
                groups += numel // block * (2 * math.ceil(block / GROUP) - 4)
            if block > 1:
                scales += block
    built = opt.memory_report()["bytes_per_param"]
    return dict(
        params=params,
        built=built,
        fp32=(groups + 4 * scales) / params,
        bf16=(groups + 2 * scales) / params,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", default="lstm,gru_wide,gpt2,llama,moe,resnet")
    a = ap.parse_args()
    print("| task | parameters | B/param as built | Δ, fp32 column scale | Δ, bf16 column scale |")
    print("|---|---|---|---|---|")
    for t in a.tasks.split(","):
        r = count(t)
        print(f"| {t} | {r['params']:,} | {r['built']:.3f} | {r['fp32']:+.3f} | {r['bf16']:+.3f} |")


if __name__ == "__main__":
    main()
