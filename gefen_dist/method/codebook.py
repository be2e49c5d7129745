"""Codebook for Gefen's quantised first moment.

The codebook is learned once, from the histogram of block-normalised first gradients, by an exact
dynamic programme (optimal 1-D weighted k-means, after Wang & Song 2011, "Ckmeans.1d.dp") rather
than by Lloyd iterations: Lloyd only reaches a local optimum that depends on its start, whereas the
DP returns the global minimum of the weighted squared quantisation error, so the codebook is
reproducible and never worse than any baseline on the histogram it was learned from.

The outer two levels are pinned to -1 and +1 because every block holds its absmax at exactly +-1;
a learned range that shrank inside [-1, 1] would clip those values, the largest in each block.

It is learned once, at the first step, because it must be identical on every rank and stable for
the life of the stored codes (re-learning would silently change the meaning of every stored
code); ranks agree by all-reducing the float64 histogram counts before the DP.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

__all__ = [
    "DEFAULT_BINS",
    "bin_centers",
    "dynamic_levels",
    "histogram",
    "learn_codebook",
    "lloyd_max",
    "quantization_error",
    "uniform_levels",
]

DEFAULT_BINS: int = 4096

_HIST_CHUNK = 1 << 24


def _check_bits(bits: int) -> int:
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an integer in [1, 8] (4 or 8 in use), got {bits!r}")
    return int(bits)


def _check_bins(bins: int) -> int:
    if isinstance(bins, bool) or not isinstance(bins, (int, np.integer)) or bins < 1:
        raise ValueError(f"bins must be a positive integer, got {bins!r}")
    return int(bins)


def _as_counts(counts: torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(counts, torch.Tensor):
        arr = counts.detach().to(device="cpu", dtype=torch.float64).numpy()
    else:
        arr = np.asarray(counts, dtype=np.float64)
    if arr.ndim != 1:
        raise ValueError(f"counts must be 1-D, got shape {tuple(arr.shape)}")
    if arr.size == 0:
        raise ValueError("counts must have at least one bin, got an empty array")
    if not np.isfinite(arr).all():
        raise ValueError("counts contain NaN or inf")
    if (arr < 0).any():
        raise ValueError(f"counts must be non-negative, got minimum {arr.min()!r}")
    return np.ascontiguousarray(arr)


def _as_levels(levels: torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(levels, torch.Tensor):
        arr = levels.detach().to(device="cpu", dtype=torch.float64).numpy()
    else:
        arr = np.asarray(levels, dtype=np.float64)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"levels must be a non-empty 1-D array, got shape {tuple(arr.shape)}")
    if not np.isfinite(arr).all():
        raise ValueError("levels contain NaN or inf")
    return np.sort(arr)


def _to_float32_levels(levels: np.ndarray) -> torch.Tensor:
    """Rounding to float32 must not merge neighbouring levels or move the pinned ends."""
    out = levels.astype(np.float32)
    out[0], out[-1] = -1.0, 1.0
    for i in range(1, out.size - 1):
        if out[i] <= out[i - 1]:
            out[i] = np.nextafter(out[i - 1], np.float32(np.inf))
    if out.size > 1 and out[-2] >= out[-1]:
        raise ValueError("too many levels to keep distinct in float32 below +1")
    return torch.from_numpy(out)


def bin_centers(bins: int) -> torch.Tensor:
    """The DP treats each bin as a point at its center; codebook and error are defined on these."""
    bins = _check_bins(bins)
    return -1.0 + (torch.arange(bins, dtype=torch.float64, device="cpu") + 0.5) * (2.0 / bins)


def histogram(
    x: torch.Tensor, bins: int = DEFAULT_BINS, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Float64 counts on x's device, so ranks can all-reduce them directly and sum exactly.

    Binning is done in float64: with a power-of-two bin count the bin edges are dyadic, so every
    float16/bfloat16/float32 value lands in the same bin on every device.
    """
    bins = _check_bins(bins)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(
            f"x must be a floating-point tensor, got {type(x).__name__}"
            + (f" of dtype {x.dtype}" if isinstance(x, torch.Tensor) else "")
        )
    if out is None:
        out = torch.zeros(bins, dtype=torch.float64, device=x.device)
    elif out.dtype != torch.float64 or out.shape != (bins,):
        raise ValueError(
            f"out must be a float64 tensor of shape ({bins},), got {out.dtype} {tuple(out.shape)}"
        )
    flat = x.detach().reshape(-1)
    if not bool(torch.isfinite(flat).all()):
        raise ValueError("histogram input contains NaN or inf")
    acc = torch.zeros(bins, dtype=torch.int64, device=x.device)
    for start in range(0, flat.numel(), _HIST_CHUNK):
        chunk = flat[start : start + _HIST_CHUNK].to(torch.float64)
        idx = torch.floor((chunk + 1.0) * (bins / 2.0)).clamp_(0, bins - 1).to(torch.int64)
        acc += torch.bincount(idx, minlength=bins)
    out += acc.to(device=out.device, dtype=torch.float64)
    return out


@numba.njit(cache=True)
def _sse(s0, s1, s2, i, j):
    if j <= i:
        return 0.0
    cw = s0[j] - s0[i]
    if cw <= 0.0:
        return 0.0
    d1 = s1[j] - s1[i]
    c = (s2[j] - s2[i]) - d1 * d1 / cw
    return c if c > 0.0 else 0.0


@numba.njit(cache=True)
def _pinned_dp(x, w, n_levels):
    """Exact optimum over runs [pinned -1 | K-2 free | pinned +1] of the points; runs may be empty.

    Each free layer is solved by divide and conquer on the argmin, which is monotone because the
    within-cluster SSE satisfies the quadrangle (Monge) inequality; ties go to the smallest split so
    monotonicity holds exactly.
    """
    n = x.size
    s0 = np.zeros(n + 1)
    s1 = np.zeros(n + 1)
    s2 = np.zeros(n + 1)
    for t in range(n):
        s0[t + 1] = s0[t] + w[t]
        s1[t + 1] = s1[t] + w[t] * x[t]
        s2[t + 1] = s2[t] + w[t] * x[t] * x[t]

    prev = np.empty(n + 1)
    for j in range(n + 1):
        prev[j] = s2[j] + 2.0 * s1[j] + s0[j]

    n_free = n_levels - 2
    arg = np.zeros((max(n_free, 1), n + 1), dtype=np.int64)
    cur = np.empty(n + 1)
    stack = np.empty((4 * (n + 2), 4), dtype=np.int64)
    for k in range(n_free):
        stack[0, 0], stack[0, 1], stack[0, 2], stack[0, 3] = 0, n, 0, n
        top = 1
        while top > 0:
            top -= 1
            jlo, jhi, ilo, ihi = stack[top, 0], stack[top, 1], stack[top, 2], stack[top, 3]
            if jlo > jhi:
                continue
            mid = (jlo + jhi) // 2
            best = np.inf
            bi = ilo
            for i in range(ilo, min(ihi, mid) + 1):
                c = prev[i] + _sse(s0, s1, s2, i, mid)
                if c < best:
                    best = c
                    bi = i
            cur[mid] = best
            arg[k, mid] = bi
            stack[top, 0], stack[top, 1], stack[top, 2], stack[top, 3] = jlo, mid - 1, ilo, bi
            top += 1
            stack[top, 0], stack[top, 1], stack[top, 2], stack[top, 3] = mid + 1, jhi, bi, ihi
            top += 1
        prev, cur = cur, prev

    best = np.inf
    split = 0
    for i in range(n + 1):
        dw = s0[n] - s0[i]
        right = (s2[n] - s2[i]) - 2.0 * (s1[n] - s1[i]) + dw
        c = prev[i] + (right if right > 0.0 else 0.0)
        if c < best:
            best = c
            split = i

    levels = np.full(n_levels, np.nan)
    levels[0] = -1.0
    levels[n_levels - 1] = 1.0
    j = split
    for k in range(n_free - 1, -1, -1):
        i = arg[k, j]
        if j > i and s0[j] - s0[i] > 0.0:
            levels[k + 1] = (s1[j] - s1[i]) / (s0[j] - s0[i])
        j = i
    return levels, best


def _fill_empty(levels: np.ndarray) -> np.ndarray:
    """Unused levels go into the widest gaps, evenly spaced: the codebook also serves later
    gradients, which may fall outside the first step's support."""
    known = levels[~np.isnan(levels)]
    missing = levels.size - known.size
    if missing == 0:
        return levels
    gaps = np.diff(known)
    alloc = np.zeros(gaps.size, dtype=np.int64)
    for _ in range(missing):
        alloc[np.argmax(gaps / (alloc + 1))] += 1
    parts = []
    for g in range(gaps.size):
        steps = np.arange(alloc[g] + 1, dtype=np.float64) / (alloc[g] + 1)
        parts.append(known[g] + gaps[g] * steps)
    parts.append(known[-1:])
    return np.concatenate(parts)


def _optimal_levels(counts: torch.Tensor | np.ndarray, n_levels: int) -> tuple[np.ndarray, float]:
    """Float64 optimal levels for any n_levels >= 2 and the DP's optimal cost (used by tests)."""
    w = _as_counts(counts)
    if n_levels < 2:
        raise ValueError(f"n_levels must be >= 2 (two pinned ends), got {n_levels}")
    nz = np.flatnonzero(w > 0)
    x = bin_centers(w.size).numpy()[nz]
    levels, cost = _pinned_dp(np.ascontiguousarray(x), np.ascontiguousarray(w[nz]), n_levels)
    return _fill_empty(levels), float(cost)


def learn_codebook(counts: torch.Tensor | np.ndarray, bits: int) -> torch.Tensor:
    """Exact optimum (see module docstring); unused levels are spread so the codes stay distinct."""
    bits = _check_bits(bits)
    w = _as_counts(counts)
    if not (w > 0).any():
        return uniform_levels(bits)
    levels, _ = _optimal_levels(w, 1 << bits)
    return _to_float32_levels(levels)


def quantization_error(
    counts: torch.Tensor | np.ndarray, levels: torch.Tensor | np.ndarray
) -> float:
    """The DP's objective, so codebooks from any method compare on equal terms."""
    w = _as_counts(counts)
    lv = _as_levels(levels)
    x = bin_centers(w.size).numpy()
    mids = 0.5 * (lv[1:] + lv[:-1])
    q = lv[np.searchsorted(mids, x)]
    return float(np.sum(w * (x - q) ** 2))


def uniform_levels(bits: int) -> torch.Tensor:
    """Baseline: what a plain linear 2**bits quantiser of block-normalised values would use."""
    n = 1 << _check_bits(bits)
    return _to_float32_levels(np.linspace(-1.0, 1.0, n))


def dynamic_levels(bits: int) -> torch.Tensor:
    """Signed dynamic (tree) map of 8-bit optimizers, for comparison.

    Code layout after the sign bit: e leading zeros give the decade 10**-e, a 1 bit ends the run,
    and the remaining bits index a linear grid of the fraction in (0.1, 1) (bin midpoints). The
    all-zero magnitude is 0, so the code space yields 2**bits - 1 distinct values; the spare code
    (negative zero) becomes +1, and the negative side is rescaled so the range is exactly [-1, 1].
    """
    bits = _check_bits(bits)
    if bits == 1:
        return _to_float32_levels(np.array([-1.0, 1.0]))
    mags = []
    for e in range(bits - 1):
        f = bits - 2 - e
        if f < 0:
            break
        n_frac = 1 << f
        frac = 0.1 + 0.9 * (np.arange(n_frac) + 0.5) / n_frac
        mags.append(frac * 10.0**-e)
    pos = np.sort(np.concatenate(mags))
    neg = -pos[::-1] / pos[-1]
    levels = np.concatenate([neg, [0.0], pos, [1.0]])
    return _to_float32_levels(levels)


def lloyd_max(counts: torch.Tensor | np.ndarray, bits: int, iters: int = 200) -> torch.Tensor:
    """Baseline: Lloyd iterations from uniform levels, outer levels pinned, empty cells kept."""
    n = 1 << _check_bits(bits)
    w = _as_counts(counts)
    x = bin_centers(w.size).numpy()
    lv = np.linspace(-1.0, 1.0, n)
    wx = w * x
    for _ in range(iters):
        cell = np.searchsorted(0.5 * (lv[1:] + lv[:-1]), x)
        sw = np.bincount(cell, weights=w, minlength=n)
        swx = np.bincount(cell, weights=wx, minlength=n)
        new = lv.copy()
        free = sw[1:-1] > 0
        new[1:-1][free] = swx[1:-1][free] / sw[1:-1][free]
        if np.array_equal(new, lv):
            break
        lv = new
    return _to_float32_levels(lv)
