"""The numba CPU fallback (where no C++ compiler builds ``csrc/gefen_cpu.cpp``): the reference
block update fused into one numba pass per block.

Why: the reference spends most of a step in ``torch.bucketize`` and in tensor temporaries; here
each block is read once for v and the new absmax and once more to write codes, with no
temporaries, over both cores (``prange`` over blocks). The arithmetic is the reference's, in the
same fp32 order of operations, except that the block mean of g^2 is accumulated in fp64 (torch
sums in fp32 in its own order), so v may differ from the reference in its last bits and a value
sitting on a codebook midpoint may round the other way; the tests bound both.

At 4 bits two neighbouring blocks share a byte when a block boundary falls on an odd element;
such segments run block after block instead of in parallel. The kernel uses as many threads as
torch does (``torch.set_num_threads``).

Column segments (``reference.column_update``) run here in one thread: two passes over the
segment in memory order, with the column sums and maxima in row-sized buffers.
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch

from .codes import code_table, step_key
from .reference import Hyper, SegmentState, local_factor

_NO_FACTOR = np.zeros(0, dtype=np.float32)  # a segment without v_cross (numba wants one type)


@numba.njit(cache=True, inline="always")
def _get(codes, i, four):
    if not four:
        return np.int64(codes[i])
    b = np.int64(codes[i >> 1])
    return (b >> 4) if (i & 1) else (b & 15)


@numba.njit(cache=True, inline="always")
def _put(codes, i, c, four):
    if not four:
        codes[i] = c
    elif i & 1:
        codes[i >> 1] = np.uint8((np.int64(codes[i >> 1]) & 15) | (c << 4))
    else:
        codes[i >> 1] = np.uint8((np.int64(codes[i >> 1]) & 240) | c)


LUT_CELLS = 4096


@numba.njit(cache=True, inline="always")
def _nearest(x, mids, lut):
    """Index of the first midpoint >= x: the nearest level, ties to the lower one. ``lut`` is
    codes.code_table: the answer, or -1 - where to start walking."""
    c = int(math.floor((np.float64(x) + 1.0) * (LUT_CELLS / 2)))
    c = min(max(c, 0), LUT_CELLS - 1)
    k = np.int64(lut[c])
    if k >= 0:
        return k
    k = -1 - k
    n = mids.shape[0]
    while k < n and mids[k] < x:
        k += 1
    while k > 0 and mids[k - 1] >= x:
        k -= 1
    return k


_M32 = np.uint64(0xFFFFFFFF)


@numba.njit(cache=True, inline="always")
def _mix32(x):
    x = x ^ (x >> np.uint64(16))
    x = (x * np.uint64(0x7FEB352D)) & _M32
    x = x ^ (x >> np.uint64(15))
    x = (x * np.uint64(0x846CA68B)) & _M32
    return x ^ (x >> np.uint64(16))


@numba.njit(cache=True, inline="always")
def _stochastic(x, levels, index, key):
    """codes.stochastic_quantize of one element, u = codes.uniforms(step, index)."""
    u = np.float32(_mix32((np.uint64(index) & _M32) ^ key) >> np.uint64(8)) * np.float32(2.0**-24)
    k = 0
    for t in range(1, levels.shape[0] - 1):
        if levels[t] <= x:
            k += 1
    low = levels[k]
    if u * (levels[k + 1] - low) < x - low:
        k += 1
    return k


@numba.njit(cache=True, inline="always")
def _code(x, levels, mids, lut, index, key, four):
    if four:
        return _stochastic(x, levels, index, key)
    return _nearest(x, mids, lut)


@numba.njit(cache=True)
def _one_block(j, p, g, codes, absmax, v, levels, mids, lut, start, block, four, h, fac):
    b1, w, b2, a2, decay, neg_step, bc2, eps, key = h
    n = p.shape[0]
    b0 = start // block
    lo = max((b0 + j) * block, start) - start
    hi = min((b0 + j + 1) * block, start + n) - start
    s = 0.0
    for i in range(lo, hi):
        s += np.float64(g[i]) * np.float64(g[i])
    mean = np.float32(s / (hi - lo))
    vj = v[j] * b2 + a2 * mean
    v[j] = vj
    sv = np.float32(math.sqrt(vj))
    denom = sv / bc2 + eps
    factored = fac.shape[0] > 0
    pos = (start + lo) % block - lo
    old = absmax[j]
    amax = np.float32(0.0)
    for i in range(lo, hi):
        m = levels[_get(codes, i, four)] * old
        m = m + w * (g[i] - m)
        d = sv * fac[pos + i] + eps if factored else denom
        p[i] = p[i] * decay + neg_step * m / d
        amax = max(amax, abs(m))
    absmax[j] = amax
    scale = amax if amax > 0 else np.float32(1.0)
    for i in range(lo, hi):
        m = levels[_get(codes, i, four)] * old
        m = m + w * (g[i] - m)
        _put(codes, i, _code(m / scale, levels, mids, lut, start + i, key, four), four)


@numba.njit(cache=True, parallel=True)
def _blocks_parallel(p, g, codes, absmax, v, levels, mids, lut, start, block, four, h, fac):
    for j in numba.prange(absmax.shape[0]):
        _one_block(j, p, g, codes, absmax, v, levels, mids, lut, start, block, four, h, fac)


@numba.njit(cache=True)
def _blocks_serial(p, g, codes, absmax, v, levels, mids, lut, start, block, four, h, fac):
    for j in range(absmax.shape[0]):
        _one_block(j, p, g, codes, absmax, v, levels, mids, lut, start, block, four, h, fac)


@numba.njit(cache=True)
def _columns(
    p, g, codes, absmax, v, levels, mids, lut, start, period, four, h, sum_sq, amax, denom, fac
):
    b1, w, b2, a2, decay, neg_step, bc2, eps, key = h
    n = p.shape[0]
    nb = absmax.shape[0]
    factored = fac.shape[0] > 0
    k = 0
    for i in range(n):
        m = levels[_get(codes, i, four)] * absmax[k]
        m = m + w * (g[i] - m)
        sum_sq[k] += np.float64(g[i]) * np.float64(g[i])
        amax[k] = max(amax[k], abs(m))
        k += 1
        if k == period:
            k = 0
    for k in range(nb):
        count = n // period + (1 if k < n % period else 0)
        vk = v[k] * b2 + a2 * np.float32(sum_sq[k] / count)
        v[k] = vk
        sv = np.float32(math.sqrt(vk))
        denom[k] = sv if factored else sv / bc2 + eps  # factored: sqrt(v), times the row's factor
    k = 0
    r, t = start // period, start % period  # the element's tensor row and column
    for i in range(n):
        m = levels[_get(codes, i, four)] * absmax[k]
        m = m + w * (g[i] - m)
        d = denom[k] * fac[r] + eps if factored else denom[k]
        p[i] = p[i] * decay + neg_step * m / d
        scale = amax[k] if amax[k] > 0 else np.float32(1.0)
        _put(codes, i, _code(m / scale, levels, mids, lut, start + i, key, four), four)
        k += 1
        if k == period:
            k = 0
        t += 1
        if t == period:
            t = 0
            r += 1
    for k in range(nb):
        absmax[k] = amax[k]


def supports(p: torch.Tensor, g: torch.Tensor) -> bool:
    return p.device.type == "cpu" and p.dtype == g.dtype == torch.float32


def _hyper(h: Hyper) -> tuple:
    f32 = np.float32
    return (
        f32(h.beta1),
        f32(1.0 - h.beta1),
        f32(h.beta2),
        f32(1.0 - h.beta2),
        f32(1.0 - h.lr * h.weight_decay),
        f32(-h.step_size),
        f32(h.bc2_sqrt),
        f32(h.eps),
        np.uint64(step_key(h.step)),
    )


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
    """Same contract as ``reference.column_update`` for fp32 CPU tensors."""
    nb = st.absmax.numel()
    f = local_factor(g, st, h) if factor is None else factor
    _columns(
        p.detach().numpy(),
        g.detach().numpy(),
        st.codes.numpy(),
        st.absmax.numpy(),
        st.v.numpy(),
        levels.numpy(),
        mids.numpy(),
        code_table(mids, LUT_CELLS).numpy(),
        st.start,
        -st.block_size,
        bits == 4,
        _hyper(h),
        np.zeros(nb, dtype=np.float64),
        np.zeros(nb, dtype=np.float32),
        np.zeros(nb, dtype=np.float32),
        _NO_FACTOR if f is None else f.numpy(),
    )


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
    """Same contract as ``reference.block_update`` for fp32 CPU tensors."""
    f = local_factor(g, st, h) if factor is None else factor
    hyper = _hyper(h)
    four = bits == 4
    args = (
        p.detach().numpy(),
        g.detach().numpy(),
        st.codes.numpy(),
        st.absmax.numpy(),
        st.v.numpy(),
        levels.numpy(),
        mids.numpy(),
        code_table(mids, LUT_CELLS).numpy(),
        st.start,
        st.block_size,
        four,
        hyper,
        _NO_FACTOR if f is None else f.numpy(),
    )
    if four and (st.block_size % 2 or st.start % 2):
        _blocks_serial(*args)
        return
    threads = torch.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    try:
        _blocks_parallel(*args)
    finally:
        # numba's OpenMP layer resets the OpenMP thread count that torch's kernels share,
        # which would change torch's reduction order (and results) from this step on
        torch.set_num_threads(threads)
