"""The reference update: the readable spec of one Gefen step on one segment, in plain PyTorch.

Every native kernel is tested against these functions. Per block of B elements (docs/method.md, 3):

    m     = levels[code] * absmax                      dequantise
    m     = b1 * m + (1 - b1) * g                      (lerp, as AdamW)
    v     = b2 * v + (1 - b2) * mean(g^2 over block)   one v per block
    p     = p * (1 - lr * wd)                          decoupled weight decay
    p     = p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
                                                       (the denominator at least
                                                       ``overshoot_denominator``'s)
    absmax, code = max|m| over block, level of m / absmax: nearest (8 bits) or stochastic (4)

Column blocks (block size -P: the segment's element i belongs to block i mod P) follow the same
formulas with the block's elements strided by P; as v and the new absmax of a column need all of
its rows before any parameter or code can be written, ``column_update`` reads the segment twice,
recomputing m in the second pass (the same fp32 operations, so the same m) instead of storing it.

The second moment is factored (``cross_factor``): a tensor of at least MIN_CROSS_BLOCKS blocks
also keeps ``v_cross``, one v per position across its blocks (position i mod B of contiguous
blocks, so column j of the (n / B, B) view; the tensor's row for column blocks), an EMA of the
mean g^2 over the blocks at that position. Element (block b, position j) then divides by

    sqrt(v_b * c_j) / sqrt(1 - b2^t) + eps,   c_j = max(v_cross_j / mean(v_cross), CROSS_FLOOR)

Adafactor's rank-1 fit of v, with Gefen's block v as one factor. Why: one v per block cannot follow
how g^2 varies across a block (an input feature's scale, along every row), and that cost 3-7 %
validation loss on the suite's language models (README, "One-axis sharing"); c costs at
most 4 / MIN_CROSS_BLOCKS bytes per parameter, ~0.01 on the suite's language models. c is a
ratio, so it needs no bias correction. CROSS_FLOOR bounds how far a position that has seen
(almost) no gradient can shrink its denominator: there the quantised m keeps an error of up to
a level spacing times the block's absmax, which an exact m would not have, and
1 / sqrt(CROSS_FLOOR) = 10 caps how much c can amplify it.

c comes from v_cross as the steps before this one left it; this step's mean g^2 is folded in after.
Why a step late: this step's own sums over every block at a position need a whole pass over g before
the first parameter may move, a pass that took a quarter of a 100M-parameter CPU step
(docs/step_time.md, "Where the step's time goes"); a step late, the C++ kernel takes the sums in the
update's own read of g (the CUDA kernels still take them in a pass of their own). What the lag
changes: c is a ratio of EMAs, each step moving v_cross by (1 - b2) of the way to that step's mean
g^2; the factor a step sees lacks only its own step's share. Where v_cross is still all zero (the
first step, or a state saved before v_cross existed, which loads as zeros) c comes from this step's
fold instead, as it would have without the lag, so no step runs without the factor.

v_cross belongs to the tensor, not to a piece: positions and rows are the tensor's, and a tensor
spread over ranks (FSDP, ZeRO) has its per-entry sums of g^2 (``cross_sums``) added over the
ranks by one all-reduce per step before ``cross_factor``, so every rank holding a piece keeps the
single-process v_cross (a copy each) and takes the single-process step.

Where the gradient turns (``overshoot_denominator``): an element whose own signal m_hat^2 =
(m / (1 - b1^t))^2 outgrows its block's shared estimate s_ij^2 (s_ij = sqrt(v_b) / sqrt(1 - b2^t),
times c_j's square root where factored) steps further than AdamW would, which is what gives Gefen
its lead at a good lr and what overshoots at a high one. Reading the block's v as a shared
noise plus each element's own signal, v_ij = s_ij^2 keep_b + m_hat_ij^2 with keep_b = 1 -
mean(m_hat^2) / mean(s^2) over the block (clamped to [0, 1]; ``block_keep``), gives each
element AdamW's own v in expectation where the block's noise is even. It is used only where
this step's gradient opposes m after the fold (g_ij m_ij < 0: the last steps went past the
valley floor along that element), and never for a shorter denominator than s_ij:

    denom_ij = max(s_ij, sqrt(s_ij^2 keep_b + m_hat_ij^2)) + eps   where g_ij m_ij < 0
    denom_ij = s_ij + eps                                          elsewhere

No constant and no state: m, g and the block's v are what the update reads anyway; the means
over the block are two more sums per block (mean(s^2) = sqrt(v_b)^2 times the block's mean of
f^2, f = sqrt(c) / sqrt(1 - b2^t), where factored). Measured:
``research/results/high_lr_osc.md`` (the probe's ``split_osc``).

AdamW's floor (``adamw_floor``, after the overshoot rule in ``denominator``): AdamW's v takes
1 - b2 of this step's g^2, so its sqrt(v-hat) is never below |g_ij| sqrt(1 - b2) / sqrt(1 - b2^t)
(``Hyper.g_floor``; at the first step, |g_ij| itself). Every element's denominator is at least
that too. The factor is read a step late, so a column whose g^2 jumps this step is in AdamW's v
but not yet in c: without the floor its elements step as if it had not jumped, which on a GRU at
three times its best lr left runs stalled far behind AdamW's (``research/results/rank_v.md``).
No constant and no state: g is read by the update anyway.

The parameter moves with the unquantised m of this step; only what is stored is quantised, so the
quantisation error enters once per step instead of compounding through the update. Segments with
B = 1 follow torch.optim.AdamW's operations and keep m and v in bf16, stochastically rounded
(``dense_update``): 4 bytes per element instead of AdamW's 8. Why not fp32: those are the
tensors the partition finds no structure in (norm gains, biases, small heads); a few per mille of
a large model, but 1-4 % of the suite's small ones, where 8 bytes each cost up to 0.3 bytes per
parameter. Why stochastic: nearest rounding would freeze v wherever (1 - b2) |g^2 - v| is under
half a bf16 spacing; unbiased rounding adds noise instead, a relative SD in v of at most
2^-8 / sqrt(1 - b2^2) (9 % at b2 = 0.999, ~5 % on average; half that in the step), the order of
the sampling noise of AdamW's own v (3 % for Gaussian g at b2 = 0.999) and far below the spread a
shared block v carries.

Rounding: the method says nearest level, and 8-bit codes do that. At 4 bits nearest rounding has a
dead zone that costs quality: an entry whose change in one step, (1 - b1) * (g - m), is under
half a level spacing keeps its code, so a first moment whose gradient has gone quiet stops
decaying and keeps moving the parameter. 4-bit codes therefore round stochastically between the
two neighbouring levels (``codes.stochastic_quantize``), unbiased, with u from a counter hash of
(step, the element's index in its tensor) so every backend and rank layout agrees bit for bit
and a resumed run continues exactly. Measured: ``benchmarks/sharing_ablation.py --rounding``
(README, "Quality").

Memory: work goes chunk by chunk. A chunk holds whole blocks and at most max(CHUNK, B) elements,
and the temporaries of one chunk are at most ~44 bytes per element (fp32 copies of g, m, p, a
factored denominator and the int64 indices that gather and bucketize produce), so a step allocates
at most 44 * max(CHUNK, MAX_BLOCK) bytes = 5.5 MiB beyond the state, whatever the parameter's size.
Maths is fp32 for fp32, bf16 and fp16 parameters and gradients. A bf16 parameter is written
back rounded to nearest, or with ``bf16_stochastic_round`` stochastically (``codes.write_param``:
``round_bf16`` with r = ``codes.param_bits`` of the step and the element's index in its tensor,
a hash stream of its own), so that an update under half a bf16 spacing moves the weight with
the right probability instead of never: without an fp32 master copy, that is what keeps late
training's small steps.
"""

from __future__ import annotations

import torch

from ..method.codes import (
    hash_bits,
    quantize,
    read_codes,
    round_bf16,
    stochastic_quantize,
    uniforms,
    write_codes,
    write_param,
)
from ..method.hyper import Hyper
from ..method.segments import block_chunks, column_chunks
from ..method.state import CROSS_FLOOR, SegmentState

CHUNK = 1 << 17
CROSS_CHUNK = 1 << 16


def cross_sums(
    g: torch.Tensor, start: int, block_size: int, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 sums of g^2, and element counts, at each entry of the tensor's ``v_cross`` over one
    piece (elements ``start``, ``start + 1``, ... of the tensor): position (start + i) mod B,
    or row (start + i) div P. Sums over pieces on several ranks add up to the whole tensor's;
    fixed chunks of CROSS_CHUNK (not CHUNK) keep the update's chunking out of the result."""
    sums = torch.zeros(length, dtype=torch.float64, device=g.device)
    counts = torch.zeros(length, dtype=torch.float64, device=g.device)
    numel, contiguous = g.numel(), block_size > 0
    width = block_size if contiguous else -block_size
    head = min((-start) % width, numel)
    if head:
        x = g[:head].double().square()
        if contiguous:
            first = start % width
            sums[first : first + head] += x
            counts[first : first + head] += 1.0
        else:
            sums[start // width] += x.sum()
            counts[start // width] += head
    whole = (numel - head) // width
    row0 = -(-start // width)  # the tensor row of the first whole row
    per = max(1, CROSS_CHUNK // width)
    for r0 in range(0, whole, per):
        r1 = min(r0 + per, whole)
        x = g[head + r0 * width : head + r1 * width].double().view(-1, width).square()
        if contiguous:
            sums += x.sum(dim=0)
        else:
            sums[row0 + r0 : row0 + r1] += x.sum(dim=1)
            counts[row0 + r0 : row0 + r1] += width
    if contiguous:
        counts += float(whole)
    tail = numel - head - whole * width
    if tail:
        x = g[numel - tail :].double().square()
        if contiguous:
            sums[:tail] += x
            counts[:tail] += 1.0
        else:
            sums[row0 + whole] += x.sum()
            counts[row0 + whole] += tail
    return sums, counts


def cross_mean(sums: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Mean g^2 per entry (fp32); 0 where no element was seen (a piece's own entries only)."""
    return torch.where(counts > 0, sums / counts.clamp(min=1.0), 0.0).float()


def cross_factor(st: SegmentState, h: Hyper, mean_sq: torch.Tensor) -> torch.Tensor:
    """sqrt(c) / sqrt(1 - b2^t) per entry (module docstring), c from ``st.v_cross`` as the steps
    before this one left it, or, where those left it all zero, from this step's fold; then this
    step's mean g^2 per entry folded into ``st.v_cross``. Every rank holding a piece of the
    tensor gets the same ``mean_sq`` (the optimizer sums ``cross_sums`` over them), hence the
    same v_cross. A factor normalised per matrix (``state.cross_groups``) comes here a slice at
    a time (``cross._slices``)."""
    before = st.v_cross.mean()
    c = st.v_cross / torch.where(before > 0, before, torch.ones_like(before))
    st.v_cross.mul_(h.beta2).add_(mean_sq, alpha=1.0 - h.beta2)
    total = st.v_cross.mean()
    first = st.v_cross / torch.where(total > 0, total, torch.ones_like(total))
    c = torch.where(before > 0, c, first)
    return c.clamp_(min=CROSS_FLOOR).sqrt_().div_(h.bc2_sqrt)


def local_factor(g: torch.Tensor, st: SegmentState, h: Hyper) -> torch.Tensor | None:
    """The factor from the segment's own elements, or None for a segment without one: exact
    for a whole tensor; the optimizer computes it from every rank's piece instead."""
    if st.v_cross is None or st.v_cross.numel() == 0:
        return None
    sums, counts = cross_sums(g, st.start, st.block_size, st.v_cross.numel())
    return cross_factor(st, h, cross_mean(sums, counts))


def dense_update(p: torch.Tensor, g: torch.Tensor, st: SegmentState, h: Hyper) -> None:
    """B = 1: AdamW in torch.optim.AdamW's order of operations on fp32 copies of m and v, stored
    back as bf16 rounded stochastically (``codes.round_bf16``; m with the low 16 bits of the
    element's hash, v with the high 16). The parameter moves with this step's fp32 m and v."""
    for a in range(0, st.numel, CHUNK):
        b = min(a + CHUNK, st.numel)
        pc, gc = p[a:b], g[a:b].float()
        p32 = pc if pc.dtype == torch.float32 else pc.float()
        m, v = st.exp_avg[a:b].float(), st.exp_avg_sq[a:b].float()
        p32.mul_(1.0 - h.lr * h.weight_decay)
        m.lerp_(gc, 1.0 - h.beta1)
        v.mul_(h.beta2).addcmul_(gc, gc, value=1.0 - h.beta2)
        denom = (v.sqrt() / h.bc2_sqrt).add_(h.eps)
        p32.addcdiv_(m, denom, value=-h.step_size)
        write_param(pc, p32, h.bf16_stochastic_round, h.step, st.start + a)
        r = hash_bits(h.step, torch.arange(st.start + a, st.start + b, device=m.device))
        st.exp_avg[a:b] = round_bf16(m, r & 0xFFFF)
        st.exp_avg_sq[a:b] = round_bf16(v, r >> 16)


def block_update(
    p: torch.Tensor,
    g: torch.Tensor,
    st: SegmentState,
    h: Hyper,
    levels: torch.Tensor,
    mids: torch.Tensor,
    bits: int,
    factor: torch.Tensor | None = None,
) -> None:
    """Block-v, quantised-m update of one segment (flat views ``p`` and ``g`` of its elements);
    ``factor``: this step's ``cross_factor`` of its tensor, or None to compute it from the
    segment alone (``local_factor``)."""
    f = local_factor(g, st, h) if factor is None else factor
    b = st.block_size
    for c in block_chunks(st.start, st.numel, b, CHUNK):
        pos = (st.start + c.elem) % b
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
            None if f is None else f[pos : pos + c.length],
        )


def _update_blocks(p, g, st, a, b, blocks, h, levels, mids, bits, f) -> None:
    g32 = g.float()
    absmax, v = st.absmax[blocks], st.v[blocks]
    m = levels[read_codes(st.codes, a, b, bits).long()].view_as(g32).mul_(absmax[:, None])
    m.lerp_(g32, 1.0 - h.beta1)
    v.mul_(h.beta2).add_(g32.square().mean(dim=1), alpha=1.0 - h.beta2)
    p32 = p if p.dtype == torch.float32 else p.float()
    p32.mul_(1.0 - h.lr * h.weight_decay)
    sv = v.sqrt()
    if f is None:
        shared = (sv / h.bc2_sqrt)[:, None].expand_as(m)
        ss = shared[:, 0].square()
    else:
        shared = sv[:, None] * f[None, :]
        ss = sv.square() * f.square().mean()
    keep = block_keep((m / h.bc1).square().mean(dim=1), ss)
    denom = denominator(shared, m, g32, keep[:, None], h).add_(h.eps)
    p32.addcdiv_(m, denom, value=-h.step_size)
    write_param(p, p32, h.bf16_stochastic_round, h.step, st.start + a)
    amax = m.abs().amax(dim=1)
    absmax.copy_(amax)
    m.div_(torch.where(amax > 0, amax, torch.ones_like(amax))[:, None])
    write_codes(st.codes, a, b, requantize(m, st.start + a, h.step, levels, mids, bits), bits)


def block_keep(mean_m2: torch.Tensor, mean_s2: torch.Tensor) -> torch.Tensor:
    """Each block's share of its v that is noise, 1 - mean(m_hat^2) / mean(s^2) clamped to
    [0, 1] (0 where mean(s^2) is 0): ``mean_m2`` the block's mean of (m / (1 - b1^t))^2 after
    this step's fold, ``mean_s2`` its mean of the shared denominator's square (module
    docstring, "Where the gradient turns")."""
    ratio = mean_m2 / torch.where(mean_s2 > 0, mean_s2, torch.ones_like(mean_s2))
    return torch.where(mean_s2 > 0, (1.0 - ratio).clamp(min=0.0), torch.zeros_like(ratio))


def overshoot_denominator(
    shared: torch.Tensor, m: torch.Tensor, g: torch.Tensor, keep: torch.Tensor, h: Hyper
) -> torch.Tensor:
    """``shared`` (the block's sqrt(v), times the factor), and where this step's gradient
    opposes m, at least sqrt(shared^2 keep + m_hat^2)."""
    split = (shared.square() * keep).addcmul_(m, m, value=1.0 / h.bc1**2).sqrt_()
    return torch.where(m * g < 0, torch.maximum(shared, split), shared)


def adamw_floor(d: torch.Tensor, g: torch.Tensor, h: Hyper) -> torch.Tensor:
    """``d``, at least |g| sqrt(1 - b2) / sqrt(1 - b2^t) (module docstring, "AdamW's floor")."""
    return torch.maximum(d, g.abs() * h.g_floor)


def denominator(
    shared: torch.Tensor, m: torch.Tensor, g: torch.Tensor, keep: torch.Tensor, h: Hyper
) -> torch.Tensor:
    """A blocked element's denominator before eps: the overshoot rule's, then AdamW's floor."""
    return adamw_floor(overshoot_denominator(shared, m, g, keep, h), g, h)


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
    factor: torch.Tensor | None = None,
) -> None:
    """Block-v, quantised-m update of a segment with column blocks (``st.block_size`` = -P);
    ``factor`` as ``block_update``'s, one entry per row of the tensor."""
    f = local_factor(g, st, h) if factor is None else factor
    period, n = -st.block_size, st.numel
    nb = st.absmax.numel()
    sum_sq = torch.zeros(nb, dtype=torch.float32, device=p.device)
    sum_m2 = torch.zeros(nb, dtype=torch.float32, device=p.device)
    sum_f2 = torch.zeros(nb, dtype=torch.float32, device=p.device)
    amax = torch.zeros(nb, dtype=torch.float32, device=p.device)
    for a, _, m, g32 in _column_rows(g, st, h, levels, bits, period):
        w = m.shape[1]
        sum_sq[:w] += g32.square().sum(dim=0)
        sum_m2[:w] += (m / h.bc1).square().sum(dim=0)
        if f is not None:
            sum_f2[:w] += _row_factor(f, st.start + a, m.shape[0], w, period).square().sum(dim=0)
        torch.maximum(amax[:w], m.abs().amax(dim=0), out=amax[:w])
    count = torch.full((nb,), float(n // period), device=p.device)
    count[: n % period] += 1.0
    st.v.mul_(h.beta2).add_(sum_sq / count, alpha=1.0 - h.beta2)
    sqrt_v = st.v.sqrt()
    col = sqrt_v / h.bc2_sqrt
    ss = col.square() if f is None else sqrt_v.square() * (sum_f2 / count)
    keep = block_keep(sum_m2 / count, ss)
    scale = torch.where(amax > 0, amax, torch.ones_like(amax))
    for a, b, m, g32 in _column_rows(g, st, h, levels, bits, period):
        w = m.shape[1]
        pc = p[a:b].view(-1, w)
        p32 = pc if pc.dtype == torch.float32 else pc.float()
        p32.mul_(1.0 - h.lr * h.weight_decay)
        if f is None:
            shared = col[None, :w].expand_as(m)
        else:
            shared = sqrt_v[None, :w] * _row_factor(f, st.start + a, m.shape[0], w, period)
        d = denominator(shared, m, g32, keep[None, :w], h).add_(h.eps)
        p32.addcdiv_(m, d, value=-h.step_size)
        write_param(pc, p32, h.bf16_stochastic_round, h.step, st.start + a)
        codes = requantize(m / scale[:w], st.start + a, h.step, levels, mids, bits)
        write_codes(st.codes, a, b, codes, bits)
    st.absmax.copy_(amax)


def _row_factor(f, first, rows, w, period):
    """The factor of each element's tensor row, (rows, w), for ``rows`` rows of the segment's
    view whose first element is the tensor's ``first``: where a piece starts mid-row its view's
    rows straddle two tensor rows, columns from ``cut`` on lying in the next."""
    r0, cut = first // period, period - first % period
    fr = f[r0 : r0 + rows + (1 if cut < w else 0)]
    if cut >= w:
        return fr[:, None].expand(rows, w)
    cols = torch.arange(w, device=f.device)
    return torch.where(cols[None, :] < cut, fr[:rows, None], fr[1:, None])


def _column_rows(g, st, h, levels, bits, period):
    """(a, b, m, g) for the chunks of ``column_chunks``, m this step's first moment (fp32,
    rows x width)."""
    for lo, hi, w in column_chunks(st.numel, period, CHUNK):
        g32 = g[lo:hi].float().view(-1, w)
        m = levels[read_codes(st.codes, lo, hi, bits).long()].view_as(g32)
        m.mul_(st.absmax[:w]).lerp_(g32, 1.0 - h.beta1)
        yield lo, hi, m, g32
