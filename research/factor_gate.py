"""Would a first-gradient test tell where the cross factor pays? A diagnostic, not a Gefen option.

For every tensor of a bench task that keeps a ``v_cross``, from the first gradient g0 of each
seed (the one Gefen learns its blocks from): x = g0^2 laid as (blocks, positions) of the chosen
block size (contiguous blocks: a block's B positions; columns: a column's rows), and

- R_block: the share of x's variance left inside the blocks by one v per block (the partition's
  R at the chosen B);
- R_factor: the share left by Gefen's factored v, v_block x c_position with c the positions'
  mean x over the tensor's mean, clamped at ``CROSS_FLOOR`` as the update clamps it;
- keep: R_block >= (1 + JUMP) R_factor, the rule ``results/mlp_high_lr.md`` proposes (the
  factor kept where it explains a clear share, by the partition's own JUMP).

    python research/factor_gate.py --tasks mlp,gru,gpt2,llama,resnet --seeds 3

The runs that measured what the factor earns or costs per task at AdamW's best lr are in
``results/mlp_high_lr.md`` (the MLP: it costs 4-bit Gefen there) and
``research/results/factored_v_diagnostic.md`` (the language models: it pays).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gefen_dist import Gefen  # noqa: E402
from gefen_dist.bench import tasks  # noqa: E402
from gefen_dist.method.partition import JUMP  # noqa: E402
from gefen_dist.method.state import CROSS_FLOOR, cross_length  # noqa: E402


def _grid(x: torch.Tensor, block: int, shape: tuple[int, ...]) -> torch.Tensor:
    """x as (blocks, positions): rows of B for contiguous blocks, columns of the (rows, P) view
    (one per block, its rows the positions) for column blocks."""
    if block > 0:
        return x.reshape(-1, block)
    return x.reshape(-1, -block).t()


def shares(g0: torch.Tensor, block: int) -> tuple[float, float]:
    x = _grid(g0.double().square().reshape(-1), block, tuple(g0.shape))
    total = (x - x.mean()).square().sum()
    v = x.mean(dim=1, keepdim=True)
    c = (x.mean(dim=0, keepdim=True) / x.mean()).clamp(min=CROSS_FLOOR)
    r_block = ((x - v).square().sum() / total).item()
    r_factor = ((x - v * c).square().sum() / total).item()
    return r_block, r_factor


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", default="mlp,gru,gpt2,llama,resnet")
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print("| task | tensor | B | seed | R_block | R_factor | R_block / R_factor | keep |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.tasks.split(","):
        for seed in range(args.seeds):
            inst = tasks.build(tasks.TASKS[name], seed)
            model = inst.model
            inst.loss(model, next(inst.batches)).backward()
            named = list(model.named_parameters())
            g0 = {n: p.grad.detach().clone() for n, p in named}
            opt = Gefen(named, lr=1e-3)
            opt.step()  # the partition's choice, from this g0
            for n, p in named:
                block = int(opt.state[p]["layout"][0, 3])
                if block == 1 or not cross_length(block, p.numel()):
                    continue
                rb, rf = shares(g0[n], block)
                keep = rb >= (1 + JUMP) * rf
                print(
                    f"| {name} | {n} | {block} | {seed} | {rb:.3f} | {rf:.3f} | "
                    f"{rb / rf:.2f} | {'yes' if keep else 'no'} |"
                )


if __name__ == "__main__":
    main()
