"""The first step of a parameter: its blocks from g0^2, and (the first time) the codebook.

Why apart from the step: it runs once per parameter, reads the whole first gradient several
times (statistics per candidate block size, the histogram of g0 / absmax), and is the one place
the ranks must agree before any state exists (``collectives``); every later step only updates
what this allocates.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import TYPE_CHECKING

import torch

from .backends.reference import CHUNK
from .distributed import collectives, sharding
from .method import codebook as cb
from .method import partition, state
from .method.segments import Segment, block_chunks, block_runs, column_chunks

if TYPE_CHECKING:
    from .optimizer import Gefen


def initialize(opt: Gefen, pending: list[tuple[torch.Tensor, dict]]) -> None:
    """Partition newly seen parameters; learn the codebooks if this is the first time. A
    non-finite first gradient on any rank is refused on every rank together, before anything
    is written: the partition and the codebook would be learned from it."""
    pieces: dict[Hashable, list[partition.TensorStats]] = {}
    seg_of: dict[Hashable, Segment] = {}
    plan = []
    bad = None
    for p, group in pending:
        segs = opt._segments_for(p)
        flat_g = flat(sharding.local(p.grad), p, opt)
        copy = sharding.is_copy(p)
        keys = []
        for i, seg in enumerate(segs):
            key = seg.name or (id(p), i)
            seg_of[key] = seg
            keys.append(key)
            if copy:  # another rank of the group holds the same piece: it counts once
                pieces.setdefault(key, [])
                continue
            st = partition.segment_stats(
                flat_g[seg.offset : seg.offset + seg.numel],
                seg.start,
                partition.candidate_block_sizes(seg.shape),
                partition.column_period(seg.shape),
            )
            if bad is None and not (math.isfinite(st.s1) and math.isfinite(st.s2)):
                bad = opt._name(p)
            pieces.setdefault(key, []).append(st)
        plan.append((p, group, segs, keys))
    if collectives.any_rank(opt._group, bad is not None):
        where = f"in {bad}" if bad is not None else "on another rank"
        raise ValueError(
            f"non-finite gradient {where} at its first step: Gefen learns its block partition "
            "and codebook from it and will not learn them from inf/NaN (check the loss, or "
            "the AMP grad scaler)"
        )
    merged = collectives.merge_stats(opt._group, pieces)
    block_of = {
        k: partition.choose_block_size(
            s, seg_of[k].tensor_numel, partition.row_length(seg_of[k].shape)
        )
        for k, s in merged.items()
    }

    new_bits = sorted({g["bits"] for _, g, _, _ in plan} - set(opt._codebooks))
    if new_bits:
        counts = torch.zeros(cb.DEFAULT_BINS, dtype=torch.float64, device="cpu")
        cut = cut_block_absmax(opt, plan, block_of)
        for p, _, segs, keys in plan:
            if sharding.is_copy(p):
                continue
            flat_g = flat(sharding.local(p.grad), p, opt)
            for seg, key in zip(segs, keys, strict=True):
                piece = flat_g[seg.offset : seg.offset + seg.numel]
                histogram(piece, seg, block_of[key], counts, cut.get(key, {}))
        counts = collectives.sum_histogram(opt._group, counts)
        for bits in new_bits:
            opt._codebooks[bits] = cb.learn_codebook(counts, bits)

    for p, group, segs, keys in plan:
        blocks = [block_of[k] for k in keys]
        levels = opt._shared_codebook(opt._codebooks[group["bits"]], p.device)
        opt.state[p] = state.allocate(segs, blocks, levels, p.device)
    opt._cross_slots = None  # new tensors may be spread: agree on the table again


def cut_block_absmax(opt: Gefen, plan, block_of) -> dict[Hashable, dict[int, float]]:
    """Whole-block absmax of g0 for blocks cut by a shard boundary (and of every column of a
    column-blocked tensor spread over ranks), so that every rank normalises its piece of such a
    block as one process would and the summed histogram (hence the codebook) is the
    single-process one."""
    if opt._group is None:
        return {}
    local: dict[Hashable, dict[int, float]] = {}
    for p, _, segs, keys in plan:
        flat_g = flat(sharding.local(p.grad), p, opt)
        for seg, key in zip(segs, keys, strict=True):
            bs = block_of[key]
            if not isinstance(key, str) or bs == 1:
                continue
            if bs < 0:
                piece = flat_g[seg.offset : seg.offset + seg.numel]
                cols = torch.zeros(-bs, device="cpu")
                k = (seg.start + torch.arange(min(seg.numel, -bs), device="cpu")) % -bs
                cols[k] = column_absmax(piece, -bs).cpu()
                prev = local.setdefault(key, {}).get(-1)
                local[key][-1] = cols if prev is None else torch.maximum(prev, cols)
                continue
            for run in block_runs(seg.start, seg.numel, bs):
                if run.length < bs:
                    a = seg.offset + run.elem
                    amax = float(flat_g[a : a + run.length].abs().max())
                    b = (seg.start + run.elem) // bs
                    # several of this rank's segments may cut one block (rows of a piece)
                    had = local.setdefault(key, {}).get(b)
                    local[key][b] = amax if had is None else max(had, amax)
    return collectives.max_cut_absmax(opt._group, local)


def contiguous(t: torch.Tensor, p: torch.Tensor, opt: Gefen) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError(f"Gefen needs contiguous parameters and gradients; {opt._name(p)} is not")
    return t


def flat(t: torch.Tensor, p: torch.Tensor, opt: Gefen) -> torch.Tensor:
    return contiguous(t, p, opt).view(-1)


def histogram(
    g: torch.Tensor, seg: Segment, block_size: int, counts: torch.Tensor, cut: dict[int, float]
) -> None:
    """Add block-normalised values g / absmax(block) of one segment to ``counts``; ``cut`` gives
    the whole-block absmax of blocks that a shard boundary cuts."""
    if block_size == 1:
        return
    if block_size < 0:
        column_histogram(g, seg.start, -block_size, counts, cut.get(-1))
        return
    for c in block_chunks(seg.start, seg.numel, block_size, CHUNK):
        x = g[c.elem : c.end].float().view(c.rows, c.length)
        amax = x.abs().amax(dim=1, keepdim=True)
        whole = cut.get((seg.start + c.elem) // block_size)
        if c.length < block_size and whole is not None:
            amax.fill_(whole)
        keep = amax.view(-1) > 0
        cb.histogram(x[keep] / amax[keep], cb.DEFAULT_BINS, out=counts)


def column_absmax(g: torch.Tensor, period: int) -> torch.Tensor:
    """max |g| of each of a segment's column blocks (block k: its elements i = k mod period)."""
    amax = torch.zeros(min(g.numel(), period), dtype=torch.float32, device=g.device)
    for lo, hi, w in column_chunks(g.numel(), period, CHUNK):
        torch.maximum(amax[:w], g[lo:hi].float().view(-1, w).abs().amax(dim=0), out=amax[:w])
    return amax


def column_histogram(
    g: torch.Tensor, start: int, period: int, counts: torch.Tensor, columns: torch.Tensor | None
) -> None:
    """``_histogram`` for column blocks: each column normalised by its absmax, that of the whole
    column (``columns``, indexed by column) when the tensor is spread over ranks."""
    nb = min(g.numel(), period)
    if columns is None:
        amax = column_absmax(g, period)
    else:
        amax = columns.to(g.device)[(start + torch.arange(nb, device=g.device)) % period]
    keep = amax > 0
    for lo, hi, w in column_chunks(g.numel(), period, CHUNK):
        x = g[lo:hi].float().view(-1, w)[:, keep[:w]]
        cb.histogram((x / amax[:w][keep[:w]]).reshape(-1), cb.DEFAULT_BINS, out=counts)
