"""Gefen's update in Triton (``triton_backend`` is the host side): the arithmetic of
``reference.py`` in the fp32 order the CUDA C++ kernels had, every segment of a step in a bounded
number of launches over segment tables held on the device.

Imported only by ``triton_backend._kernels`` (so ``import gefen_dist`` never imports triton);
``@triton.jit`` decides at import whether these run compiled or under the interpreter
(``TRITON_INTERPRET=1``), so that must be set before the first import.

Tables: ``ints`` (int64) holds the ``Meta`` rows of ``segment_table.row`` (addresses as
integers that the kernels cast to typed pointers), the ``Aux`` rows and the launches'
prefixes; ``floats`` (fp32) holds the ``Hyp`` rows of ``segment_table.hyper_row``; the factor
pass's tables are ``Cross`` and ``CrossHyp`` rows. A program finds its row by a
binary search over its launch's prefix (each row's first program). Only tile shapes are
constexpr; every integer argument is excluded from specialisation, so a step with other
hyperparameters, another step key or another layout never compiles anything new.

Arithmetic: fp32 with correctly rounded division and square root (``div_rn``, ``sqrt_rn``),
launched with ``enable_fp_fusion=False`` so nothing is contracted into an FMA; sums of g^2 (and
the overshoot rule's (m / bc1)^2 and f^2 per block) in fp64 in a fixed order (no atomics), so a
launch gives the same bits every run. Stores to bf16
round to nearest even with integer operations (the interpreter's own fp32 -> bf16 conversion
truncates), as ``Tensor.copy_``.
"""

from __future__ import annotations

import inspect

import triton
import triton.language as tl

from .segment_table import Aux, Cross, CrossHyp, DType, Hist, HistAmax, Hyp, Meta

# The tables' columns (and dtype codes) as constexprs, each from its segment_table enum: the
# kernels index the tables by these names only (tests/test_tables.py holds them to the enums).

# Meta: segment_table.row
M_P = tl.constexpr(int(Meta.P))
M_G = tl.constexpr(int(Meta.G))
M_CODES = tl.constexpr(int(Meta.CODES))
M_ABSMAX = tl.constexpr(int(Meta.ABSMAX))
M_V = tl.constexpr(int(Meta.V))
M_LEVELS = tl.constexpr(int(Meta.LEVELS))
M_MIDS = tl.constexpr(int(Meta.MIDS))
M_START = tl.constexpr(int(Meta.START))
M_NUMEL = tl.constexpr(int(Meta.NUMEL))
M_BLOCK = tl.constexpr(int(Meta.BLOCK))
M_BITS = tl.constexpr(int(Meta.BITS))
M_P_DTYPE = tl.constexpr(int(Meta.P_DTYPE))
M_G_DTYPE = tl.constexpr(int(Meta.G_DTYPE))
M_EXP_AVG = tl.constexpr(int(Meta.EXP_AVG))
M_EXP_AVG_SQ = tl.constexpr(int(Meta.EXP_AVG_SQ))
M_N_LEVELS = tl.constexpr(int(Meta.N_LEVELS))
M_STEP_KEY = tl.constexpr(int(Meta.STEP_KEY))
M_FACTOR = tl.constexpr(int(Meta.FACTOR))
M_V_CROSS = tl.constexpr(int(Meta.V_CROSS))
M_COLS = tl.constexpr(len(Meta))

# Hyp: segment_table.hyper_row
H_BETA1 = tl.constexpr(int(Hyp.BETA1))
H_W = tl.constexpr(int(Hyp.W))
H_BETA2 = tl.constexpr(int(Hyp.BETA2))
H_A2 = tl.constexpr(int(Hyp.A2))
H_DECAY = tl.constexpr(int(Hyp.DECAY))
H_NEG_STEP = tl.constexpr(int(Hyp.NEG_STEP))
H_BC2 = tl.constexpr(int(Hyp.BC2))
H_EPS = tl.constexpr(int(Hyp.EPS))
H_BC1 = tl.constexpr(int(Hyp.BC1))
H_G_FLOOR = tl.constexpr(int(Hyp.G_FLOOR))
H_COLS = tl.constexpr(len(Hyp))

# Aux: triton_backend.step_plan
A_SCR = tl.constexpr(int(Aux.SCR))
A_PART = tl.constexpr(int(Aux.PART))
A_CHUNKS = tl.constexpr(int(Aux.CHUNKS))
A_PER = tl.constexpr(int(Aux.PER))
A_NB = tl.constexpr(int(Aux.NB))
A_COLS = tl.constexpr(len(Aux))

# Cross: segment_table.cross_row
X_G = tl.constexpr(int(Cross.G))
X_G_DTYPE = tl.constexpr(int(Cross.G_DTYPE))
X_START = tl.constexpr(int(Cross.START))
X_NUMEL = tl.constexpr(int(Cross.NUMEL))
X_BLOCK = tl.constexpr(int(Cross.BLOCK))
X_LENGTH = tl.constexpr(int(Cross.LENGTH))
X_V = tl.constexpr(int(Cross.V))
X_SUMS = tl.constexpr(int(Cross.SUMS))
X_COUNTS = tl.constexpr(int(Cross.COUNTS))
X_V_CROSS = tl.constexpr(int(Cross.V_CROSS))
X_OUT = tl.constexpr(int(Cross.OUT))
X_PART = tl.constexpr(int(Cross.PART))
X_CHUNKS = tl.constexpr(int(Cross.CHUNKS))
X_COLS = tl.constexpr(len(Cross))

# CrossHyp: segment_table.cross_hyper_row
XH_BETA2 = tl.constexpr(int(CrossHyp.BETA2))
XH_A2 = tl.constexpr(int(CrossHyp.A2))
XH_BC2 = tl.constexpr(int(CrossHyp.BC2))
XH_FLOOR = tl.constexpr(int(CrossHyp.FLOOR))
XH_COLS = tl.constexpr(len(CrossHyp))

# DType: segment_table.DTYPES
DT_F32 = tl.constexpr(int(DType.F32))
DT_BF16 = tl.constexpr(int(DType.BF16))
DT_F16 = tl.constexpr(int(DType.F16))
DT_BF16_SR = tl.constexpr(int(DType.BF16_SR))

# Hist: triton_backend.histogram
HI_G = tl.constexpr(int(Hist.G))
HI_G_DTYPE = tl.constexpr(int(Hist.G_DTYPE))
HI_START = tl.constexpr(int(Hist.START))
HI_NUMEL = tl.constexpr(int(Hist.NUMEL))
HI_BLOCK = tl.constexpr(int(Hist.BLOCK))
HI_BLOCKS = tl.constexpr(int(Hist.BLOCKS))
HI_BINS = tl.constexpr(int(Hist.BINS))
HI_COUNTS = tl.constexpr(int(Hist.COUNTS))
HI_COLS = tl.constexpr(len(Hist))

# HistAmax: triton_backend.histogram
HA_HEAD = tl.constexpr(int(HistAmax.HEAD))
HA_TAIL = tl.constexpr(int(HistAmax.TAIL))
HA_COLS = tl.constexpr(len(HistAmax))


def _kernel(fn):
    """``triton.jit`` with no integer argument specialised on its value (== 1, % 16): a new
    table offset or row count must never select another compiled variant."""
    names = inspect.signature(fn).parameters
    ints = [n for n in ("meta_at", "hyp_at", "aux_at", "prefix_at", "n_rows") if n in names]
    return triton.jit(fn, do_not_specialize=ints)


# ------------------------------------------------------------------------------------ helpers


@triton.jit
def _bound(x):
    """A loop bound computed at run time: ``x`` itself (inlined, so the compiled code is the
    same as without it)."""
    return x


if type(_bound).__name__ == "InterpretedFunction":

    def _bound(x):  # noqa: F811
        """Under the interpreter a scalar is a 1-element array, and triton 3.6's ``range`` takes a
        bound by ``int()`` of it, which numpy >= 2.4 refuses ("only 0-dimensional arrays can be
        converted to Python scalars"; later tritons squeeze the array first): the same value as
        a Python int."""
        return int(x.handle.data.item())


@triton.jit
def _find(prefix, n_rows, item):
    """The largest row s in [0, n_rows) with prefix[s] <= item, by binary search."""
    lo = tl.zeros((), tl.int32)
    hi = n_rows - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        ok = tl.load(prefix + mid) <= item
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    return lo


@triton.jit
def _program(ints, meta_at, prefix_at, n_rows, COLS: tl.constexpr):
    """Every table kernel's prologue: this program's row s of the launch (a binary search of
    its prefix of each row's first program), the address of the row's integers (``COLS`` per
    row, from ``meta_at``), and the program's index among the row's."""
    pid = tl.program_id(0)
    s = _find(ints + prefix_at, n_rows, pid)
    return s, ints + meta_at + s * COLS, pid - tl.load(ints + prefix_at + s)


@triton.jit
def _update_program(ints, floats, meta_at, hyp_at, aux_at, prefix_at, n_rows):
    """``_program`` of the update's blocked and column kernels: the row's ``Meta``, ``Hyp``
    and ``Aux`` addresses, and the program's index among the row's."""
    s, m, local = _program(ints, meta_at, prefix_at, n_rows, M_COLS)
    return m, floats + hyp_at + s * H_COLS, ints + aux_at + s * A_COLS, local


@triton.jit
def _ld(addr, offs, mask, dt):
    """fp32 values of a tensor of dtype code ``dt`` (segment_table.DType) at
    ``addr``."""
    if (dt == DT_BF16) | (dt == DT_BF16_SR):
        b = tl.load(addr.to(tl.pointer_type(tl.uint16)) + offs, mask=mask, other=0)
        x = (b.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    elif dt == DT_F16:
        x = tl.load(addr.to(tl.pointer_type(tl.float16)) + offs, mask=mask, other=0.0)
        x = x.to(tl.float32)
    else:
        x = tl.load(addr.to(tl.pointer_type(tl.float32)) + offs, mask=mask, other=0.0)
    return x


@triton.jit
def _bf16_rne(x):
    """bf16 bits of fp32 x rounded to nearest even (c10's round_to_nearest_even; NaN 0x7FC0)."""
    u = x.to(tl.uint32, bitcast=True)
    r = (u + (((u >> 16) & 1) + 0x7FFF)) >> 16
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return tl.where(nan, 0x7FC0, r).to(tl.uint16)


@triton.jit
def _st(addr, offs, mask, x, dt):
    """Store fp32 x into a tensor of dtype code ``dt``, rounded to nearest even."""
    if dt == DT_BF16:
        tl.store(addr.to(tl.pointer_type(tl.uint16)) + offs, _bf16_rne(x), mask=mask)
    elif dt == DT_F16:
        tl.store(addr.to(tl.pointer_type(tl.float16)) + offs, x.to(tl.float16), mask=mask)
    else:
        tl.store(addr.to(tl.pointer_type(tl.float32)) + offs, x, mask=mask)


@triton.jit
def _st_param(addr, offs, mask, x, dt, index, pkey):
    """A parameter's write: ``_st``, or for ``DType.BF16_SR`` bf16 rounded
    stochastically with r = codes.param_bits (``index``: the elements' indices in their tensor,
    int64; ``pkey``: codes.param_key of the step)."""
    if dt == DT_BF16_SR:
        r = _hash(index, pkey) & 0xFFFF
        tl.store(addr.to(tl.pointer_type(tl.uint16)) + offs, _bf16_stochastic(x, r), mask=mask)
    else:
        _st(addr, offs, mask, x, dt)


@triton.jit
def _param_key(key):
    """codes.param_key from the step key (uint32)."""
    return _mix32(key ^ tl.full((), 0x2545F491, tl.uint32))


@triton.jit
def _lerp(start, end, w):
    """torch's lerp: start + w * (end - start) for w < 0.5, else end - (end - start) * (1 - w)."""
    d = end - start
    return tl.where(w < 0.5, start + w * d, end - d * (1.0 - w))


@triton.jit
def _mix32(x):
    """codes._mix32 ("lowbias32") on uint32."""
    x = x ^ (x >> 16)
    x = x * tl.full((), 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full((), 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _hash(index, key):
    """codes.hash_bits: mix32((index mod 2^32) ^ step_key), uint32; ``index`` int64."""
    return _mix32(index.to(tl.uint32) ^ key)


@triton.jit
def _bf16_stochastic(x, r):
    """codes.round_bf16 of fp32 x with r in [0, 2^16) (uint32): bf16 bits (uint16)."""
    u = x.to(tl.uint32, bitcast=True)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return tl.where(nan, (u >> 16) | 0x40, (u + r) >> 16).to(tl.uint16)


@triton.jit
def _count(arr, n, x, top, STRICT: tl.constexpr):
    """How many of the sorted arr[0..n) are < x (STRICT) or <= x, per element of x: a
    branch-free binary search in power-of-two steps from ``top`` (a power of two <= n)."""
    pos = tl.zeros(x.shape, tl.int32)
    step = top
    while step > 0:
        cand = pos + step
        ok = cand <= n
        a = tl.load(arr + cand - 1, mask=ok, other=0.0)
        if STRICT:
            go = ok & (a < x)
        else:
            go = ok & (a <= x)
        pos = tl.where(go, cand, pos)
        step = step // 2
    return pos


@triton.jit
def _code_of(m_addr, offs, mask, four):
    """Old codes of segment elements ``offs`` (int32)."""
    codes = m_addr.to(tl.pointer_type(tl.uint8))
    if four:
        b = tl.load(codes + (offs >> 1), mask=mask, other=0).to(tl.int32)
        c = (b >> ((offs & 1) * 4).to(tl.int32)) & 15
    else:
        c = tl.load(codes + offs, mask=mask, other=0).to(tl.int32)
    return c


# ----------------------------------------------------------------------------------- B = 1


@_kernel
def dense_kernel(ints, floats, meta_at, hyp_at, prefix_at, n_rows, TILE: tl.constexpr):
    """reference.dense_update: a program per tile of TILE elements of a B = 1 segment."""
    s, m, local = _program(ints, meta_at, prefix_at, n_rows, M_COLS)
    h = floats + hyp_at + s * H_COLS
    start = tl.load(m + M_START)
    numel = tl.load(m + M_NUMEL)
    pt = tl.load(m + M_P_DTYPE)
    gt = tl.load(m + M_G_DTYPE)
    key = tl.load(m + M_STEP_KEY).to(tl.uint32)
    p_addr = tl.load(m + M_P)
    ea = tl.load(m + M_EXP_AVG).to(tl.pointer_type(tl.uint16))
    es = tl.load(m + M_EXP_AVG_SQ).to(tl.pointer_type(tl.uint16))
    offs = local * TILE + tl.arange(0, TILE)
    mask = offs < numel
    g = _ld(tl.load(m + M_G), offs, mask, gt)
    p = _ld(p_addr, offs, mask, pt)
    m0 = (tl.load(ea + offs, mask=mask, other=0).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    v0 = (tl.load(es + offs, mask=mask, other=0).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    pi = p * tl.load(h + H_DECAY)
    mi = _lerp(m0, g, tl.load(h + H_W))
    vi = v0 * tl.load(h + H_BETA2) + (tl.load(h + H_A2) * g) * g
    r = _hash(start + offs, key)
    tl.store(ea + offs, _bf16_stochastic(mi, r & 0xFFFF), mask=mask)
    tl.store(es + offs, _bf16_stochastic(vi, r >> 16), mask=mask)
    denom = tl.math.div_rn(tl.math.sqrt_rn(vi), tl.load(h + H_BC2)) + tl.load(h + H_EPS)
    x = pi + tl.load(h + H_NEG_STEP) * tl.math.div_rn(mi, denom)
    _st_param(p_addr, offs, mask, x, pt, start + offs, _param_key(key))


# ----------------------------------------------------------------------- blocked, columns


@triton.jit
def _new_block(
    m, h, v_addr, j, jmask, total, total_m2, total_f2, count, scr_amax, scr_den, scr_keep, scr, amax
):
    """Block j's new v into the state; its new absmax, its shared denominator before eps
    (sqrt(v) / bc2, or sqrt(v) where the segment is factored, the element's factor completing
    it) and its keep (reference.block_keep: 1 - mean(m_hat^2) / mean(s^2), clamped to [0, 1],
    0 where mean(s^2) is 0) into the scratch. ``total``, ``total_m2``, ``total_f2``: the
    block's fp64 sums of g^2, (m / bc1)^2 and (factored) f^2 over its ``count`` elements."""
    v_ptr = v_addr.to(tl.pointer_type(tl.float32))
    n = count.to(tl.float64)
    mean = (total / n).to(tl.float32)
    mean_m2 = (total_m2 / n).to(tl.float32)
    vj = tl.load(v_ptr + j, mask=jmask, other=0.0) * tl.load(h + H_BETA2) + tl.load(h + H_A2) * mean
    tl.store(v_ptr + j, vj, mask=jmask)
    sv = tl.math.sqrt_rn(vj)
    if tl.load(m + M_FACTOR) != 0:
        den = sv
        ss = (sv * sv) * (total_f2 / n).to(tl.float32)
    else:
        den = tl.math.div_rn(sv, tl.load(h + H_BC2))
        ss = den * den
    pos = ss > 0.0
    ratio = tl.math.div_rn(mean_m2, tl.where(pos, ss, 1.0))
    keep = tl.where(pos, tl.maximum(1.0 - ratio, 0.0), 0.0)
    tl.store(scr_den + scr + j, den, mask=jmask)
    tl.store(scr_keep + scr + j, keep, mask=jmask)
    tl.store(scr_amax + scr + j, amax, mask=jmask)


@_kernel
def block_reduce_kernel(
    ints,
    floats,
    meta_at,
    hyp_at,
    aux_at,
    prefix_at,
    n_rows,
    scr_amax,
    scr_den,
    scr_keep,
    R: tl.constexpr,
    W: tl.constexpr,
):
    """Contiguous blocks, pass 1 of 3: a program per R consecutive blocks of a segment, a
    (R, W) tile looping over the block in steps of W: sums (fp64) of g^2, of (m_new / bc1)^2
    and, factored, of f^2 (f at the element's position in its block), and max |m_new|, m_new =
    lerp(levels[code] * absmax, g, 1 - b1); the new v into the state, the new absmax, the
    denominator and keep into the scratch (the old absmax is needed until every code is
    rewritten)."""
    m, h, aux, local = _update_program(ints, floats, meta_at, hyp_at, aux_at, prefix_at, n_rows)
    start = tl.load(m + M_START)
    numel = tl.load(m + M_NUMEL)
    block = tl.load(m + M_BLOCK)
    nb = tl.load(aux + A_NB)
    gt = tl.load(m + M_G_DTYPE)
    four = tl.load(m + M_BITS) == 4
    g_addr = tl.load(m + M_G)
    codes = tl.load(m + M_CODES)
    levels = tl.load(m + M_LEVELS).to(tl.pointer_type(tl.float32))
    absmax = tl.load(m + M_ABSMAX).to(tl.pointer_type(tl.float32))
    fac = tl.load(m + M_FACTOR)
    w = tl.load(h + H_W)
    bc1 = tl.load(h + H_BC1)
    j = local * R + tl.arange(0, R)
    jmask = j < nb
    b0 = start // block
    lo = tl.maximum((b0 + j) * block, start) - start
    hi = tl.minimum((b0 + j + 1) * block, start + numel) - start
    hi = tl.where(jmask, hi, lo)
    first = (b0 + j) * block - start  # the block's position 0 as a segment index
    old = tl.load(absmax + j, mask=jmask, other=0.0)
    acc = tl.zeros((R, W), tl.float64)
    acc_m2 = tl.zeros((R, W), tl.float64)
    acc_f2 = tl.zeros((R, W), tl.float64)
    amax = tl.zeros((R, W), tl.float32)
    for t in range(0, _bound(tl.max(hi - lo, axis=0)), W):
        i = lo[:, None] + t + tl.arange(0, W)[None, :]
        mask = i < hi[:, None]
        g = _ld(g_addr, i, mask, gt)
        x = g.to(tl.float64)
        acc += x * x
        level = tl.load(levels + _code_of(codes, i, mask, four), mask=mask, other=0.0)
        mi = _lerp(level * old[:, None], g, w)
        amax = tl.maximum(amax, tl.where(mask, tl.abs(mi), 0.0))
        q = tl.where(mask, tl.math.div_rn(mi, bc1), 0.0).to(tl.float64)
        acc_m2 += q * q
        if fac != 0:
            fp = fac.to(tl.pointer_type(tl.float32)) + (i - first[:, None])
            f = tl.load(fp, mask=mask, other=0.0).to(tl.float64)
            acc_f2 += f * f
    _new_block(
        m,
        h,
        tl.load(m + M_V),
        j,
        jmask,
        tl.sum(acc, axis=1),
        tl.sum(acc_m2, axis=1),
        tl.sum(acc_f2, axis=1),
        tl.maximum(hi - lo, 1),
        scr_amax,
        scr_den,
        scr_keep,
        tl.load(aux + A_SCR),
        tl.max(amax, axis=1),
    )


@_kernel
def col_reduce_kernel(
    ints,
    floats,
    meta_at,
    hyp_at,
    aux_at,
    prefix_at,
    n_rows,
    part_sum,
    part_max,
    part_m2,
    part_f2,
    RB: tl.constexpr,
    CB: tl.constexpr,
):
    """Column blocks (B = -P: segment element e in block e mod P), pass 1 of 4: a program per
    CB columns and chunk of rows of the segment's (rows, P) view, (RB, CB) tiles down the
    chunk: partial sums (fp64) of g^2, of (m_new / bc1)^2 and, factored, of f^2 (f of the
    element's tensor row), and maxima of |m_new| per column."""
    m, h, aux, local = _update_program(ints, floats, meta_at, hyp_at, aux_at, prefix_at, n_rows)
    start = tl.load(m + M_START)
    numel = tl.load(m + M_NUMEL)
    period = -tl.load(m + M_BLOCK)
    nb = tl.load(aux + A_NB)
    per = tl.load(aux + A_PER)
    gt = tl.load(m + M_G_DTYPE)
    four = tl.load(m + M_BITS) == 4
    g_addr = tl.load(m + M_G)
    codes = tl.load(m + M_CODES)
    levels = tl.load(m + M_LEVELS).to(tl.pointer_type(tl.float32))
    absmax = tl.load(m + M_ABSMAX).to(tl.pointer_type(tl.float32))
    fac = tl.load(m + M_FACTOR)
    w = tl.load(h + H_W)
    bc1 = tl.load(h + H_BC1)
    tiles = (nb + CB - 1) // CB
    chunk = local // tiles
    k = (local % tiles) * CB + tl.arange(0, CB)
    kmask = k < nb
    # tensor row of view row r, column k: start // P + r, plus one where start % P + k >= P
    up = tl.where(start % period + k >= period, 1, 0) + start // period
    old = tl.load(absmax + k, mask=kmask, other=0.0)
    r0 = chunk * per
    acc = tl.zeros((RB, CB), tl.float64)
    acc_m2 = tl.zeros((RB, CB), tl.float64)
    acc_f2 = tl.zeros((RB, CB), tl.float64)
    amax = tl.zeros((RB, CB), tl.float32)
    for r in range(_bound(r0), _bound(r0 + per), RB):
        rows = r + tl.arange(0, RB)
        e = rows[:, None] * period + k[None, :]
        mask = (rows[:, None] < r0 + per) & kmask[None, :] & (e < numel)
        g = _ld(g_addr, e, mask, gt)
        x = g.to(tl.float64)
        acc += x * x
        level = tl.load(levels + _code_of(codes, e, mask, four), mask=mask, other=0.0)
        mi = _lerp(level * old[None, :], g, w)
        amax = tl.maximum(amax, tl.where(mask, tl.abs(mi), 0.0))
        q = tl.where(mask, tl.math.div_rn(mi, bc1), 0.0).to(tl.float64)
        acc_m2 += q * q
        if fac != 0:
            fp = fac.to(tl.pointer_type(tl.float32)) + (rows[:, None] + up[None, :])
            f = tl.load(fp, mask=mask, other=0.0).to(tl.float64)
            acc_f2 += f * f
    at = tl.load(aux + A_PART) + chunk * nb + k
    tl.store(part_sum + at, tl.sum(acc, axis=0), mask=kmask)
    tl.store(part_max + at, tl.max(amax, axis=0), mask=kmask)
    tl.store(part_m2 + at, tl.sum(acc_m2, axis=0), mask=kmask)
    tl.store(part_f2 + at, tl.sum(acc_f2, axis=0), mask=kmask)


@_kernel
def col_finish_kernel(
    ints,
    floats,
    meta_at,
    hyp_at,
    aux_at,
    prefix_at,
    n_rows,
    part_sum,
    part_max,
    part_m2,
    part_f2,
    scr_amax,
    scr_den,
    scr_keep,
    CB: tl.constexpr,
):
    """Column blocks, pass 2 of 4: a program per CB columns adds their partials in chunk order
    (so the sums do not depend on scheduling); the new v into the state, the new absmax, the
    denominator and keep into the scratch."""
    m, h, aux, local = _update_program(ints, floats, meta_at, hyp_at, aux_at, prefix_at, n_rows)
    numel = tl.load(m + M_NUMEL)
    period = -tl.load(m + M_BLOCK)
    nb = tl.load(aux + A_NB)
    chunks = tl.load(aux + A_CHUNKS)
    k = local * CB + tl.arange(0, CB)
    kmask = k < nb
    at = tl.load(aux + A_PART) + k
    total = tl.zeros((CB,), tl.float64)
    total_m2 = tl.zeros((CB,), tl.float64)
    total_f2 = tl.zeros((CB,), tl.float64)
    amax = tl.zeros((CB,), tl.float32)
    for q in range(0, _bound(chunks)):
        total += tl.load(part_sum + at + q * nb, mask=kmask, other=0.0)
        total_m2 += tl.load(part_m2 + at + q * nb, mask=kmask, other=0.0)
        total_f2 += tl.load(part_f2 + at + q * nb, mask=kmask, other=0.0)
        amax = tl.maximum(amax, tl.load(part_max + at + q * nb, mask=kmask, other=0.0))
    count = tl.maximum(numel // period + tl.where(k < numel % period, 1, 0), 1)
    _new_block(
        m,
        h,
        tl.load(m + M_V),
        k,
        kmask,
        total,
        total_m2,
        total_f2,
        count,
        scr_amax,
        scr_den,
        scr_keep,
        tl.load(aux + A_SCR),
        amax,
    )


@triton.jit
def _element(
    m,
    h,
    e,
    t,
    mask,
    column,
    w,
    sq,
    sr,
    br,
    code,
    absmax,
    levels,
    mids,
    scr_amax,
    scr_den,
    scr_keep,
    scr,
    start,
    four,
    key,
):
    """One element's step (reference.block_update / column_update) for elements ``e`` of the
    segment (int64), ``t`` = e - the tile's first (int32): m from its old code, the parameter
    moved and stored, the new code (nearest at 8 bits, ties to the lower level; stochastic at
    4, u from the element's tensor index). Block and factor entry without an int64 division
    per element: ``w`` = |B|, the tile's first element's tensor index is sq * w + sr, its
    segment index br mod w."""
    if column:  # block e mod P, factor entry of tensor row (start + e) div P
        j = ((br + t) % w).to(tl.int64)
        fi = sq + ((sr + t) // w).to(tl.int64)
    else:  # block (start + e) div B - start div B, factor entry (start + e) mod B
        j = sq - start // w + ((sr + t) // w).to(tl.int64)
        fi = ((sr + t) % w).to(tl.int64)
    level = tl.load(levels + code, mask=mask, other=0.0)
    old = tl.load(absmax + j, mask=mask, other=0.0)
    g = _ld(tl.load(m + M_G), e, mask, tl.load(m + M_G_DTYPE))
    mi = _lerp(level * old, g, tl.load(h + H_W))
    p_addr = tl.load(m + M_P)
    pt = tl.load(m + M_P_DTYPE)
    pi = _ld(p_addr, e, mask, pt) * tl.load(h + H_DECAY)
    s = tl.load(scr_den + scr + j, mask=mask, other=1.0)
    fac = tl.load(m + M_FACTOR)
    if fac != 0:
        s = s * tl.load(fac.to(tl.pointer_type(tl.float32)) + fi, mask=mask, other=1.0)
    # where g opposes m, at least sqrt(s^2 keep + m_hat^2); everywhere at least |g| g_floor
    # (reference.denominator)
    keep = tl.load(scr_keep + scr + j, mask=mask, other=0.0)
    mh = tl.math.div_rn(mi, tl.load(h + H_BC1))
    split = tl.math.sqrt_rn(s * s * keep + mh * mh)
    d = tl.where(g * mi < 0.0, tl.maximum(s, split), s)
    d = tl.maximum(d, tl.abs(g) * tl.load(h + H_G_FLOOR)) + tl.load(h + H_EPS)
    x = pi + tl.load(h + H_NEG_STEP) * tl.math.div_rn(mi, d)
    _st_param(p_addr, e, mask, x, pt, start + e, _param_key(key))
    amax = tl.load(scr_amax + scr + j, mask=mask, other=1.0)
    x = tl.math.div_rn(mi, tl.where(amax > 0.0, amax, 1.0))
    nlev = tl.load(m + M_N_LEVELS).to(tl.int32)
    if four:
        u = (_hash(start + e, key) >> 8).to(tl.float32) * (1.0 / 16777216.0)
        k = _count(levels + 1, nlev - 2, x, nlev // 2, False)
        low = tl.load(levels + k, mask=mask, other=0.0)
        up = u * (tl.load(levels + k + 1, mask=mask, other=0.0) - low) < x - low
        out = k + up.to(tl.int32)
    else:
        out = _count(mids, nlev - 1, x, nlev // 2, True)
    return out


@_kernel
def apply_kernel(
    ints,
    floats,
    meta_at,
    hyp_at,
    aux_at,
    prefix_at,
    n_rows,
    scr_amax,
    scr_den,
    scr_keep,
    TILE: tl.constexpr,
):
    """Blocked and column segments, the element pass: a program per TILE elements of a
    segment (whole bytes at 4 bits, as every segment's codes start on a byte boundary, so no
    two programs write one byte), even and odd elements side by side: m recomputed with the
    same fp32 operations as the reduction's, the parameter moved, the codes rewritten against
    the new absmax. The pad nibble of an odd-length segment keeps its value."""
    m, h, aux, local = _update_program(ints, floats, meta_at, hyp_at, aux_at, prefix_at, n_rows)
    start = tl.load(m + M_START)
    numel = tl.load(m + M_NUMEL)
    block = tl.load(m + M_BLOCK)
    column = block < 0
    w = tl.abs(block)
    base = local * TILE
    sq = (start + base) // w
    sr = ((start + base) % w).to(tl.int32)
    br = (base % w).to(tl.int32)
    w = w.to(tl.int32)  # |B| < 2^30 (step_plan), so sr + t and br + t fit
    four = tl.load(m + M_BITS) == 4
    key = tl.load(m + M_STEP_KEY).to(tl.uint32)
    codes = tl.load(m + M_CODES).to(tl.pointer_type(tl.uint8))
    levels = tl.load(m + M_LEVELS).to(tl.pointer_type(tl.float32))
    mids = tl.load(m + M_MIDS).to(tl.pointer_type(tl.float32))
    absmax = tl.load(m + M_ABSMAX).to(tl.pointer_type(tl.float32))
    scr = tl.load(aux + A_SCR)
    t0 = 2 * tl.arange(0, TILE // 2)
    t1 = t0 + 1
    e0 = base + t0
    e1 = base + t1
    m0 = e0 < numel
    m1 = e1 < numel
    if four:
        byte = tl.load(codes + (e0 >> 1), mask=m0, other=0).to(tl.int32)
        c0 = byte & 15
        c1 = byte >> 4
    else:
        c0 = tl.load(codes + e0, mask=m0, other=0).to(tl.int32)
        c1 = tl.load(codes + e1, mask=m1, other=0).to(tl.int32)
    k0 = _element(
        m,
        h,
        e0,
        t0,
        m0,
        column,
        w,
        sq,
        sr,
        br,
        c0,
        absmax,
        levels,
        mids,
        scr_amax,
        scr_den,
        scr_keep,
        scr,
        start,
        four,
        key,
    )
    k1 = _element(
        m,
        h,
        e1,
        t1,
        m1,
        column,
        w,
        sq,
        sr,
        br,
        c1,
        absmax,
        levels,
        mids,
        scr_amax,
        scr_den,
        scr_keep,
        scr,
        start,
        four,
        key,
    )
    if four:
        k1 = tl.where(m1, k1, c1)
        tl.store(codes + (e0 >> 1), (k0 | (k1 << 4)).to(tl.uint8), mask=m0)
    else:
        tl.store(codes + e0, k0.to(tl.uint8), mask=m0)
        tl.store(codes + e1, k1.to(tl.uint8), mask=m1)


@_kernel
def commit_kernel(ints, meta_at, aux_at, prefix_at, n_rows, scr_amax, TILE: tl.constexpr):
    """Blocked and column segments, last pass: the new absmax over the old, once every code
    has been read with the old."""
    s, m, local = _program(ints, meta_at, prefix_at, n_rows, M_COLS)
    aux = ints + aux_at + s * A_COLS
    j = local * TILE + tl.arange(0, TILE)
    mask = j < tl.load(aux + A_NB)
    amax = tl.load(scr_amax + tl.load(aux + A_SCR) + j, mask=mask, other=0.0)
    tl.store(tl.load(m + M_ABSMAX).to(tl.pointer_type(tl.float32)) + j, amax, mask=mask)


# ------------------------------------------------------------------------- the factor pass


@_kernel
def cross_rows_kernel(ints, meta_at, prefix_at, n_rows, part, RB: tl.constexpr, CB: tl.constexpr):
    """reference.cross_sums, contiguous blocks of B: position j sums g^2 over the piece's
    elements at j of their tensor rows. A program per CB positions and chunk of the piece's
    tensor rows, (RB, CB) tiles down the chunk, a partial sum per position and chunk."""
    _, m, local = _program(ints, meta_at, prefix_at, n_rows, X_COLS)
    width = tl.load(m + X_BLOCK)
    start = tl.load(m + X_START)
    numel = tl.load(m + X_NUMEL)
    chunks = tl.load(m + X_CHUNKS)
    gt = tl.load(m + X_G_DTYPE)
    g_addr = tl.load(m + X_G)
    tiles = (width + CB - 1) // CB
    chunk = local // tiles
    j = (local % tiles) * CB + tl.arange(0, CB)
    first = start // width
    rows = (start + numel - 1) // width - first + 1
    per = (rows + chunks - 1) // chunks
    r0 = first + chunk * per
    r1 = tl.minimum(r0 + per, first + rows)
    acc = tl.zeros((RB, CB), tl.float64)
    for r in range(_bound(r0), _bound(r1), RB):
        rr = r + tl.arange(0, RB)
        i = rr[:, None] * width + j[None, :] - start
        mask = (rr[:, None] < r1) & (j[None, :] < width) & (i >= 0) & (i < numel)
        x = _ld(g_addr, i, mask, gt).to(tl.float64)
        acc += x * x
    tl.store(part + tl.load(m + X_PART) + chunk * width + j, tl.sum(acc, axis=0), mask=j < width)


@_kernel
def cross_finish_kernel(ints, meta_at, prefix_at, n_rows, part, CB: tl.constexpr):
    """Contiguous blocks: a program per CB positions adds their partials in chunk order; the
    counts are the piece's elements at each position."""
    _, m, local = _program(ints, meta_at, prefix_at, n_rows, X_COLS)
    width = tl.load(m + X_BLOCK)
    start = tl.load(m + X_START)
    end = start + tl.load(m + X_NUMEL)
    chunks = tl.load(m + X_CHUNKS)
    j = local * CB + tl.arange(0, CB)
    mask = j < width
    at = tl.load(m + X_PART) + j
    total = tl.zeros((CB,), tl.float64)
    for c in range(0, _bound(chunks)):
        total += tl.load(part + at + c * width, mask=mask, other=0.0)
    e0 = (start // width) * width + j  # the piece's first element at position j
    e0 = tl.where(e0 < start, e0 + width, e0)
    count = tl.where(e0 < end, 1 + (end - 1 - e0) // width, 0).to(tl.float64)
    tl.store(tl.load(m + X_SUMS).to(tl.pointer_type(tl.float64)) + j, total, mask=mask)
    tl.store(tl.load(m + X_COUNTS).to(tl.pointer_type(tl.float64)) + j, count, mask=mask)


@_kernel
def cross_cols_kernel(ints, meta_at, prefix_at, n_rows, GR: tl.constexpr, CW: tl.constexpr):
    """reference.cross_sums, column blocks of P: tensor row r sums g^2 over the piece's
    elements in it. A program per GR tensor rows, (GR, CW) tiles along them."""
    _, m, local = _program(ints, meta_at, prefix_at, n_rows, X_COLS)
    period = -tl.load(m + X_BLOCK)
    start = tl.load(m + X_START)
    end = start + tl.load(m + X_NUMEL)
    gt = tl.load(m + X_G_DTYPE)
    g_addr = tl.load(m + X_G)
    last = (end - 1) // period
    r = start // period + local * GR + tl.arange(0, GR)
    rmask = r <= last
    acc = tl.zeros((GR, CW), tl.float64)
    for c in range(0, _bound(period), CW):
        col = c + tl.arange(0, CW)
        e = r[:, None] * period + col[None, :]
        mask = rmask[:, None] & (col[None, :] < period) & (e >= start) & (e < end)
        x = _ld(g_addr, e - start, mask, gt).to(tl.float64)
        acc += x * x
    lo = tl.maximum(r * period, start)
    hi = tl.minimum((r + 1) * period, end)
    tl.store(
        tl.load(m + X_SUMS).to(tl.pointer_type(tl.float64)) + r, tl.sum(acc, axis=1), mask=rmask
    )
    tl.store(
        tl.load(m + X_COUNTS).to(tl.pointer_type(tl.float64)) + r,
        (hi - lo).to(tl.float64),
        mask=rmask,
    )


@triton.jit
def _factor_out(out, v, i, mask, mean, h):
    """sqrt(max(v / mean, floor)) / sqrt(1 - b2^t)"""
    c = tl.maximum(tl.math.div_rn(v, mean), tl.load(h + XH_FLOOR))
    tl.store(out + i, tl.math.div_rn(tl.math.sqrt_rn(c), tl.load(h + XH_BC2)), mask=mask)


@_kernel
def cross_factor_kernel(ints, floats, meta_at, hyp_at, TILE: tl.constexpr):
    """reference.cross_factor of a tensor held whole (rows whose out is set), a program per
    row: the factor from v_cross as the steps before left it (its mean summed in fp64), the
    mean g^2 per entry folded into v_cross, and where v_cross was all zero the factor from
    the fold. ``floats``: a ``CrossHyp`` row per row."""
    s = tl.program_id(0)
    m = ints + meta_at + s * X_COLS
    h = floats + hyp_at + s * XH_COLS
    out_addr = tl.load(m + X_OUT)
    if out_addr != 0:
        out = out_addr.to(tl.pointer_type(tl.float32))
        v = tl.load(m + X_V_CROSS).to(tl.pointer_type(tl.float32))
        sums = tl.load(m + X_SUMS).to(tl.pointer_type(tl.float64))
        counts = tl.load(m + X_COUNTS).to(tl.pointer_type(tl.float64))
        n = tl.load(m + X_LENGTH)
        b2 = tl.load(h + XH_BETA2)
        a2 = tl.load(h + XH_A2)
        acc = tl.zeros((TILE,), tl.float64)
        for t in range(0, _bound(n), TILE):
            i = t + tl.arange(0, TILE)
            acc += tl.load(v + i, mask=i < n, other=0.0).to(tl.float64)
        before = (tl.sum(acc, axis=0) / n.to(tl.float64)).to(tl.float32)
        lagged = before > 0.0
        folded = tl.zeros((TILE,), tl.float64)
        for t in range(0, _bound(n), TILE):
            i = t + tl.arange(0, TILE)
            mask = i < n
            vi = tl.load(v + i, mask=mask, other=0.0)
            if lagged:
                _factor_out(out, vi, i, mask, before, h)
            cnt = tl.load(counts + i, mask=mask, other=0.0)
            sm = tl.load(sums + i, mask=mask, other=0.0)
            mean = tl.where(cnt > 0.0, sm / tl.maximum(cnt, 1.0), 0.0)
            nv = vi * b2 + a2 * mean.to(tl.float32)
            tl.store(v + i, nv, mask=mask)
            folded += tl.where(mask, nv, 0.0).to(tl.float64)
        if not lagged:
            total = (tl.sum(folded, axis=0) / n.to(tl.float64)).to(tl.float32)
            total = tl.where(total > 0.0, total, 1.0)
            for t in range(0, _bound(n), TILE):
                i = t + tl.arange(0, TILE)
                mask = i < n
                _factor_out(out, tl.load(v + i, mask=mask, other=0.0), i, mask, total, h)


# ------------------------------------------------------------------ codebook histogram


@triton.jit
def histogram_kernel(ints, floats, TILE: tl.constexpr):
    """A program per block of one segment: g / absmax(block) (the whole block's absmax from
    ``floats`` for a cut first / last block, where given) binned as codebook.histogram,
    floor((x + 1) * bins / 2) in fp64, into int64 counts by integer atomics (exact, so the
    order does not matter). ``ints``: a ``Hist`` row; ``floats``: a ``HistAmax`` row."""
    j = tl.program_id(0)
    g_addr = tl.load(ints + HI_G)
    gt = tl.load(ints + HI_G_DTYPE)
    start = tl.load(ints + HI_START)
    numel = tl.load(ints + HI_NUMEL)
    block = tl.load(ints + HI_BLOCK)
    nb = tl.load(ints + HI_BLOCKS)
    bins = tl.load(ints + HI_BINS)
    counts = tl.load(ints + HI_COUNTS).to(tl.pointer_type(tl.int64))
    b0 = start // block
    lo = tl.maximum((b0 + j) * block, start) - start
    hi = tl.minimum((b0 + j + 1) * block, start + numel) - start
    amax = tl.zeros((TILE,), tl.float32)
    for t in range(_bound(lo), _bound(hi), TILE):
        i = t + tl.arange(0, TILE)
        amax = tl.maximum(amax, tl.abs(_ld(g_addr, i, i < hi, gt)))
    a = tl.max(amax, axis=0)
    cut = (hi - lo) < block
    head = tl.load(floats + HA_HEAD)
    tail = tl.load(floats + HA_TAIL)
    use_head = cut & (j == 0) & (head >= 0.0)
    use_tail = cut & (j == nb - 1) & (tail >= 0.0) & (use_head == 0)
    a = tl.where(use_head, head, tl.where(use_tail, tail, a))
    if a > 0.0:
        half = bins.to(tl.float64) / 2.0
        for t in range(_bound(lo), _bound(hi), TILE):
            i = t + tl.arange(0, TILE)
            mask = i < hi
            x = tl.math.div_rn(_ld(g_addr, i, mask, gt), a).to(tl.float64)
            b = tl.floor((x + 1.0) * half).to(tl.int64)
            b = tl.minimum(tl.maximum(b, 0), bins - 1)
            tl.atomic_add(counts + b, tl.full((TILE,), 1, tl.int64), mask=mask, sem="relaxed")


# -------------------------------------------------------------------------- for the tests


@triton.jit
def hash_kernel(out, args, n, TILE: tl.constexpr):
    """codes.hash_bits(step, first + i) for i < n into int64 ``out``; ``args`` (int64): first,
    codes.step_key(step)."""
    offs = tl.program_id(0) * TILE + tl.arange(0, TILE)
    h = _hash(tl.load(args) + offs, tl.load(args + 1).to(tl.uint32))
    tl.store(out + offs, h.to(tl.int64), mask=offs < n)
