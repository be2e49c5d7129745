"""Where each original tensor's pieces lie in the flat fp32 partitions ZeRO hands Gefen.

ZeRO stages 1 and 2 and DeepSpeed's ``BF16_Optimizer`` give the inner optimizer one flat
partition per param group, cut from a buffer that concatenates the group's tensors (with
alignment padding between them under stages 1 and 2); stage 3 gives one per sub-group,
concatenating each parameter's own partition. Gefen chooses a block size per original tensor, so
it must know which elements of each partition belong to which tensor, where in that tensor they
start, and what is padding: a ``Flat`` per partition, with its segments. The readers below check
the sizes they derive against the buffers' own and refuse a DeepSpeed that lays them out
otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from ...method.segments import Segment

__all__ = ["Flat", "Layout", "Piece", "cut", "layout_of", "numel", "param_names"]


@dataclass
class Flat:
    """One buffer Gefen steps: a rank's partition of a param group or sub-group."""

    tensor: torch.Tensor
    group: int
    """Index of the client optimizer's param group the partition belongs to."""
    segments: list[Segment]
    labels: list[str]
    """Original tensor name per segment; "" for padding."""


@dataclass(frozen=True)
class Layout:
    """A ZeRO wrapper's partitions on this rank, read once when Gefen is bound to it."""

    kind: str
    """"ZeRO-1", "ZeRO-2", "ZeRO-3" or "BF16_Optimizer": what checkpoints record and compare."""
    flats: list[Flat]
    group: dist.ProcessGroup
    """The process group the partitions are cut over (the other pieces of a cut tensor)."""
    republish: Callable[[int], None]
    """Copy partition i's fp32 master weights to the wrapper's low-precision copy, for a
    partition updated after the wrapper had refreshed that copy (the held first step)."""


class Piece(NamedTuple):
    """One tensor in a flat buffer that concatenates a param group's tensors."""

    at: int
    """Element of the buffer where the tensor starts."""
    shape: tuple[int, ...]
    name: str


class Window(NamedTuple):
    """The segments of one rank's window of a flat buffer, and the tensor name of each."""

    segments: list[Segment]
    labels: list[str]


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _pad(offset: int, count: int) -> Segment:
    return Segment(offset=offset, numel=count, start=0, shape=(count,))


def cut(pieces: list[Piece], lo: int, hi: int) -> Window:
    """Segments of the window [lo, hi) of a flat buffer of ``pieces``; what no tensor covers is
    padding. A tensor wholly in the window gets no segment name: only pieces of tensors spread
    over ranks need their statistics merged."""
    segs: list[Segment] = []
    labels: list[str] = []
    pos = lo
    for at, shape, name in sorted(pieces):
        n = numel(shape)
        a, b = max(at, lo), min(at + n, hi)
        if a >= b:
            continue
        if a > pos:
            segs.append(_pad(pos - lo, a - pos))
            labels.append("")
        segs.append(Segment(a - lo, b - a, a - at, shape, name if b - a < n else ""))
        labels.append(name)
        pos = b
    if pos < hi:
        segs.append(_pad(pos - lo, hi - pos))
        labels.append("")
    return Window(segs, labels)


def param_names(wrapper: Any) -> dict[int, str]:
    """Parameter name by ``id``, as the engine told the wrapper (``param_names``)."""
    return {id(p): n for p, n in (getattr(wrapper, "param_names", None) or {}).items()}


def _one_group(groups: list[dist.ProcessGroup], what: str) -> dist.ProcessGroup:
    first = groups[0]
    if any(g is not first for g in groups):
        raise ValueError(
            f"Gefen under DeepSpeed needs every {what} partitioned over one process group; this "
            "engine uses several (MoE expert groups or ZeRO-3 parameter groups): one Gefen "
            "optimizer spans one process group"
        )
    return first


def _stage12(zo: DeepSpeedZeroOptimizer) -> Layout:
    by_id = param_names(zo)
    pg = _one_group(list(zo.real_dp_process_group), "param group")
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    flats = []
    for i, params in enumerate(zo.round_robin_bit16_groups):
        flat = zo.single_partition_of_fp32_groups[i]
        size = int(zo.partition_size[i])
        total = zo.bit16_groups_flat[i].numel()
        if size * world != total or flat.numel() != size:
            raise RuntimeError(
                f"ZeRO param group {i}: partition of {flat.numel()} elements, expected {size} of "
                f"a {total}-element flat buffer over {world} ranks; this DeepSpeed version "
                "partitions differently from what gefen_dist.integrations.deepspeed knows"
            )
        # Older DeepSpeed has no parameter alignment padding (nor these lists).
        metas = zo.round_robin_bit16_meta[i] if hasattr(zo, "round_robin_bit16_meta") else params
        pads = getattr(zo, "round_robin_bit16_padding", None)
        pieces, at = [], 0
        for k, (p, meta) in enumerate(zip(params, metas, strict=True)):
            pieces.append(Piece(at, tuple(meta.shape), by_id.get(id(p), f"group {i} param {k}")))
            at += meta.numel() + (pads[i][k] if pads is not None else 0)
        window = cut(pieces, rank * size, (rank + 1) * size)
        flats.append(Flat(flat, i, window.segments, window.labels))

    def republish(i: int) -> None:
        part = zo.parallel_partitioned_bit16_groups[i][rank]
        part.data.copy_(zo.single_partition_of_fp32_groups[i].data)

    kind = "ZeRO-2" if zo.partition_gradients else "ZeRO-1"
    return Layout(kind, flats, pg, republish)


def _bf16(bo: BF16_Optimizer) -> Layout:
    by_id = param_names(bo)
    pg = _one_group(list(bo.real_dp_process_group), "param group")
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    flats = []
    for i, params in enumerate(bo.bf16_groups):
        flat = bo.fp32_groups_flat_partition[i]
        size = bo.bf16_groups_flat[i].numel() // world
        pieces, at = [], 0
        for k, p in enumerate(params):
            pieces.append(Piece(at, tuple(p.shape), by_id.get(id(p), f"group {i} param {k}")))
            at += p.numel()
        window = cut(pieces, rank * size, (rank + 1) * size)
        flats.append(Flat(flat, i, window.segments, window.labels))
    # BF16_Optimizer steps every group in one inner call and refreshes its bf16 copies after it.
    return Layout("BF16_Optimizer", flats, pg, lambda i: None)


def _stage3(zo: DeepSpeedZeroOptimizer_Stage3) -> Layout:
    by_id = param_names(zo)
    n = len(zo.fp16_groups)
    pgs = [zo._get_sub_group_process_group(j) for j in range(n)]
    pg = _one_group(pgs, "sub-group")
    rank = dist.get_rank(pg)
    flats = []
    for j, params in enumerate(zo.fp16_groups):
        flat = zo.fp32_partitioned_groups_flat[j]
        segs, labels = [], []
        at = 0
        for p in params:
            pn = p.partition_numel()
            shape = tuple(p.ds_shape)
            start = rank * pn
            real = max(0, min(pn, p.ds_numel - start))
            name = by_id.get(id(p), f"param {p.ds_id}")
            if real:
                segs.append(Segment(at, real, start, shape, name if real < p.ds_numel else ""))
                labels.append(name)
            if pn > real:
                segs.append(_pad(at + real, pn - real))
                labels.append("")
            at += pn
        if at != flat.numel():
            raise RuntimeError(
                f"ZeRO-3 sub-group {j}: flat partition has {flat.numel()} elements, its "
                f"parameters' partitions {at}; this DeepSpeed version lays out sub-groups "
                "differently from what gefen_dist.integrations.deepspeed knows"
            )
        flats.append(Flat(flat, int(zo.sub_group_to_group_id[j]), segs, labels))
    return Layout("ZeRO-3", flats, pg, zo._reassign_or_swap_out_partitioned_parameters)


def layout_of(wrapper: Any) -> Layout:
    """The partitions of a ZeRO wrapper Gefen supports (its exact type: a subclass may lay them
    out otherwise); any other wrapper is refused by name."""
    kind = type(wrapper)
    if kind is DeepSpeedZeroOptimizer:
        return _stage12(wrapper)
    if kind is DeepSpeedZeroOptimizer_Stage3:
        return _stage3(wrapper)
    if kind is BF16_Optimizer:
        return _bf16(wrapper)
    raise ValueError(
        f"Gefen under DeepSpeed: the {kind.__name__} wrapper is not supported; use ZeRO "
        "stage 1, 2 or 3 (zero_optimization.stage), or fp32 training without ZeRO"
    )
