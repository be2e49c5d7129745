"""The first step of a parameter: its blocks from g0^2, and (the first time) the codebook.

Why apart from the step: it runs once per parameter, reads the whole first gradient several
times (statistics per candidate block size, the histogram of g0 / absmax), and is the one place
the ranks must agree before any state exists (``collectives``); every later step only updates
what this allocates.

Why it reads back to the host so rarely: on a GPU every value read back waits for the device
to finish all it was given. The statistics of every segment stay on the device until all are
made and come back as one vector (``partition.stats_of``); the histogram is summed on the
device and comes back once per device; the cut blocks' absmax (sharded tensors) once. So a
first step reads back a handful of times whatever the model's size, and runs a handful of
collectives (``initialize``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Hashable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .distributed import collectives
from .method import codebook as cb
from .method import partition
from .method.segments import Segment, block_runs, column_chunks, tensor_keys


@dataclass(frozen=True)
class Pending:
    """A parameter at its first step, as the first step reads it.

    ``grad``: this rank's gradient, flat (``flat``); ``segments``: the pieces of original
    tensors it holds; ``copy``: another rank of the group holds the same piece (it counts once
    in the group's statistics and histogram); ``span``: the ranks over which the tensor is
    spread where they are a part of the group (``collectives.merge_stats``), else None;
    ``name``: what an error calls it (a callable, as naming a parameter searches the
    optimizer's groups and is wanted only for an error)."""

    name: Callable[[], str]
    bits: int
    segments: list[Segment]
    grad: torch.Tensor
    copy: bool = False
    span: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Learned:
    """What the first step learned: ``blocks[i][j]`` the block size of segment j of pending
    parameter i; ``codebooks`` the codebook of each bit width that had none before."""

    blocks: list[list[int]]
    codebooks: dict[int, torch.Tensor]


def initialize(
    pending: list[Pending], group: dist.ProcessGroup | None, have: Collection[int]
) -> Learned:
    """Partition newly seen parameters; learn the codebooks of the bit widths not in ``have``.
    A non-finite first gradient on any rank is refused on every rank together, before anything
    is learned: the partition and the codebook would be learned from it.

    Under a process group it runs four collectives whatever the number of parameters: one
    all-reduce of the refusal, one all-gather of the spread tensors' statistics and, when a
    codebook is learned, one all-gather of the cut blocks' absmax and one all-reduce of the
    histogram."""
    keys: list[list[Hashable]] = []
    seg_of: dict[Hashable, Segment] = {}
    requests: list[partition.StatsRequest] = []
    owner: list[tuple[int, Hashable]] = []
    for i, item in enumerate(pending):
        row = []
        for seg, tensor in zip(item.segments, tensor_keys(item.segments), strict=True):
            key = tensor if isinstance(tensor, str) else (i, tensor)
            seg_of[key] = seg
            row.append(key)
            if item.copy:
                continue
            piece = item.grad[seg.offset : seg.offset + seg.numel]
            for mp in partition.stats_requests(piece, seg.start, seg.shape):
                requests.append(mp.request)
                stat_key = key if mp.matrix is None else partition.MatrixKey(key, mp.matrix)
                owner.append((i, stat_key))
        keys.append(row)
    pieces: dict[Hashable, list[partition.TensorStats]] = {}
    bad = None
    for (i, key), st in zip(owner, partition.stats_of(requests), strict=True):
        if bad is None and not (math.isfinite(st.s1) and math.isfinite(st.s2)):
            bad = pending[i].name()
        pieces.setdefault(key, []).append(st)
    if collectives.any_rank(group, bad is not None):
        where = f"in {bad}" if bad is not None else "on another rank"
        raise ValueError(
            f"non-finite gradient {where} at its first step: Gefen learns its block partition "
            "and codebook from it and will not learn them from inf/NaN (check the loss, or "
            "the AMP grad scaler)"
        )
    spans = {
        k: item.span
        for item, row in zip(pending, keys, strict=True)
        for k in row
        if item.span is not None and isinstance(k, str)
    }
    agreed = collectives.merge_stats(group, pieces, set(seg_of), spans)
    merged = agreed.stats
    matrices: dict[Hashable, dict[int, partition.TensorStats]] = {}
    for k, st in merged.items():
        if isinstance(k, partition.MatrixKey):
            matrices.setdefault(k.tensor, {})[k.matrix] = st
    block_of = {key: _choose(key, seg, merged, matrices) for key, seg in seg_of.items()}

    codebooks: dict[int, torch.Tensor] = {}
    new_bits = sorted({item.bits for item in pending} - set(have))
    if new_bits:
        cut = cut_block_absmax(group, pending, keys, block_of)
        acc: dict[torch.device, torch.Tensor] = {}
        for item, row in zip(pending, keys, strict=True):
            if item.copy:
                continue
            for seg, key in zip(item.segments, row, strict=True):
                if key in agreed.copies:
                    continue
                piece = item.grad[seg.offset : seg.offset + seg.numel]
                if piece.device not in acc:
                    acc[piece.device] = _bins(piece.device)
                bin_segment(piece, seg, block_of[key], acc[piece.device], cut.get(key, {}))
        counts = torch.zeros(cb.DEFAULT_BINS, dtype=torch.float64, device="cpu")
        for a in acc.values():
            counts += a[: cb.DEFAULT_BINS].to(device="cpu", dtype=torch.float64)
        counts = collectives.sum_histogram(group, counts)
        for bits in new_bits:
            codebooks[bits] = cb.learn_codebook(counts, bits)
    return Learned([[block_of[k] for k in row] for row in keys], codebooks)


def _choose(
    key: Hashable,
    seg: Segment,
    merged: dict[Hashable, partition.TensorStats],
    by_tensor: dict[Hashable, dict[int, partition.TensorStats]],
) -> int:
    """The block size of the tensor ``key`` (of which ``seg`` is a piece) from the merged
    statistics of the whole tensor, or of each of its matrices (``by_tensor[key]``)."""
    batch = partition.matrix_batch(seg.shape)
    if batch is None:
        return partition.choose_block_size(
            merged[key], seg.tensor_numel, partition.row_length(seg.shape)
        )
    matrices = by_tensor.get(key, {})
    if len(matrices) != batch.count:
        raise RuntimeError(
            f"{seg.name or key}: statistics of {len(matrices)} of its "
            f"{batch.count} matrices reached the first step"
        )
    return partition.choose_batched(matrices, batch)


def column_slot(seg: Segment) -> int:
    """The key under which ``cut_block_absmax`` keeps the whole columns' absmax of a
    column-blocked segment: -1 for a tensor, -(1 + k) for matrix k of a batch of matrices
    (whose columns are each matrix's own)."""
    batch = partition.matrix_batch(seg.shape)
    return -1 - (seg.start // batch.numel if batch is not None else 0)


def cut_block_absmax(
    group: dist.ProcessGroup | None,
    pending: list[Pending],
    keys: list[list[Hashable]],
    block_of: dict[Hashable, int],
) -> dict[Hashable, dict[int, float | torch.Tensor]]:
    """Whole-block absmax of g0 for blocks cut by a shard boundary (and of every column of a
    column-blocked tensor spread over ranks), so that every rank normalises its piece of such a
    block as one process would and the summed histogram (hence the codebook) is the
    single-process one. The pieces' absmax come back to the host in one read."""
    if group is None:
        return {}
    blocks: list[tuple[Hashable, int]] = []
    block_vals: list[torch.Tensor] = []
    columns: list[tuple[Hashable, Segment]] = []
    column_vals: list[torch.Tensor] = []
    for item, row in zip(pending, keys, strict=True):
        for seg, key in zip(item.segments, row, strict=True):
            bs = block_of[key]
            if not isinstance(key, str) or bs == 1:
                continue
            piece = item.grad[seg.offset : seg.offset + seg.numel]
            if bs < 0:
                columns.append((key, seg))
                column_vals.append(column_absmax(piece, -bs).double())
                continue
            for run in block_runs(seg.start, seg.numel, bs):
                if run.length < bs:
                    blocks.append((key, (seg.start + run.elem) // bs))
                    amax = piece[run.elem : run.elem + run.length].abs().max()
                    block_vals.append(amax.double().view(1))
    local: dict[Hashable, dict[int, float | torch.Tensor]] = {}
    every = block_vals + column_vals
    host = torch.cat([v.to(every[0].device) for v in every]).cpu() if every else None
    vals = host[: len(block_vals)].tolist() if host is not None else []
    for (key, b), amax in zip(blocks, vals, strict=True):
        had = local.setdefault(key, {}).get(b)
        # several of this rank's segments may cut one block (rows of a piece)
        local[key][b] = amax if had is None else max(had, amax)
    at = len(block_vals)
    for (key, seg), v in zip(columns, column_vals, strict=True):
        period = -block_of[key]
        cols = torch.zeros(period, device="cpu")
        k = (seg.start + torch.arange(v.numel(), device="cpu")) % period
        cols[k] = host[at : at + v.numel()].float()
        at += v.numel()
        slot = column_slot(seg)
        prev = local.setdefault(key, {}).get(slot)
        local[key][slot] = cols if prev is None else torch.maximum(prev, cols)
    return collectives.max_cut_absmax(group, local)


def flat(t: torch.Tensor, name: Callable[[], str]) -> torch.Tensor:
    """``t`` as one flat run of elements; a parameter or gradient that is not contiguous is
    refused by name (its segments' offsets would not be its elements')."""
    if not t.is_contiguous():
        raise ValueError(f"Gefen needs contiguous parameters and gradients; {name()} is not")
    return t.view(-1)


def histogram(
    g: torch.Tensor, seg: Segment, block_size: int, counts: torch.Tensor, cut: dict[int, float]
) -> None:
    """Add block-normalised values g / absmax(block) of one segment to ``counts`` (float64, on
    any device); ``cut`` gives the whole-block absmax of blocks that a shard boundary cuts."""
    acc = _bins(g.device)
    bin_segment(g, seg, block_size, acc, cut)
    counts += acc[: cb.DEFAULT_BINS].to(device=counts.device, dtype=torch.float64)


def _bins(device: torch.device) -> torch.Tensor:
    """Int64 counts of ``cb.DEFAULT_BINS`` bins and one more, where the values of all-zero
    blocks go (they have no scale and count nowhere): dropping them by a mask would give the
    device a shape to report back."""
    return torch.zeros(cb.DEFAULT_BINS + 1, dtype=torch.int64, device=device)


def bin_segment(
    g: torch.Tensor, seg: Segment, block_size: int, acc: torch.Tensor, cut: dict[int, float]
) -> None:
    """``histogram`` into ``acc`` (``_bins``, on g's device), with nothing read back."""
    if block_size == 1:
        return
    if block_size < 0:
        column_bins(g, seg.start, -block_size, acc, cut.get(column_slot(seg)))
        return
    for run in block_runs(seg.start, seg.numel, block_size):
        whole = cut.get((seg.start + run.elem) // block_size) if run.length < block_size else None
        rows = max(1, partition.chunk_elements(g.device) // run.length)
        for r0 in range(0, run.count, rows):
            r1 = min(r0 + rows, run.count)
            a = run.elem + r0 * run.length
            x = g[a : a + (r1 - r0) * run.length].float().view(r1 - r0, run.length)
            amax = torch.linalg.vector_norm(x, float("inf"), dim=1, keepdim=True)  # max |x|
            if whole is not None:
                amax.fill_(whole)
            _bin_scaled(x, amax, acc)


def _bin_scaled(x: torch.Tensor, amax: torch.Tensor, acc: torch.Tensor) -> None:
    """Count x / amax (amax broadcast over x) into ``acc`` as ``cb.histogram`` bins: the same
    float32 quotient, the same float64 bin arithmetic, so the counts are exactly its counts;
    the elements whose amax is 0 go to the extra bin."""
    bins = cb.DEFAULT_BINS
    keep = amax > 0
    # (y + 1) * bins / 2, floored and clamped to [0, bins - 1] as cb.histogram does; amax's
    # shape (a row's or a column's) carries the all-zero blocks off to bin ``bins``: +5, not +1,
    # and a limit of ``bins``. Truncation floors here: the values are clamped at 0 first.
    y = (x / torch.where(keep, amax, torch.ones_like(amax))).to(torch.float64)
    y.add_(torch.where(keep, 1.0, 5.0)).mul_(bins / 2.0)
    y.clamp_(min=y.new_zeros(()), max=torch.where(keep, float(bins - 1), float(bins)).to(y.dtype))
    idx = y.to(torch.int64).reshape(-1)
    acc.index_add_(0, idx, torch.ones((), dtype=acc.dtype, device=acc.device).expand(idx.numel()))


def column_absmax(g: torch.Tensor, period: int) -> torch.Tensor:
    """max |g| of each of a segment's column blocks (block k: its elements i = k mod period)."""
    amax = torch.zeros(min(g.numel(), period), dtype=torch.float32, device=g.device)
    for lo, hi, w in column_chunks(g.numel(), period, partition.chunk_elements(g.device)):
        torch.maximum(amax[:w], g[lo:hi].float().view(-1, w).abs().amax(dim=0), out=amax[:w])
    return amax


def column_bins(
    g: torch.Tensor, start: int, period: int, acc: torch.Tensor, columns: torch.Tensor | None
) -> None:
    """``bin_segment`` for column blocks: each column normalised by its absmax, that of the
    whole column (``columns``, indexed by column) when the tensor is spread over ranks."""
    nb = min(g.numel(), period)
    if columns is None:
        amax = column_absmax(g, period)
    else:
        amax = columns.to(g.device)[(start + torch.arange(nb, device=g.device)) % period]
    for lo, hi, w in column_chunks(g.numel(), period, partition.chunk_elements(g.device)):
        _bin_scaled(g[lo:hi].float().view(-1, w), amax[:w], acc)
