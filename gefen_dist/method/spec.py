"""Gefen's update of one tensor, stated plainly: the spec the chunked reference is tested against.

Unchunked, unbatched and slow on purpose: every formula of ``docs/method.md`` section 3 in the
order it is written there, over a whole tensor (or one piece of it, ``start`` elements into a
tensor of ``tensor_numel``), for a list of gradients from a zero state. ``backends/reference.py``
does the same in bounded memory and ``tests/test_optimizer.py`` checks it against this; every
backend is tested against the reference.
"""

from __future__ import annotations

import torch

from . import codes
from .state import CROSS_FLOOR, MIN_CROSS_BLOCKS


def gefen(
    p: torch.Tensor,
    grads: list[torch.Tensor],
    lr: float,
    betas: tuple[float, float],
    eps: float,
    wd: float,
    block: int,
    levels: torch.Tensor,
    start: int = 0,
    tensor_numel: int | None = None,
    bf16_stochastic_round: bool = False,
) -> torch.Tensor:
    """Per-block AdamW with v = (v of the block) x (the factor of the element's position across
    blocks: its column of the tensor's (n / B, B) view, or its row for column blocks; relative to
    the factors' mean, at least CROSS_FLOOR; from the steps before this one, this
    step's own on the first) when the tensor has at least
    MIN_CROSS_BLOCKS blocks, where this step's g opposes m at least s^2 keep + m_hat^2 (s^2
    that shared v-hat, keep = 1 - sum(m_hat^2) / sum(s^2) over the block, in [0, 1];
    ``reference.denominator``), s^2 everywhere at least (1 - b2) g^2 / (1 - b2^t)
    (AdamW's own floor), and an m stored as codebook level * absmax: the nearest
    level at 8 bits; at 4 bits one of the two around it, the upper one when u * spacing <
    distance above the lower, u = codes.uniforms(step, index in the tensor). With
    ``bf16_stochastic_round`` (``p`` the fp32 values of a bf16 parameter) each step's p is
    stored as bf16, the upper of its two neighbours with probability (its low 16 bits) / 2^16
    (codes.round_bf16 with r = codes.param_bits(step, index in the tensor)). A piece (``start``
    > 0 or a tensor longer than it) estimates the factor from its own elements."""
    n = p.numel()
    total = start + n if tensor_numel is None else tensor_numel
    width = abs(block)
    if block < 0:  # columns: elements the same distance apart as a row's length share a block
        ids, nb = (torch.arange(n) + start) % width, width
        pos, npos = (torch.arange(n) + start) // width, -(-total // width)  # the tensor's rows
        factored = width >= MIN_CROSS_BLOCKS and npos > 1
    else:
        ids = (torch.arange(n) + start) // block
        ids = ids - ids[0]
        nb = int(ids[-1]) + 1
        pos, npos = (torch.arange(n) + start) % block, block  # the position in a block
        factored = -(-total // block) >= MIN_CROSS_BLOCKS
    m_q = torch.zeros(n)
    v = torch.zeros(nb)
    cross = torch.zeros(npos)
    p = p.clone()
    for t, g in enumerate(grads, 1):
        m = betas[0] * m_q + (1 - betas[0]) * g
        cnt = torch.zeros(nb).index_add_(0, ids, torch.ones(n))
        v = betas[1] * v + (1 - betas[1]) * torch.zeros(nb).index_add_(0, ids, g * g) / cnt
        per = torch.zeros(npos).index_add_(0, pos, torch.ones(n))
        sq = torch.zeros(npos).index_add_(0, pos, g * g) / per.clamp(min=1)
        before = cross  # c from the steps before this one, unless they left it all zero
        cross = betas[1] * cross + (1 - betas[1]) * sq
        c = (before / before.mean() if before.mean() > 0 else cross / cross.mean()).clamp(
            min=CROSS_FLOOR
        )
        v_elem = v[ids] * c[pos] if factored else v[ids]
        p = p * (1 - lr * wd)
        s2 = v_elem / (1 - betas[1] ** t)  # the shared estimate of each element's v-hat
        m_hat2 = (m / (1 - betas[0] ** t)) ** 2
        ratio = torch.zeros(nb).index_add_(0, ids, m_hat2) / torch.zeros(nb).index_add_(0, ids, s2)
        keep = (1 - ratio.nan_to_num(posinf=1.0)).clamp(0.0, 1.0)[ids]  # the block's noise share
        turned = m * g < 0  # this step's gradient opposes m: the last steps overshot
        s2 = torch.where(turned, torch.maximum(s2, s2 * keep + m_hat2), s2)
        s2 = torch.maximum(s2, (1 - betas[1]) * g * g / (1 - betas[1] ** t))  # AdamW's floor
        denom = s2.sqrt() + eps
        p = p - lr / (1 - betas[0] ** t) * m / denom
        if bf16_stochastic_round:  # p holds a bf16 tensor's values (fp32): its write rounds
            p = codes.round_bf16(p, codes.param_bits(t, torch.arange(n) + start)).float()
        amax = torch.zeros(nb).scatter_reduce(0, ids, m.abs(), "amax")
        scaled = m / torch.where(amax > 0, amax, 1.0)[ids]
        if levels.numel() == 16:
            u = codes.uniforms(t, torch.arange(n) + start)
            k = (levels[None, 1:-1] <= scaled[:, None]).sum(dim=1)
            code = k + (u * (levels[k + 1] - levels[k]) < scaled - levels[k]).long()
        else:
            code = (scaled[:, None] - levels[None, :]).abs().argmin(dim=1)
        m_q = levels[code] * amax[ids]
    return p
