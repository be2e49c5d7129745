"""What Gefen's shared second moment does to each element's step, measured along a Gefen run.

Trains a bench task with Gefen exactly as ``python -m gefen_dist.bench compare`` does (same
init, data, schedule; ``--lr-factor`` as the lr sweep scales the peak lr) and keeps beside it a
shadow AdamW state, fp32 m and v per element, fed the same (clipped) gradients Gefen gets. The
shadow never moves a weight: it says what AdamW would step from the very same gradient history.
At the steps asked for, for every tensor with shared state (B != 1), from Gefen's own state:

- ``v_eff`` = v_block * c_pos (the factor from v_cross as the step before left it, clamped at
  CROSS_FLOOR, as ``reference.cross_factor``), the second moment the element was divided by;
  ``rho`` = v_eff / v_own, v_own the shadow's per-element EMA of g^2. An element's step is
  1 / sqrt(rho) times what its own v would give. Printed: median rho, the fraction with
  rho < 1/4 (step >= 2x), < 1/100 (>= 10x), and the largest 1 / sqrt(rho).
- ``|d| / lr``: Gefen's actual step, d = p_after - p_before * (1 - lr * wd), over the lr; the
  same for the shadow AdamW step (AdamW's |m / sqrt(v)| is bounded; Gefen's is not where rho is
  small). Printed: the max over elements and the 99.9th percentile of each.
- ``|d|/|a|``: the ratio of the update norms of the tensor, Gefen's over the shadow AdamW's, and
  their cosine.
- ``m err``: || m_used - m_own || / || m_own ||, m_used = -d * denom / step_size (the m Gefen
  stepped with, this step's lerp of its dequantised m) against the shadow's exact m.
- ``clamped``: fraction of positions whose factor sits at CROSS_FLOOR; ``g = 0``: fraction of
  elements whose gradient has been exactly 0 at every step so far (left out of rho).
- ``rho > 4``: fraction of elements stepped at most half what their own v gives;
  ``abs(d) > 2 abs(a)``: fraction whose actual step is over twice the shadow AdamW's.

    python benchmarks/step_ratio.py --task mlp --optimizer gefen8 --seed 0 --lr-factor 33 \\
        --steps 1,10,40,80,160,320,560,800

Prints one markdown table; ``--out`` also writes every row as JSON lines. ``--steps all
--window 80`` measures every step and prints the means over windows of 80 steps (the max
columns: the max over the window).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gefen_dist.bench import peers, sweep, tasks  # noqa: E402
from gefen_dist.demo import loop  # noqa: E402
from gefen_dist.method.state import CROSS_FLOOR, segment_views  # noqa: E402


def _factor(v_cross: torch.Tensor) -> torch.Tensor:
    mean = v_cross.mean()
    c = v_cross / (mean if mean > 0 else torch.ones_like(mean))
    return c.clamp(min=CROSS_FLOOR)


def _v_eff(seg, shape, cross_before) -> tuple[torch.Tensor, float]:
    """Per-element second moment Gefen divided by (no bias correction), as a (rows, P) or flat
    tensor of the parameter's numel; and the fraction of factor entries at the floor."""
    b, n = seg.block_size, seg.numel
    v = seg.v.detach().float()
    vc = cross_before if cross_before is not None and cross_before.abs().sum() > 0 else None
    if vc is None and seg.v_cross is not None and seg.v_cross.numel():
        vc = seg.v_cross.detach().float()  # the first step: this step's fold
    clamped = 0.0
    if b > 1:
        out = v.repeat_interleave(b)[:n].view(-1, b)
        if vc is not None:
            c = _factor(vc)
            clamped = float((c <= CROSS_FLOOR).float().mean())
            out = out * c[None, :]
    else:  # columns of period P: block j = column j, factor per row
        p = -b
        out = v[None, :].expand(n // p, p).clone()
        if vc is not None:
            c = _factor(vc)
            clamped = float((c <= CROSS_FLOOR).float().mean())
            out = out * c[:, None]
    return out.reshape(-1), clamped


def _windows(rows: list[dict], w: int) -> list[dict]:
    out = []
    for name in dict.fromkeys(r["tensor"] for r in rows):
        mine = [r for r in rows if r["tensor"] == name]
        for lo in range(0, max(r["step"] for r in mine), w):
            part = [r for r in mine if lo < r["step"] <= lo + w]
            if not part:
                continue
            agg = {k: sum(r[k] for r in part) / len(part) for k in part[0] if k not in ("tensor",)}
            for k in ("max_step_mult", "gefen_max", "adamw_max"):
                agg[k] = max(r[k] for r in part)
            agg.update(tensor=name, block=part[0]["block"], step=f"{lo + 1}-{lo + w}")
            out.append(agg)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--task", default="mlp")
    ap.add_argument("--optimizer", default="gefen8")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr-factor", type=float, default=33.0)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--steps", default="1,10,40,80,160,320,560,800")
    ap.add_argument("--out")
    ap.add_argument(
        "--no-factor",
        default="",
        help="comma-separated name patterns whose tensors keep no cross factor "
        "(benchmarks/factor_off.py); '.' for all (sharing_ablation.py --second-moment shared)",
    )
    ap.add_argument(
        "--window",
        type=int,
        default=0,
        help="print each tensor's rows averaged over windows of this many steps (the max "
        "columns: the max over the window); with --steps all, a whole run",
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    spec = sweep.swept(tasks.scaled(tasks.TASKS[args.task], args.scale), args.lr_factor)
    h = spec.hyper
    if args.steps == "all":
        at = set(range(1, h.steps + 1))
    else:
        at = {int(s) for s in args.steps.split(",")}

    inst = tasks.build(spec, args.seed)
    model = inst.model
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if args.no_factor:
        from gefen_dist.method import state

        pats = args.no_factor.split(",")
        off = {p.numel() for n, p in named if any(q in n for q in pats)}
        assert not [n for n, p in named if p.numel() in off and not any(q in n for q in pats)]
        keep = state.cross_length
        state.cross_length = lambda b, numel: 0 if numel in off else keep(b, numel)
    opt = peers.build(
        args.optimizer, model, h.lr, betas=h.betas, weight_decay=h.weight_decay, **inst.model_info
    )
    group = opt.param_groups[0]
    b1, b2 = group["betas"]
    eps = group["eps"]
    wd = group["weight_decay"]
    m_own = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in named}
    v_own = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in named}
    rows: list[dict] = []
    t = 0
    inner = opt.step

    def step_and_measure():
        nonlocal t
        t += 1
        lr = group["lr"]
        before = {n: p.detach().clone() for n, p in named}
        cross = {}
        for n, p in named:
            st = opt.state.get(p)
            if st:
                segs = segment_views(st)
                vc = segs[0].seg.v_cross
                cross[n] = None if vc is None else vc.detach().float().clone()
        for n, p in named:
            g = p.grad.detach().float()
            m_own[n].lerp_(g, 1.0 - b1)
            v_own[n].mul_(b2).addcmul_(g, g, value=1.0 - b2)
        inner()
        if t not in at:
            return
        bc1, bc2s = 1.0 - b1**t, math.sqrt(1.0 - b2**t)
        step_size = lr / bc1
        for n, p in named:
            segs = segment_views(opt.state[p])
            if len(segs) != 1 or segs[0].seg.block_size == 1:
                continue
            seg = segs[0].seg
            d = (p.detach() - before[n] * (1.0 - lr * wd)).reshape(-1)
            a = (-step_size * m_own[n] / (v_own[n].sqrt() / bc2s + eps)).reshape(-1)
            v_eff, clamped = _v_eff(seg, tuple(p.shape), cross.get(n))
            own = v_own[n].reshape(-1)
            live = own > 0
            rho = v_eff[live] / own[live]
            denom = v_eff.sqrt() / bc2s + eps
            m_used = -d * denom / step_size
            mo = m_own[n].reshape(-1)
            row = dict(
                step=t,
                tensor=n,
                block=seg.block_size,
                lr=lr,
                rho_median=float(rho.median()),
                rho_lt_quarter=float((rho < 0.25).float().mean()),
                rho_lt_hundredth=float((rho < 0.01).float().mean()),
                rho_gt_4=float((rho > 4.0).float().mean()),
                step_gt_2x=float((d.abs() > 2.0 * a.abs()).float().mean()),
                max_step_mult=float(rho.min().rsqrt()),
                gefen_max=float(d.abs().max() / lr),
                gefen_p999=float(d.abs().quantile(0.999) / lr),
                adamw_max=float(a.abs().max() / lr),
                adamw_p999=float(a.abs().quantile(0.999) / lr),
                norm_ratio=float(d.norm() / a.norm()),
                cosine=float(torch.dot(d, a) / (d.norm() * a.norm())),
                m_err=float((m_used - mo).norm() / mo.norm()),
                clamped=clamped,
                dead=float((~live).float().mean()),
            )
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)

    opt.step = step_and_measure

    def one(s: int) -> float:
        peers.set_lr(opt, tasks.lr_factor(s - 1, h))
        return loop.plain_step(
            model, opt, lambda: inst.loss(model, next(inst.batches)), h.grad_clip
        )

    eval_at = {max(1, round(h.steps * (i + 1) / h.evals)) for i in range(h.evals)}
    trace = loop.train(
        one, h.steps, lambda: inst.evaluate(model), eval_at.__contains__, stop_on_nonfinite=True
    )
    final = trace.curve[-1] if trace.curve else {}
    print(
        f"task {args.task}, {args.optimizer}, seed {args.seed}, lr x{args.lr_factor:g} "
        f"{'no factor on ' + args.no_factor + ' ' if args.no_factor else ''}"
        f"({h.lr:g}), final {json.dumps(final)}"
    )
    print(
        "| step | tensor | B | median rho | rho < 1/4 | rho < 1/100 | rho > 4 | max 1/sqrt(rho) | "
        "Gefen max / p99.9 of abs(d)/lr | AdamW max / p99.9 | norm ratio | cosine | m err | "
        "clamped | g = 0 | abs(d) > 2 abs(a) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    if args.window:
        rows = _windows(rows, args.window)
    for r in rows:
        print(
            f"| {r['step']} | {r['tensor']} | {r['block']} | {r['rho_median']:.3f} | "
            f"{r['rho_lt_quarter']:.3f} | {r['rho_lt_hundredth']:.4f} | {r['rho_gt_4']:.3f} | "
            f"{r['max_step_mult']:.1f} | {r['gefen_max']:.2f} / {r['gefen_p999']:.2f} | "
            f"{r['adamw_max']:.2f} / {r['adamw_p999']:.2f} | {r['norm_ratio']:.2f} | "
            f"{r['cosine']:.3f} | {r['m_err']:.3f} | {r['clamped']:.3f} | {r['dead']:.3f} | "
            f"{r['step_gt_2x']:.3f} |"
        )
    if args.out:
        with open(args.out, "w") as f:
            for r in rows:
                f.write(json.dumps(dict(args=vars(args), final=final, **r)) + "\n")


if __name__ == "__main__":
    main()
