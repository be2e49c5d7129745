"""First-moment codes: nearest and stochastic rounding to a codebook, and the packed 4-bit layout.

Codes of one segment start on a byte boundary. At 4 bits, element 2i of a segment is the low
nibble of byte i and element 2i+1 the high nibble, so a segment of n elements takes ceil(n/2)
bytes and a state saved at 4 bits stays at 4 bits. Nearest rounding (8 bits) sends ties between
two levels to the lower one; stochastic rounding (4 bits) draws u from a hash of the step and
the element's index. Native kernels do the same, to match the reference bit for bit.
"""

from __future__ import annotations

import functools
import weakref

import torch


def code_bytes(numel: int, bits: int) -> int:
    return numel if bits == 8 else (numel + 1) // 2


def midpoints(levels: torch.Tensor) -> torch.Tensor:
    return (levels[1:] + levels[:-1]) * 0.5


def quantize(x: torch.Tensor, mids: torch.Tensor) -> torch.Tensor:
    """Index of the nearest level for values already divided by their block absmax."""
    return torch.bucketize(x, mids).to(torch.uint8)


_M32 = 0xFFFFFFFF


def _mul32(x, c: int):
    """(x * c) mod 2^32 for x < 2^32, an int64 tensor or a Python int, in two 16-bit halves so
    an int64 never overflows."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def _mix32(x):
    """The 32-bit "lowbias32" finaliser of x < 2^32: the counter hash's one definition on the
    Python side, for int64 tensors and plain ints alike (the kernels' copies are tested
    against it)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def step_key(step: int) -> int:
    """mix(step mod 2^32): the per-step half of ``uniforms``' hash, which kernels take as is.
    Plain ints (a row of every segment table, every step), no tensors."""
    return _mix32(step & _M32)


def uniforms(step: int, index: torch.Tensor) -> torch.Tensor:
    """u in [0, 1) (fp32, multiples of 2^-24) for each element index at this step: a counter
    hash, not a generator, so every backend, rank layout and resumed run draws the same u for
    the same (step, element of its tensor). The native kernels compute the same function:
    h = mix(index ^ mix(step)), mix the 32-bit "lowbias32" finaliser, u = (h >> 8) * 2^-24."""
    h = hash_bits(step, index)
    return (h >> 8).to(torch.float32) * (2.0**-24)


def hash_bits(step: int, index: torch.Tensor) -> torch.Tensor:
    """h = mix(index ^ mix(step)), 32 bits in int64: the counter hash ``uniforms`` and
    ``round_bf16`` draw from."""
    return _mix32((index.to(torch.int64) & _M32) ^ step_key(step))


PARAM_STREAM = 0x2545F491
"""Mixed into the step key for the parameter write's draws (``param_key``): a stream of its own,
so that rounding a bf16 parameter up never correlates with rounding its m, v or code up."""


def param_key(step: int) -> int:
    """mix(step_key(step) ^ PARAM_STREAM): the key of ``param_bits``; kernels derive it from the
    step key they are given, in the same 32-bit arithmetic."""
    return _mix32(step_key(step) ^ PARAM_STREAM)


def param_bits(step: int, index: torch.Tensor) -> torch.Tensor:
    """mix(index ^ param_key(step)) & 0xFFFF (int64): the r of ``round_bf16`` for the write of a
    bf16 parameter with ``bf16_stochastic_round``, per element index in its tensor."""
    return _mix32((index.to(torch.int64) & _M32) ^ param_key(step)) & 0xFFFF


def write_param(p: torch.Tensor, x: torch.Tensor, stochastic: bool, step: int, first: int) -> None:
    """Store fp32 ``x`` into ``p`` (same shape; its elements those at ``first``, ``first + 1``,
    ... of their tensor): rounded stochastically (``round_bf16`` with ``param_bits``) where
    ``stochastic`` and ``p`` is bf16, else as ``copy_`` rounds (fp32 and fp16 parameters are
    written as without the option, as torchao's ``bf16_stochastic_round`` does)."""
    if stochastic and p.dtype == torch.bfloat16:
        index = torch.arange(first, first + x.numel(), device=x.device).view(x.shape)
        p.copy_(round_bf16(x, param_bits(step, index)))
    elif x is not p:
        p.copy_(x)


def round_bf16(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` stochastically rounded to bf16 with ``r`` (int64 in [0, 2^16)): the magnitude
    rounds up with probability (its low 16 bits) / 2^16, so the rounding is unbiased and an EMA
    stored in bf16 keeps moving by steps far below its spacing (nearest rounding would freeze a
    second moment whose change per step, (1 - b2) (g^2 - v), is under half a spacing, 2^-9 to
    2^-8 of v: with b2 = 0.999 whenever |g^2 - v| < 2 v or so, that is nearly always). NaN stays
    NaN (quiet)."""
    bits = x.float().contiguous().view(torch.int32).to(torch.int64) & _M32
    out = (bits + r) >> 16
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    out = torch.where(nan, (bits >> 16) | 0x40, out)
    return (out - ((out & 0x8000) << 1)).to(torch.int16).view(torch.bfloat16)


def stochastic_quantize(x: torch.Tensor, levels: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Codes for x in [-1, 1] rounded to one of its two neighbouring levels, up with probability
    (x - lower) / (upper - lower), decided by ``u``: unbiased, so a small first moment decays
    as it should instead of sitting in nearest rounding's dead zone (see ``reference``). fp32
    arithmetic in this order: k = #interior levels <= x, d = L[k+1] - L[k], up iff u * d <
    x - L[k]."""
    k = torch.bucketize(x, levels[1:-1].contiguous(), right=True)
    low = levels[k]
    up = u * (levels[k + 1] - low) < x - low
    return (k + up).to(torch.uint8)


def pack4(codes: torch.Tensor) -> torch.Tensor:
    n = codes.numel()
    if n % 2:
        codes = torch.cat([codes, codes.new_zeros(1)])
    pairs = codes.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def unpack4(packed: torch.Tensor, numel: int) -> torch.Tensor:
    out = torch.stack([packed & 0xF, packed >> 4], dim=1).view(-1)
    return out[:numel]


def read_codes(codes: torch.Tensor, a: int, b: int, bits: int) -> torch.Tensor:
    """Codes of elements [a, b) of one segment whose code bytes are ``codes``."""
    if bits == 8:
        return codes[a:b]
    lo = a // 2
    return unpack4(codes[lo : (b + 1) // 2], 2 * ((b + 1) // 2 - lo))[a - 2 * lo : b - 2 * lo]


def write_codes(codes: torch.Tensor, a: int, b: int, new: torch.Tensor, bits: int) -> None:
    """Store codes of elements [a, b); at 4 bits the neighbours sharing an edge byte are kept."""
    if bits == 8:
        codes[a:b] = new
        return
    lo, hi = a // 2, (b + 1) // 2
    if a % 2 == 0 and b % 2 == 0:
        codes[lo:hi] = pack4(new)
        return
    merged = unpack4(codes[lo:hi], 2 * (hi - lo))
    merged[a - 2 * lo : b - 2 * lo] = new
    codes[lo:hi] = pack4(merged)


_TABLES: dict[tuple[int, int], tuple[weakref.ref, torch.Tensor]] = {}


def _forget(key: tuple[int, int], _ref: weakref.ref) -> None:
    _TABLES.pop(key, None)


def code_table(mids: torch.Tensor, cells: int) -> torch.Tensor:
    """For cell c of a uniform grid of ``cells`` over [-1, 1] (int32): the nearest level's index
    for every x in the cell when no midpoint lies within one cell width of it, else -1 - (the
    midpoints below the cell's left edge minus one width). So the numba kernel finds most codes
    with one load and walks from the start it is given for the rest; the margin covers an x that
    rounding puts into a neighbouring cell. Cached per midpoints tensor. (The C++ kernel builds
    its own grid, gefen_cpu.cpp's Levels8: in training many elements need the walk.)"""
    key = (id(mids), cells)
    hit = _TABLES.get(key)
    if hit is not None and hit[0]() is mids:
        return hit[1]
    m = mids.double().contiguous()
    width = 2.0 / cells
    left = torch.linspace(-1.0, 1.0, cells + 1, dtype=torch.float64, device=m.device)[:-1]
    below = torch.searchsorted(m, left - width)  # midpoints < the widened left edge
    upto = torch.searchsorted(m, left + 2 * width, right=True)  # <= the widened right edge
    table = torch.where(upto == below, below, -1 - below).to(torch.int32)
    _TABLES[key] = (weakref.ref(mids, functools.partial(_forget, key)), table)
    return table
