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

7. All-zero: a tensor whose g0 is all zero (a LoRA A whose B is zero at step 1) gives steps 2-5
   nothing to read, and its elements are alike (c = 0: every variance the same), so step 6
   applies: rows, for a tensor of at least two dims.

Batches of matrices: a tensor of three or more dims whose last two dims are each at least
MIN_BLOCK and whose matrices (its last two dims) hold at least MIN_SHARED_NUMEL elements is S
matrices (S = the product of the leading dims: experts, stacked heads; ``matrix_batch``). Each
matrix is partitioned by steps 1-7 as the 2-D tensor it is, from its own statistics (merged over
ranks per matrix); the tensor takes the choice of most of its matrices, the larger block on a
tie, where a matrix whose g0 is all zero (an expert no token reached) abstains; all of them zero,
step 7 on one matrix (``choose_batched``). So no block spans two matrices, and column blocks are
a matrix's columns: ``segments.by_matrix`` cuts the tensor's segments where matrices meet.
Why: read as one tensor, a grouped expert weight (E, r, c) has rows of whole experts, and its
only column candidate holds one element per expert; an expert's down projection, whose g0
varies along its input axis, then fell back to B = 1 (``research/moe_partition.md``).

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

import math
from collections import Counter
from collections.abc import Hashable, Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

MIN_BLOCK = 8
MAX_BLOCK = 1 << 17
MIN_SHARED_NUMEL = 4096
STRUCTURE = 0.95
JUMP = 0.05
ALIKE = 0.5
_CHUNK = {"cpu": 1 << 18}  # elements a first-step pass reads at once, by device type
_DEVICE_CHUNK = 1 << 22


def chunk_elements(device: torch.device) -> int:
    """Elements the first step's passes (statistics, histogram) read at once on ``device``.

    Why two sizes: on the CPU, a chunk's float64 temporaries show up in the process's RSS, and
    256K elements keep them near 6 MiB (``test_a_step_allocates_no_parameter_sized_temporaries``
    bounds the step at 16 MiB); on a GPU each chunk costs a few dozen kernel launches, and 4M
    elements (32 MiB of float64) keep a 1B-parameter first step near 10k chunks instead of
    16 times as many at 256K."""
    return _CHUNK.get(device.type, _DEVICE_CHUNK)


@dataclass(frozen=True)
class MatrixBatch:
    """A tensor of three or more dims read as ``count`` matrices of ``rows`` x ``cols`` (its
    last two dims), each partitioned as a 2-D weight of its own (module docstring, "Batches of
    matrices")."""

    count: int
    rows: int
    cols: int

    @property
    def numel(self) -> int:
        """Elements of one matrix: the tensor's flat index t lies in matrix t // numel."""
        return self.rows * self.cols

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    def runs(self, start: int, numel: int) -> Iterator[tuple[int, int, int]]:
        """Elements [start, start + numel) of the tensor cut where its matrices meet:
        (matrix, first element, end) of each run, in the tensor's flat coordinates."""
        at, end = start, start + numel
        while at < end:
            k = at // self.numel
            hi = min(end, (k + 1) * self.numel)
            yield k, at, hi
            at = hi


def matrix_batch(shape: tuple[int, ...]) -> MatrixBatch | None:
    """The batch of matrices a tensor of ``shape`` is, or None where it is not one: fewer than
    three dims, a last dim or a second-to-last under MIN_BLOCK (a 3x3 convolution's kernel), or
    matrices under MIN_SHARED_NUMEL elements (too small to share v within one)."""
    if len(shape) < 3:
        return None
    rows, cols = shape[-2], shape[-1]
    if rows < MIN_BLOCK or cols < MIN_BLOCK or rows * cols < MIN_SHARED_NUMEL:
        return None
    count = 1
    for s in shape[:-2]:
        count *= s
    return MatrixBatch(count, rows, cols) if count else None


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


@dataclass(frozen=True)
class StatsRequest:
    """One segment whose statistics ``stats_of`` gathers: its flat gradient piece, the piece's
    first index in the tensor, the tensor's candidate block sizes and column period (0: none)."""

    grad: torch.Tensor
    start: int
    candidates: list[int]
    period: int = 0


def segment_stats(
    grad: torch.Tensor, start: int, candidates: list[int], period: int = 0
) -> TensorStats:
    """Statistics of x = grad^2 for a piece of a tensor starting at flat index ``start``;
    ``period`` > 0 also gathers the column sums for that row length (``column_period``)."""
    return stats_of([StatsRequest(grad, start, list(candidates), period)])[0]


def stats_of(requests: list[StatsRequest]) -> list[TensorStats]:
    """``segment_stats`` of many segments with one read back to the host for all of them.

    Why: the statistics of a tensor are a few numbers per candidate block size, and reading
    each back as it is made (a sync of the device per number, hundreds per tensor at 1B
    parameters) cost more than the arithmetic. Every sum stays on the gradient's device until
    all segments are done; then one vector comes back and is cut into ``TensorStats``.

    How: the block sums of a candidate p are built from those of its largest candidate
    divisor (or from sums over runs of g = gcd of the candidates elements), so the gradient is
    read once per chunk whatever the number of candidates. Chunks end at multiples of the
    candidates' least common multiple in the tensor's coordinates, so no block crosses a chunk
    and only the segment's two ends can cut one; a chunk holds at most ``chunk_elements``
    elements, or that multiple where it is larger (tensors whose candidates' multiple passes
    that are rare: flat buffers of a highly composite size).
    """
    out: list[TensorStats | None] = []
    pending: list[tuple[int, _Sums]] = []
    for req in requests:
        flat = req.grad.reshape(-1)
        if flat.numel() == 0:
            out.append(TensorStats(list(req.candidates), period=req.period))
            continue
        pending.append((len(out), _device_sums(flat, req)))
        out.append(None)
    if pending:
        dev = pending[0][1].vector.device  # one read even where pieces lie on several devices
        host = torch.cat([s.vector.to(dev) for _, s in pending]).cpu()
        values = host.tolist()
        at = 0
        for i, sums in pending:
            out[i] = sums.read(values, host, at)
            at += sums.vector.numel()
    return out  # type: ignore[return-value]


@dataclass
class _Sums:
    """One segment's statistics as a device vector [s1, s2, block_sq per candidate, the cut
    blocks' partial sums, column sums], and where each lies in it."""

    request: StatsRequest
    count: int
    vector: torch.Tensor
    cut: list[tuple[int, int]]  # (candidate index, block index) of each partial sum, in order

    def read(self, values: list[float], host: torch.Tensor, at: int) -> TensorStats:
        req, k = self.request, len(self.request.candidates)
        stats = TensorStats(list(req.candidates), period=req.period)
        stats.count = float(self.count)
        stats.s1, stats.s2 = values[at], values[at + 1]
        stats.block_sq = values[at + 2 : at + 2 + k]
        for j, (i, b) in enumerate(self.cut):
            part = stats.partial[i]
            part[b] = part.get(b, 0.0) + values[at + 2 + k + j]
        if req.period:
            lo = at + 2 + k + len(self.cut)
            stats.col_sums = host[lo : lo + req.period].clone()
        return stats


def _lcm(values: list[int]) -> int:
    out = 1
    for v in values:
        out = out * v // math.gcd(out, v)
    return out


def _device_sums(flat: torch.Tensor, req: StatsRequest) -> _Sums:
    cands, period = req.candidates, req.period
    n, start = flat.numel(), req.start
    end = start + n
    dev = flat.device
    base = math.gcd(*cands) if cands else 1
    # each candidate's block sums come from its largest candidate divisor's, else from runs of base
    parent = [
        max((j for j in range(i) if p % cands[j] == 0), default=-1) for i, p in enumerate(cands)
    ]
    step = _lcm(cands)
    step = max(step, chunk_elements(dev) // step * step)
    # [s1, s2, block_sq per candidate], added to in place: a list of per-chunk scalars would
    # keep small live tensors between the chunks' large ones and grow the heap by the chunks
    acc = torch.zeros(2 + len(cands), dtype=torch.float64, device=dev)
    cut_ids: list[tuple[int, int]] = []
    cut_vals: list[torch.Tensor] = []
    cols = torch.zeros(period, dtype=torch.float64, device=dev) if period else None
    t0 = start
    while t0 < end:
        t1 = min((t0 // step + 1) * step, end)
        # a copy squared in place: a float64 gradient's .double() would be the gradient itself
        x = flat[t0 - start : t1 - start].to(torch.float64, copy=True).square_()
        acc[1] += torch.dot(x, x)
        if cols is not None:
            _add_columns(cols, x, t0, period)
        runs = _group_sums(x, t0, base) if base > 1 else x
        acc[0] += runs.sum()
        sums: list[torch.Tensor] = []
        for i, p in enumerate(cands):
            d = cands[parent[i]] if parent[i] >= 0 else base
            s = _group_sums(sums[parent[i]] if parent[i] >= 0 else runs, t0 // d, p // d)
            sums.append(s)
            b0, b1 = t0 // p, (t1 - 1) // p  # the blocks this chunk touches
            head = b0 * p < start  # cut by the segment's start
            tail = (b1 + 1) * p > end  # cut by its end
            lo, hi = int(head), s.numel() - int(tail)
            if hi > lo:
                acc[2 + i] += torch.dot(s[lo:hi], s[lo:hi])
            if head:
                cut_ids.append((i, b0))
                cut_vals.append(s[:1].clone())
            if tail and (b1 != b0 or not head):
                cut_ids.append((i, b1))
                cut_vals.append(s[-1:].clone())
        t0 = t1
    parts = [acc, *cut_vals]
    if cols is not None:
        parts.append(cols)
    return _Sums(req, n, torch.cat(parts), cut_ids)


def _group_sums(x: torch.Tensor, first: int, ratio: int) -> torch.Tensor:
    """Sums of ``ratio`` consecutive entries of ``x`` grouped as a tensor's coordinates group
    them: entry k of ``x`` has index ``first + k`` there, and group j holds the indices
    [j * ratio, (j + 1) * ratio); the groups the ends of ``x`` cut hold what ``x`` has of them."""
    if ratio == 1:
        return x
    front = first % ratio
    back = -(front + x.numel()) % ratio
    if front or back:  # only at a segment's ends
        x = torch.nn.functional.pad(x, (front, back))
    if ratio <= 4:  # a sum over a short inner dim is slow on a CPU; strided adds are not
        out = x[0::ratio] + x[1::ratio]
        for k in range(2, ratio):
            out += x[k::ratio]
        return out
    return x.view(-1, ratio).sum(dim=1)


def _add_columns(sums: torch.Tensor, x: torch.Tensor, t0: int, period: int) -> None:
    """sums[j] += x[i] for the i whose flat index t0 + i is j mod period (both on the
    gradient's device)."""
    first = t0 % period
    head = min((period - first) % period, x.numel())
    if head:
        sums[first : first + head] += x[:head]
    body = x[head:]
    whole = body.numel() // period * period
    if whole:
        sums += body[:whole].view(-1, period).sum(dim=0)
    if body.numel() > whole:
        sums[: body.numel() - whole] += body[whole:]


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
    c = stats.col_sums.numpy()  # on the host: a read of numbers already there
    sq = float(np.dot(c, c))
    within = max(stats.s2 - sq / (n / period), 0.0) / (n - period)
    return within / total


def spread(stats: TensorStats, numel: int) -> float:
    """c of step 6: the spread of the elements' variances implied by the moments of x = g^2;
    0 for an all-zero gradient (its elements are alike: step 7), inf where undefined."""
    n = float(numel)
    if stats.count != n or not stats.s1 >= 0.0:
        return float("inf")
    if stats.s1 == 0.0:
        return 0.0
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


def choose_batched(matrices: Mapping[int, TensorStats], batch: MatrixBatch) -> int:
    """One block size for a batch of matrices from each matrix's merged statistics (keyed by
    its index): each matrix's own choice (``choose_block_size`` on its (rows, cols)), the most
    common among the matrices whose g0 is not all zero, the larger block on a tie. An all-zero
    matrix (an expert no token reached) abstains and takes the others' choice; a tensor whose
    every matrix is zero takes one matrix's all-zero choice, its rows (step 7)."""
    votes: Counter[int] = Counter()
    for stats in matrices.values():
        if stats.s1 > 0.0:
            votes[choose_block_size(stats, batch.numel, batch.cols)] += 1
    if not votes:
        zero = TensorStats(candidate_block_sizes(batch.shape), count=float(batch.numel))
        return choose_block_size(zero, batch.numel, batch.cols)
    return max(votes, key=lambda b: (votes[b], batch.rows if b < 0 else b))


def stats_requests(grad: torch.Tensor, start: int, shape: tuple[int, ...]) -> list[MatrixPiece]:
    """The statistics requests of a tensor's piece ``grad`` (flat, from flat index ``start``):
    one for the piece, or one per matrix it touches where the tensor is a batch of matrices,
    each in that matrix's own coordinates."""
    batch = matrix_batch(shape)
    if batch is None:
        req = StatsRequest(grad, start, candidate_block_sizes(shape), column_period(shape))
        return [MatrixPiece(None, req)]
    cands, period = candidate_block_sizes(batch.shape), column_period(batch.shape)
    return [
        MatrixPiece(
            k, StatsRequest(grad[lo - start : hi - start], lo - k * batch.numel, cands, period)
        )
        for k, lo, hi in batch.runs(start, grad.numel())
    ]


@dataclass(frozen=True)
class MatrixPiece:
    """A statistics request and the matrix of a batch it reads (None: the whole tensor)."""

    matrix: int | None
    request: StatsRequest


@dataclass(frozen=True)
class MatrixKey:
    """The statistics of matrix ``matrix`` of the batch-of-matrices tensor ``tensor`` (the
    first step's key of the tensor: its name where it is spread over ranks)."""

    tensor: Hashable
    matrix: int


def block_size_for(grad: torch.Tensor, shape: tuple[int, ...] | None = None) -> int:
    """Block size for a whole tensor from its first gradient, in one process."""
    shape = tuple(grad.shape) if shape is None else tuple(shape)
    pieces = stats_requests(grad.reshape(-1), 0, shape)
    stats = stats_of([p.request for p in pieces])
    batch = matrix_batch(shape)
    if batch is not None:
        return choose_batched({p.matrix: st for p, st in zip(pieces, stats, strict=True)}, batch)
    return choose_block_size(stats[0], grad.numel(), row_length(shape))
