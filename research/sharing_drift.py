"""Do the blocks chosen from the first gradient still fit later? Per tensor, along an AdamW run.

Gefen picks each tensor's blocks once, from g0^2, and one learned codebook. This trains a bench
task with plain AdamW (the suite's init, data, schedule and clipping) and, at a few steps,
measures on AdamW's own state what Gefen's choices would cost there:

- ``v spread``: RMS over elements of 0.5 * ln(v_i / mean of v over i's block), AdamW's v. It is
  the log of the factor by which sharing v moves each element's step (0.35: a typical element's
  step off by e^0.35 = 1.4x). 0 when the block fits.
- ``m error``: || (Q(m) - m) / sqrt(v) || / || m / sqrt(v) ||, Q = Gefen's quantisation of m
  (block absmax, the codebook Gefen learns from g0 at that bit width): the relative error of the
  update direction that quantising the first moment alone causes.

- ``+ factor``: the v spread left by what Gefen divides by, block v x its cross factor (the
  rank-1 fit of the (blocks, positions) view, ``reference.cross_factor``; the tensor's share of
  positions whose factor the floor CROSS_FLOOR clamps is ``clamped``). Under MIN_CROSS_BLOCKS
  blocks there is no factor and this is the v spread itself.
- ``B now``: the block size the partition would choose from this step's gradient: whether the
  first gradient's choice is still the one the gradients support.

Both are printed for the blocks Gefen chose and, as yardsticks, for rows (a linear layer's
output neuron, Adam-mini's rule) and columns where the tensor has them; the v spread also for a
rank-1 fit, row mean x column mean / mean (Adafactor's factored v), which is what sharing over
one axis cannot represent: the rows' and the columns' scales at once.

    python research/sharing_drift.py --task gru --steps 1,50,200,440 --bits 8
    python research/sharing_drift.py --task gru --scale 1 --lr-factor 3 --steps 1,20,55,110,220

``--lr-factor`` trains at that multiple of the task's lr, as the lr sweep does (``sweep.swept``).
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gefen_dist import Gefen  # noqa: E402
from gefen_dist.bench import sweep, tasks  # noqa: E402
from gefen_dist.method import partition  # noqa: E402
from gefen_dist.method.codes import midpoints, quantize  # noqa: E402
from gefen_dist.method.state import CROSS_FLOOR, MIN_CROSS_BLOCKS  # noqa: E402


def blocks(x: torch.Tensor, b: int) -> torch.Tensor:
    """(n_blocks, elements per block) view of a tensor under block size b (b < 0: columns)."""
    flat = x.reshape(-1)
    if b < 0:
        return flat.view(-1, -b).t()
    return flat.view(-1, b)


def v_spread(v: torch.Tensor, b: int) -> float:
    vb = blocks(v.double().clamp_min(1e-30), b)
    return float((0.5 * (vb / vb.mean(dim=1, keepdim=True)).log()).pow(2).mean().sqrt())


def factored_spread(v: torch.Tensor) -> float:
    """v spread against Adafactor's rank-1 fit (row mean x column mean / mean): how much a
    per-row and a per-column factor together would leave, for a 2-D view of the tensor."""
    v2 = v.double().clamp_min(1e-30).reshape(v.shape[0], -1)
    fit = v2.mean(dim=1, keepdim=True) * v2.mean(dim=0, keepdim=True) / v2.mean()
    return float((0.5 * (v2 / fit).log()).pow(2).mean().sqrt())


def blocks_factored(v: torch.Tensor, b: int) -> tuple[float, float]:
    """v spread left by block v x Gefen's cross factor (rank-1 fit of the blocks view), and the
    share of positions whose factor the floor clamps; a tensor of fewer than MIN_CROSS_BLOCKS
    blocks keeps no factor (``state.cross_length``): its block v alone, nothing clamped."""
    vb = blocks(v.double().clamp_min(1e-30), b)
    if vb.shape[0] < MIN_CROSS_BLOCKS:
        return v_spread(v, b), 0.0
    c = vb.mean(dim=0, keepdim=True) / vb.mean()
    clamped = float((c < CROSS_FLOOR).double().mean())
    fit = vb.mean(dim=1, keepdim=True) * c.clamp_min(CROSS_FLOOR)
    return float((0.5 * (vb / fit).log()).pow(2).mean().sqrt()), clamped


def m_error(m: torch.Tensor, v: torch.Tensor, b: int, levels: torch.Tensor, eps: float) -> float:
    mb, vb = blocks(m.float(), b), blocks(v.float(), b)
    absmax = mb.abs().amax(dim=1, keepdim=True)
    scale = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    q = levels[quantize(mb / scale, midpoints(levels)).long()] * absmax
    d = vb.sqrt() + eps
    return float(((q - mb) / d).norm() / ((mb / d).norm() + 1e-30))


def gefen_choice(model: torch.nn.Module, bits: int) -> tuple[dict[str, int], torch.Tensor]:
    """Block size per parameter name and the codebook, from Gefen itself on this gradient."""
    shadow = copy.deepcopy(model)
    for p, q in zip(model.parameters(), shadow.parameters(), strict=True):
        q.grad = None if p.grad is None else p.grad.clone()
    opt = Gefen(shadow.parameters(), lr=0.0, bits=bits)
    opt.step()
    names = [n for n, _ in shadow.named_parameters()]
    report = opt.memory_report()["tensors"]
    chosen = {names[i]: t["block_sizes"][0] for i, t in enumerate(report)}
    levels = next(st["codebook"] for st in opt.state.values() if "codebook" in st)
    return chosen, levels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--task", default="gru", choices=sorted(tasks.TASKS))
    ap.add_argument("--steps", default="1,50,200,440", help="steps at which to measure")
    ap.add_argument("--bits", type=int, default=8, choices=(4, 8))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scale", type=float, default=2.0, help="task length, as bench --scale")
    ap.add_argument("--lr-factor", type=float, default=1.0, help="lr x this, as the lr sweep")
    a = ap.parse_args()
    torch.set_num_threads(1)
    spec = sweep.swept(tasks.scaled(tasks.TASKS[a.task], a.scale), a.lr_factor)
    h = spec.hyper
    at = sorted({int(s) for s in a.steps.split(",") if 0 < int(s) <= h.steps})
    inst = tasks.build(spec, a.seed)
    model = inst.model
    opt = torch.optim.AdamW(model.parameters(), lr=h.lr, betas=h.betas, weight_decay=h.weight_decay)
    named = dict(model.named_parameters())
    chosen: dict[str, int] = {}
    levels = torch.empty(0)
    rows_out = []
    for step in range(1, max(at) + 1):
        for g in opt.param_groups:
            g["lr"] = h.lr * tasks.lr_factor(step - 1, h)
        loss = inst.loss(model, next(inst.batches))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), h.grad_clip)
        if step == 1:
            chosen, levels = gefen_choice(model, a.bits)
        opt.step()
        if step not in at:
            continue
        for name, b in chosen.items():
            p = named[name]
            if b == 1:
                continue
            st = opt.state[p]
            m, v = st["exp_avg"], st["exp_avg_sq"]
            row = p.numel() // p.shape[0] if p.dim() >= 2 else 0
            cols = [("Gefen", b)]
            cols += [("rows", row)] if row and row != b else []
            cols += [("columns", -row)] if row and -row != b else []
            now = partition.block_size_for(p.grad)
            for label, bb in cols:
                fs, cl = blocks_factored(v, bb)
                rows_out.append(
                    (
                        step,
                        name,
                        tuple(p.shape),
                        f"{label} {'col' + str(-bb) if bb < 0 else bb}",
                        v_spread(v, bb),
                        m_error(m, v, bb, levels, opt.param_groups[0]["eps"]),
                        fs,
                        cl,
                        now,
                    )
                )
            if row:
                rows_out.append(
                    (
                        step,
                        name,
                        tuple(p.shape),
                        "row x column (rank 1)",
                        factored_spread(v),
                        math.nan,
                        math.nan,
                        math.nan,
                        now,
                    )
                )
    print(
        f"task {a.task}, seed {a.seed}, scale {a.scale} ({h.steps} steps), lr {h.lr:g}, "
        f"{a.bits}-bit codebook"
    )
    print("| step | tensor | shape | blocks | v spread | + factor | clamped | m error | B now |")
    print("|---|---|---|---|---|---|---|---|---|")
    for step, name, shape, label, vs, me, fs, cl, now in rows_out:
        print(
            f"| {step} | {name} | {shape} | {label} | {vs:.3f} | {fs:.3f} | {cl:.3f} | {me:.3f} "
            f"| {now} |"
        )
    print("\nmean v spread over the tensors with rows, per step:")
    print("| step | Gefen's blocks | + factor | rank-1 fit |")
    print("|---|---|---|---|")
    for step in at:
        mine = [r for r in rows_out if r[0] == step and len(r[2]) >= 2]
        gefen = [r[4] for r in mine if r[3].startswith("Gefen")]
        fact = [r[6] for r in mine if r[3].startswith("Gefen")]
        rank1 = [r[4] for r in mine if r[3].startswith("row x column")]
        if gefen and rank1:
            print(
                f"| {step} | {sum(gefen) / len(gefen):.3f} | {sum(fact) / len(fact):.3f} "
                f"| {sum(rank1) / len(rank1):.3f} |"
            )
    worst = max(rows_out, key=lambda r: r[4]) if rows_out else None
    if worst:
        print(
            f"\nlargest v spread: {worst[1]} at step {worst[0]} ({worst[3]}): "
            f"steps off by x{math.exp(worst[4]):.2f} (RMS)"
        )


if __name__ == "__main__":
    main()
