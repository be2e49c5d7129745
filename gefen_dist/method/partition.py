"""Block partition: how many consecutive elements of a tensor share one second moment and one scale.

Why: parameters whose first squared gradients g0^2 are alike tend to be Hessian-aligned and can
share v (Gefen, Theorem 4.1); larger blocks cost less state. The block size B is chosen once, from
g0^2, per original tensor, and is then the same on every rank that holds a piece of it.

The rule, exactly:

1. Candidates: divisors p of the tensor's size n with MIN_BLOCK <= p <= min(MAX_BLOCK, n // 2)
   that are aligned with its rows (row = product of all dims but the first; a 1-D tensor is one
   row): p divides the row length or is a whole number of rows. Tensors smaller than
   MIN_SHARED_NUMEL keep B = 1: their state is negligible and their statistics too noisy to trust.
2. For each candidate, the within-block heterogeneity, Bessel-corrected and normalised by the
   tensor's total variance of g0^2:
       R(p) = [sum_b sum_{i in b} (x_i - mean_b)^2 / (n - n/p)] / [sum_i (x_i - mean)^2 / (n - 1)]
   With no structure (i.i.d. x) R(p) ~ 1 for every p; blocks that follow the structure give R < 1;
   growing a block past a structural boundary (one row -> two rows of different scale) shows up
   as a jump in R. (1 - R is the share of variance the block means explain; its "drop".)
3. The jump at p: J(p) = R(q) / R(p), q the next larger candidate that p divides (the whole
   tensor, R = 1, when there is none).
4. B = the p with the largest jump (the larger p on ties), if that jump is clear,
   J(p) >= 1 + JUMP, and the blocks below it are structured, R(p) <= STRUCTURE; else B = 1.
   Rows: where that B spans several rows (B > row, the row a candidate) and its rows are not
   alike, R(B) >= (1 + JUMP) R(row) (growing a row to B is itself a clear jump), B = the same
   choice among the candidates of at most a row, or the row itself where none of them has a
   clear jump.
5. Columns: for a tensor of at least two dims with at least MIN_BLOCK rows of at most MAX_BLOCK
   elements, the strided reading of "period" (docs/method.md 1.4) is a candidate too: period P = the
   row length, block j = the elements at flat index = j mod P, i.e. column j of the (rows, P)
   view. Its R_col is computed as in step 2 with P blocks of n / P elements; grouping coarser
   than a column is the whole tensor, so its jump is 1 / R_col. Columns win, stored as B = -P,
   when R_col <= STRUCTURE (hence a clear jump) and R_col < R(B) of the contiguous choice (or
   that choice is B = 1).
6. Alike: a tensor that steps 4-5 leave at B = 1 shares v per row all the same when its elements
   are as alike as one common variance allows. If g_i = s_i z_i with z_i standard normal, then
   x = g^2 has CV^2(x) = 2 + 3 c, where c = CV^2(s^2) is the spread of the elements' own
   variances; so c = (CV^2(x) - 2) / 3 from the tensor's two moments of x. With c <= ALIKE and
   at least two dims, B = the largest candidate that fits in a row (the row itself where it is
   a candidate). Tensors of one dim (norm gains, biases: sensitive, and a few thousand elements
   a layer) keep B = 1.

Why step 6: the fallback to B = 1 protects elements that differ in ways no block follows, but
R cannot tell those from elements that do not differ at all: i.i.d. noise of one variance has
R = 1 too. The suite's 3x3 convolutions behind BatchNorm (c = 0.09-0.33 over seeds) and the q/k
projections of an initialised Llama-3 are of that kind, and kept per-element state for nothing.
ALIKE = 0.5 lets the elements' variances spread by a CV of 0.7: with lognormal variances, one
shared v then moves each step by an RMS of 0.5 |ln(v_i / v_block)| ~ 0.33 at g0, the size of the
error the rule's own blocks carry later in training (0.24-0.35 at step 440 on the GRU,
``research/sharing_drift.py``); inside the blocks it chooses, c is -0.2 to 0.42 at g0
(``python research/alike.py`` prints both c's per tensor and seed).

Why rows before multi-row blocks (step 4): the largest jump can sit above a finer structure the
same test also finds. A GRU's stacked gate matrices (576 = 3 gates x 192 rows) have g0^2 that
varies by gate and, inside a gate, by row: weight_hh R(192) = 0.65, R(36864) = 0.85, whole tensor
1, so the gate (J 1.17) beat the row (J 1.15) on seed 2; over seeds 0-5 weight_hh took a gate on
2 and weight_ih on 4.
A block of a whole gate leaves 3 blocks, under MIN_CROSS_BLOCKS, so the tensor also lost its cross
factor: one v and one absmax for 36864 elements whose rows differ, and g0's gate structure is the
untrained cell's (from step ~20 on, the same rule on that step's gradient picks rows). At AdamW's
best lr (x3) the 8-bit gap to AdamW over 6 paired seeds went from +1.28 % (t +1.0; +5.8 % on a
seed with two gate blocks) to -3.78 % (t -2.8) with rows (``research/results/gru_high_lr.md``).
Blocks of several alike rows (heads: R(head) ~ R(row)) still form; a row costs ~(4 + 4) / row
bytes per parameter more than a gate, +0.048 on the GRU with both matrices affected.

Why columns: the first gradients of some weights vary along the input axis, not the output axis
(an MLP's down projection: within-row R 0.93, within-column 0.69, measured by
``research/row_col_structure.py``). Contiguous blocks cannot express that, so those tensors fell
back to B = 1 and per-element state (4 bytes/param; 8 while it was fp32).

Why the largest jump rather than the first: real first gradients have small dips at fine scales
(a GPT's attention c_proj: R(8) = 0.67, R(16) = 0.73, flat to R(256) = 0.75, then R(512) = 0.88);
stopping at the first would keep 8-element blocks, 2 bytes/param instead of 1. Row-aligned
candidates keep a block from straddling two rows at all; the jump test alone also finds the row
of a fused qkv whose shape is hidden (a flat buffer), see the tests.

The statistics are sums over blocks, gathered per segment (a tensor's piece in a buffer) with the
cut blocks at its two ends kept apart, so pieces held by different ranks can be merged into exactly
the numbers one process would compute for the whole tensor (see ``merge_stats``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

MIN_BLOCK = 8
MAX_BLOCK = 1 << 17
MIN_SHARED_NUMEL = 4096
STRUCTURE = 0.95
JUMP = 0.05
ALIKE = 0.5
_CHUNK = 1 << 18


def row_length(shape: tuple[int, ...]) -> int:
    """Elements per row (all dims but the first); 0 for a tensor of fewer than two dims, which
    has no rows: step 6 leaves it alone, and the candidates treat it as one row."""
    if len(shape) < 2 or shape[0] == 0:
        return 0
    n = 1
    for s in shape[1:]:
        n *= s
    return n


def column_period(shape: tuple[int, ...]) -> int:
    """The row length P whose columns are a candidate (step 5), or 0 when columns are not:
    fewer than MIN_BLOCK rows, or rows longer than MAX_BLOCK (a step's per-column scratch, like
    a block's, stays bounded)."""
    if len(shape) < 2 or shape[0] < MIN_BLOCK:
        return 0
    row = row_length(shape)
    if shape[0] * row < MIN_SHARED_NUMEL or row > MAX_BLOCK:
        return 0
    return row


def candidate_block_sizes(shape: tuple[int, ...]) -> list[int]:
    n = 1
    for s in shape:
        n *= s
    if n < MIN_SHARED_NUMEL:
        return []
    row = row_length(shape) or n  # a 1-D tensor is one row
    hi = min(MAX_BLOCK, n // 2)
    out = []
    for p in _divisors(n):
        if MIN_BLOCK <= p <= hi and (row % p == 0 or p % row == 0):
            out.append(p)
    return out


def _divisors(n: int) -> list[int]:
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


@dataclass
class TensorStats:
    """Additive g0^2 statistics of one tensor, or of pieces of it.

    ``block_sq[i]`` is the sum over whole blocks of size ``candidates[i]`` of (block sum)^2;
    ``partial[i]`` maps a block index to the partial sum of a block cut by a segment end, so that
    pieces from different segments or ranks add up to whole blocks in ``merge_stats``.
    ``col_sums`` (float64, one per column, when ``period``) are the column sums of x, additive
    over pieces as they are.
    """

    candidates: list[int]
    count: float = 0.0
    s1: float = 0.0
    s2: float = 0.0
    block_sq: list[float] = field(default_factory=list)
    partial: list[dict[int, float]] = field(default_factory=list)
    period: int = 0
    col_sums: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if not self.block_sq:
            self.block_sq = [0.0] * len(self.candidates)
        if not self.partial:
            self.partial = [{} for _ in self.candidates]
        if self.period and self.col_sums is None:
            self.col_sums = torch.zeros(self.period, dtype=torch.float64, device="cpu")


def segment_stats(
    grad: torch.Tensor, start: int, candidates: list[int], period: int = 0
) -> TensorStats:
    """Statistics of x = grad^2 for a piece of a tensor starting at flat index ``start``;
    ``period`` > 0 also gathers the column sums for that row length (``column_period``).

    Works in chunks so that partitioning a huge tensor never allocates a tensor-sized temporary.
    """
    stats = TensorStats(list(candidates), period=period)
    flat = grad.reshape(-1)
    n = flat.numel()
    end = start + n
    carry = [0.0] * len(candidates)
    for a in range(0, n, _CHUNK):
        x = flat[a : a + _CHUNK].double().square_()
        stats.count += x.numel()
        stats.s1 += float(x.sum())
        stats.s2 += float(x.square().sum())
        if period:
            _add_columns(stats.col_sums, x, start + a, period)
        prefix = torch.cat([x.new_zeros(1), x.cumsum(0)])
        t0, t1 = start + a, start + a + x.numel()
        for i, p in enumerate(candidates):
            first = (t0 // p + 1) * p
            if first > t1:
                carry[i] += float(prefix[-1])
                continue
            at = prefix[torch.arange(first - t0, t1 - t0 + 1, p, device=prefix.device)]
            sums = torch.diff(at, prepend=prefix[:1])
            sums[0] += carry[i]
            block_lo = t0 // p
            if (block_lo * p) < start:
                stats.partial[i][block_lo] = stats.partial[i].get(block_lo, 0.0) + float(sums[0])
                sums = sums[1:]
            stats.block_sq[i] += float(sums.square().sum())
            carry[i] = float(prefix[-1] - at[-1])
    for i, p in enumerate(candidates):
        if n and end % p:
            last = (end - 1) // p
            stats.partial[i][last] = stats.partial[i].get(last, 0.0) + carry[i]
    return stats


def _add_columns(sums: torch.Tensor, x: torch.Tensor, t0: int, period: int) -> None:
    """sums[j] += x[i] for the i whose flat index t0 + i is j mod period. ``sums`` stays on the
    host (ranks all-gather the statistics as objects), ``x`` is on the gradient's device."""
    first = t0 % period
    head = min((period - first) % period, x.numel())
    if head:
        sums[first : first + head] += x[:head].to(sums.device)
    body = x[head:]
    whole = body.numel() // period * period
    if whole:
        sums += body[:whole].view(-1, period).sum(dim=0).to(sums.device)
    if body.numel() > whole:
        sums[: body.numel() - whole] += body[whole:].to(sums.device)


def merge_stats(parts: list[TensorStats]) -> TensorStats:
    """Add the statistics of pieces; cut blocks whose pieces all arrived become whole blocks."""
    if not parts:
        raise ValueError("merge_stats needs at least one piece")
    out = TensorStats(list(parts[0].candidates), period=parts[0].period)
    for s in parts:
        if s.candidates != out.candidates or s.period != out.period:
            raise ValueError("pieces of one tensor must share candidate block sizes and period")
        if s.period:
            out.col_sums += s.col_sums
        out.count += s.count
        out.s1 += s.s1
        out.s2 += s.s2
        for i in range(len(out.candidates)):
            out.block_sq[i] += s.block_sq[i]
            for b, v in s.partial[i].items():
                out.partial[i][b] = out.partial[i].get(b, 0.0) + v
    return out


def heterogeneity(stats: TensorStats, numel: int) -> list[float]:
    """R(p) for each candidate (module docstring, step 2); inf where undefined."""
    n = float(numel)
    if stats.count != n:
        raise ValueError(f"statistics cover {stats.count:.0f} of {numel} elements")
    total = stats.s2 - stats.s1 * stats.s1 / n
    if not total > 0.0:
        return [float("inf")] * len(stats.candidates)
    total /= n - 1.0
    out = []
    for p, sq, part in zip(stats.candidates, stats.block_sq, stats.partial, strict=True):
        sq = sq + sum(v * v for v in part.values())
        within = max(stats.s2 - sq / p, 0.0) / (n - n / p)
        out.append(within / total)
    return out


def column_heterogeneity(stats: TensorStats, numel: int) -> float:
    """R_col (module docstring, step 5); inf where undefined or no column statistics."""
    n, period = float(numel), stats.period
    if not period or stats.count != n or numel <= period:
        return float("inf")
    total = stats.s2 - stats.s1 * stats.s1 / n
    if not total > 0.0:
        return float("inf")
    total /= n - 1.0
    sq = float(stats.col_sums.square().sum())
    within = max(stats.s2 - sq / (n / period), 0.0) / (n - period)
    return within / total


def spread(stats: TensorStats, numel: int) -> float:
    """c of step 6: the spread of the elements' variances implied by the moments of x = g^2;
    inf where undefined (no statistics, or an all-zero gradient)."""
    n = float(numel)
    if stats.count != n or not stats.s1 > 0.0:
        return float("inf")
    return (n * stats.s2 / (stats.s1 * stats.s1) - 3.0) / 3.0


def choose_block_size(stats: TensorStats, numel: int, row: int = 0) -> int:
    """Apply the rule in the module docstring to merged statistics of a whole tensor: B > 0
    contiguous blocks, B = -P columns of period P, B = 1 no sharing. ``row``: the tensor's
    row length (``row_length``), for step 6; 0 skips it."""
    best, r_best = _contiguous(stats, numel)
    if row and best > row and row in stats.candidates:
        r_row = heterogeneity(stats, numel)[stats.candidates.index(row)]
        if not r_best < r_row * (1.0 + JUMP):  # its rows differ: keep blocks within a row
            best, r_best = _contiguous(stats, numel, limit=row)
            if best == 1:
                best, r_best = row, r_row
    r_col = column_heterogeneity(stats, numel)
    if r_col <= STRUCTURE and (best == 1 or r_col < r_best):
        return -stats.period
    if best == 1 and row and spread(stats, numel) <= ALIKE:
        fits = [p for p in stats.candidates if p <= row]
        return max(fits) if fits else 1
    return best


def _contiguous(stats: TensorStats, numel: int, limit: int = 0) -> tuple[int, float]:
    """Steps 2-4 without the rows test: (B, R(B)), (1, inf) for none; ``limit`` > 0 considers
    only candidates of at most that many elements (their jumps still look above it)."""
    cands = stats.candidates
    if not cands:
        return 1, float("inf")
    r = heterogeneity(stats, numel)
    best, best_jump, r_best = 1, 1.0 + JUMP, float("inf")
    for i, p in enumerate(cands):
        if not r[i] <= STRUCTURE or (limit and p > limit):
            continue
        nxt = next((r[j] for j in range(i + 1, len(cands)) if cands[j] % p == 0), 1.0)
        jump = nxt / r[i] if r[i] > 0 else float("inf")
        if jump >= best_jump:
            best, best_jump, r_best = p, jump, r[i]
    return best, r_best


def block_size_for(grad: torch.Tensor, shape: tuple[int, ...] | None = None) -> int:
    """Block size for a whole tensor from its first gradient, in one process."""
    shape = tuple(grad.shape) if shape is None else tuple(shape)
    cands = candidate_block_sizes(shape)
    stats = segment_stats(grad, 0, cands, column_period(shape))
    return choose_block_size(stats, grad.numel(), row_length(shape))
