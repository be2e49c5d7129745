"""The reference update: the readable spec of one Gefen step on one segment, in plain PyTorch.

Every native kernel is tested against these functions. Per block of B elements (METHOD.md, 4):

    m     = levels[code] * absmax                      dequantise
    m     = b1 * m + (1 - b1) * g                      (lerp, as AdamW)
    v     = b2 * v + (1 - b2) * mean(g^2 over block)   one v per block
    p     = p * (1 - lr * wd)                          decoupled weight decay
    p     = p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
    absmax, code = max|m| over block, level of m / absmax: nearest (8 bits) or stochastic (4)

Column blocks (block size -P: the segment's element i belongs to block i mod P) follow the same
formulas with the block's elements strided by P; as v and the new absmax of a column need all of
its rows before any parameter or code can be written, ``column_update`` reads the segment twice,
recomputing m in the second pass (the same fp32 operations, so the same m) instead of storing it.

The parameter moves with the unquantised m of this step; only what is stored is quantised, so the
quantisation error enters once per step instead of compounding through the update. Segments with
B = 1 keep exact AdamW state (fp32 m and v) and follow torch.optim.AdamW's operations.

Rounding: METHOD.md says nearest level, and 8-bit codes do that. At 4 bits nearest rounding has a
dead zone that costs quality: an entry whose change in one step, (1 - b1) * (g - m), is under
half a level spacing keeps its code, so a first moment whose gradient has gone quiet stops
decaying and keeps moving the parameter. 4-bit codes therefore round stochastically between the
two neighbouring levels (``codes.stochastic_quantize``), unbiased, with u from a counter hash of
(step, the element's index in its tensor) so every backend and rank layout agrees bit for bit
and a resumed run continues exactly. Measured: ``benchmarks/sharing_ablation.py --rounding``
(README, "Quality").

Memory: work goes chunk by chunk. A chunk holds whole blocks and at most max(CHUNK, B) elements,
and the temporaries of one chunk are at most ~40 bytes per element (fp32 copies of g, m, p and the
int64 indices that gather and bucketize produce), so a step allocates at most
40 * max(CHUNK, MAX_BLOCK) bytes = 5 MiB beyond the state, whatever the parameter's size.
Maths is fp32 for fp32, bf16 and fp16 parameters and gradients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .codes import quantize, read_codes, stochastic_quantize, uniforms, write_codes
from .segments import block_chunks, column_chunks

CHUNK = 1 << 17


@dataclass
class Hyper:
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: int

    @property
    def step_size(self) -> float:
        return self.lr / (1.0 - self.beta1**self.step)

    @property
    def bc2_sqrt(self) -> float:
        return math.sqrt(1.0 - self.beta2**self.step)


@dataclass
class SegmentState:
    """Views into a parameter's state tensors for one segment (see ``state.py``)."""

    start: int
    numel: int
    block_size: int
    codes: torch.Tensor | None = None
    absmax: torch.Tensor | None = None
    v: torch.Tensor | None = None
    exp_avg: torch.Tensor | None = None
    exp_avg_sq: torch.Tensor | None = None


def dense_update(p: torch.Tensor, g: torch.Tensor, st: SegmentState, h: Hyper) -> None:
    """B = 1: AdamW on fp32 state, in torch.optim.AdamW's order of operations."""
    for a in range(0, st.numel, CHUNK):
        b = min(a + CHUNK, st.numel)
        pc, gc = p[a:b], g[a:b].float()
        p32 = pc if pc.dtype == torch.float32 else pc.float()
        m, v = st.exp_avg[a:b], st.exp_avg_sq[a:b]
        p32.mul_(1.0 - h.lr * h.weight_decay)
        m.lerp_(gc, 1.0 - h.beta1)
        v.mul_(h.beta2).addcmul_(gc, gc, value=1.0 - h.beta2)
        denom = (v.sqrt() / h.bc2_sqrt).add_(h.eps)
        p32.addcdiv_(m, denom, value=-h.step_size)
        if p32 is not pc:
            pc.copy_(p32)


def block_update(
    p: torch.Tensor,
    g: torch.Tensor,
    st: SegmentState,
    h: Hyper,
    levels: torch.Tensor,
    mids: torch.Tensor,
    bits: int,
) -> None:
    """Shared-v, quantised-m update of one segment (flat views ``p`` and ``g`` of its elements)."""
    for c in block_chunks(st.start, st.numel, st.block_size, CHUNK):
        _update_blocks(
            p[c.elem : c.end].view(c.rows, c.length),
            g[c.elem : c.end].view(c.rows, c.length),
            st,
            c.elem,
            c.end,
            c.blocks,
            h,
            levels,
            mids,
            bits,
        )


def _update_blocks(p, g, st, a, b, blocks, h, levels, mids, bits) -> None:
    g32 = g.float()
    absmax, v = st.absmax[blocks], st.v[blocks]
    m = levels[read_codes(st.codes, a, b, bits).long()].view_as(g32).mul_(absmax[:, None])
    m.lerp_(g32, 1.0 - h.beta1)
    v.mul_(h.beta2).add_(g32.square().mean(dim=1), alpha=1.0 - h.beta2)
    p32 = p if p.dtype == torch.float32 else p.float()
    p32.mul_(1.0 - h.lr * h.weight_decay)
    denom = (v.sqrt() / h.bc2_sqrt).add_(h.eps)
    p32.addcdiv_(m, denom[:, None], value=-h.step_size)
    if p32 is not p:
        p.copy_(p32)
    amax = m.abs().amax(dim=1)
    absmax.copy_(amax)
    m.div_(torch.where(amax > 0, amax, torch.ones_like(amax))[:, None])
    write_codes(st.codes, a, b, requantize(m, st.start + a, h.step, levels, mids, bits), bits)


def requantize(
    x: torch.Tensor, first: int, step: int, levels: torch.Tensor, mids: torch.Tensor, bits: int
) -> torch.Tensor:
    """Flat codes of x (already divided by its absmax), whose elements are those at ``first``,
    ``first + 1``, ... of their tensor: nearest at 8 bits, stochastic at 4 (module docstring)."""
    x = x.reshape(-1)
    return quantize(x, mids) if bits == 8 else stochastic_codes(x, first, step, levels)


def stochastic_codes(x: torch.Tensor, first: int, step: int, levels: torch.Tensor) -> torch.Tensor:
    """Stochastic rounding of flat x, its elements those at ``first``, ``first + 1``, ... of
    their tensor (u = codes.uniforms of the step and those indices)."""
    index = torch.arange(first, first + x.numel(), device=x.device)
    return stochastic_quantize(x, levels, uniforms(step, index))


def column_update(
    p: torch.Tensor,
    g: torch.Tensor,
    st: SegmentState,
    h: Hyper,
    levels: torch.Tensor,
    mids: torch.Tensor,
    bits: int,
) -> None:
    """Shared-v, quantised-m update of a segment with column blocks (``st.block_size`` = -P)."""
    period, n = -st.block_size, st.numel
    nb = st.absmax.numel()
    sum_sq = torch.zeros(nb, dtype=torch.float32, device=p.device)
    amax = torch.zeros(nb, dtype=torch.float32, device=p.device)
    for _, _, m, g32 in _column_rows(g, st, h, levels, bits, period):
        w = m.shape[1]
        sum_sq[:w] += g32.square().sum(dim=0)
        torch.maximum(amax[:w], m.abs().amax(dim=0), out=amax[:w])
    count = torch.full((nb,), float(n // period), device=p.device)
    count[: n % period] += 1.0
    st.v.mul_(h.beta2).add_(sum_sq / count, alpha=1.0 - h.beta2)
    denom = (st.v.sqrt() / h.bc2_sqrt).add_(h.eps)
    scale = torch.where(amax > 0, amax, torch.ones_like(amax))
    for a, b, m, _ in _column_rows(g, st, h, levels, bits, period):
        w = m.shape[1]
        pc = p[a:b].view(-1, w)
        p32 = pc if pc.dtype == torch.float32 else pc.float()
        p32.mul_(1.0 - h.lr * h.weight_decay)
        p32.addcdiv_(m, denom[:w], value=-h.step_size)
        if p32 is not pc:
            pc.copy_(p32)
        codes = requantize(m / scale[:w], st.start + a, h.step, levels, mids, bits)
        write_codes(st.codes, a, b, codes, bits)
    st.absmax.copy_(amax)


def _column_rows(g, st, h, levels, bits, period):
    """(a, b, m, g) for the chunks of ``column_chunks``, m this step's first moment (fp32,
    rows x width)."""
    for lo, hi, w in column_chunks(st.numel, period, CHUNK):
        g32 = g[lo:hi].float().view(-1, w)
        m = levels[read_codes(st.codes, lo, hi, bits).long()].view_as(g32)
        m.mul_(st.absmax[:w]).lerp_(g32, 1.0 - h.beta1)
        yield lo, hi, m, g32
