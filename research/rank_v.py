"""How much of a recurrent matrix's second moment must a shared v carry (issue 43)?

Why: on gru_wide at 3x its best lr, AdamW on the recurrent matrix alone takes Gefen's bad runs
back to AdamW's (``research/results/gru_warmup.md``), but per-element v there costs more state
than the issue allows. A v of low rank costs (rows + columns) x rank numbers. This optimizer is
AdamW with fp32 m and each element's own v kept (an oracle: the full EMA is stored) whose
denominator reads only a fit of that v:

- ``full``: the element's own v (AdamW itself);
- ``row``: the row's mean times the column's mean over the tensor's mean: Gefen's row x column
  form on the exact EMA, without its codes, floor, lag or overshoot rule;
- ``rown``: the row's mean times the mean over rows of v_ij / (row i's mean), so every row's
  profile counts the same whatever its scale;
- ``logK``: log v as row + column terms plus K further rank-1 terms (SVD of the doubly centred
  log), each row rescaled so its mean is the row's true mean (the shared v Gefen keeps), so only
  the spread inside a row changes with K.

``row`` takes Gefen's other parts back one at a time with ``+lag`` (the factor from the steps
before this one), ``+floor`` (the factor at least CROSS_FLOOR) and ``+osc`` (the overshoot rule,
each row a block): ``row+lag+floor+osc`` is Gefen's update with fp32 m. ``+own`` floors every
element's v-hat at (1 - b2) g^2 / (1 - b2^t), which AdamW's v-hat always is at least.

A run that stays bad under ``row`` and recovers under ``logK`` says the rows' v needs K more
factors, not per-element state.

    OMP_NUM_THREADS=1 PYTHONPATH=. python research/gru_warmup.py --seed 1 --first gefen8 \
        --adamw-on rnn.weight_hh --other rank:log2 --jitter 0 --out research/results/rank_v.jsonl
"""

from __future__ import annotations

import torch

from gefen_dist.method.state import CROSS_FLOOR


def fit(v: torch.Tensor, form: str) -> torch.Tensor:
    """``v`` (rows, columns), as ``form`` reads it."""
    if form == "full":
        return v
    row = v.mean(dim=1, keepdim=True)
    if form == "row":
        col = v.mean(dim=0, keepdim=True)
        return row * col / v.mean().clamp(min=1e-30)
    if form == "rown":  # each row's profile weighs the same, whatever the row's scale
        col = (v / row.clamp(min=1e-30)).mean(dim=0, keepdim=True)
        return row * col / col.mean().clamp(min=1e-30)
    if not form.startswith("log"):
        raise ValueError(f"form must be full, row, rown or logK, got {form!r}")
    k = int(form[3:])
    lv = v.clamp(min=1e-30).log()
    r = lv.mean(dim=1, keepdim=True)
    c = lv.mean(dim=0, keepdim=True) - lv.mean()
    approx = r + c
    if k > 0:
        u, s, vh = torch.linalg.svd(lv - approx, full_matrices=False)
        approx = approx + (u[:, :k] * s[:k]) @ vh[:k]
    out = approx.exp()
    return out * (row / out.mean(dim=1, keepdim=True))


class RankV(torch.optim.Optimizer):
    """AdamW (decoupled decay, bias-corrected) whose 2-D tensors' denominators read
    ``fit(v, form)``; other tensors step as AdamW."""

    def __init__(self, params, lr: float, betas, weight_decay: float, form: str, eps: float = 1e-8):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay, eps=eps))
        self.form = form

    @torch.no_grad()
    def step(self):
        base, *parts = self.form.split("+")
        for g in self.param_groups:
            b1, b2 = g["betas"]
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["t"] = 0
                    st["m"] = torch.zeros_like(p, dtype=torch.float32)
                    st["v"] = torch.zeros_like(p, dtype=torch.float32)
                st["t"] += 1
                t, grad = st["t"], p.grad.float()
                cols_before = st["v"].mean(dim=0) if p.dim() == 2 else None
                st["m"].lerp_(grad, 1 - b1)
                st["v"].mul_(b2).addcmul_(grad, grad, value=1 - b2)
                if p.dim() != 2:
                    v = st["v"]
                elif base == "row" and ("lag" in parts or "floor" in parts):
                    # Gefen's factor: from the steps before this one ("lag"), at least
                    # CROSS_FLOOR ("floor")
                    cols = cols_before if "lag" in parts and t > 1 else st["v"].mean(dim=0)
                    c = cols / cols.mean().clamp(min=1e-30)
                    c = c.clamp(min=CROSS_FLOOR) if "floor" in parts else c
                    v = st["v"].mean(dim=1, keepdim=True) * c[None, :]
                else:
                    v = fit(st["v"], base)
                s2 = v / (1 - b2**t)
                if "osc" in parts and p.dim() == 2:  # Gefen's overshoot rule, rows as blocks
                    mh2 = (st["m"] / (1 - b1**t)).square()
                    ratio = mh2.sum(dim=1, keepdim=True) / s2.sum(dim=1, keepdim=True)
                    keep = (1 - ratio.nan_to_num(posinf=1.0)).clamp(0.0, 1.0)
                    turned = st["m"] * grad < 0
                    s2 = torch.where(turned, torch.maximum(s2, s2 * keep + mh2), s2)
                if "own" in parts:  # AdamW's own floor: v_hat >= (1 - b2) g^2 / (1 - b2^t)
                    s2 = torch.maximum(s2, grad.square() * ((1 - b2) / (1 - b2**t)))
                denom = s2.sqrt().add_(g["eps"])
                p.mul_(1 - g["lr"] * g["weight_decay"])
                p.sub_(st["m"] / denom, alpha=g["lr"] / (1 - b1**t))
