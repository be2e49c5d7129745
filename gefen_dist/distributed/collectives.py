"""The collectives Gefen runs over its process group, each for one agreement between ranks.

Why these exist: a tensor sharded over ranks (FSDP, ZeRO) must be blocked, normalised and
factored exactly as one process would do it with the whole tensor, so the ranks that hold its
pieces exchange the few numbers that decide it. Each function is a no-op without a group (one
process, or DDP, where every rank already sees the whole tensor and the same averaged gradient).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..method import partition


def comm_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a collective's tensors go on ``group``: NCCL reduces only CUDA tensors, gloo CPU
    ones. A group made with a device-qualified backend names it so ("cuda:nccl",
    "cpu:gloo,cuda:nccl"); one with both takes CUDA tensors, which keeps GPU-side sums off the
    host."""
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def any_rank(group: dist.ProcessGroup | None, flag: bool) -> bool:
    """Whether ``flag`` holds on any rank: partitioning, and a refusal of the first step, are
    collective when parameters are sharded, so all ranks enter (or refuse) them together."""
    if group is None:
        return flag
    t = torch.tensor([int(flag)], device=comm_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def _gather(group: dist.ProcessGroup, obj: Any) -> list[Any]:
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, obj, group=group)
    return every


@dataclass(frozen=True)
class Merged:
    """What ``merge_stats`` agreed: the statistics of every tensor (or matrix) this rank holds,
    and the tensors of which this rank holds a replica that counts nowhere (``copies``)."""

    stats: dict[Hashable, partition.TensorStats]
    copies: frozenset[Hashable]


def merge_stats(
    group: dist.ProcessGroup | None,
    pieces: dict[Hashable, list[partition.TensorStats]],
    held: set[Hashable],
    spans: dict[Hashable, tuple[int, ...]] | None = None,
) -> Merged:
    """Partition statistics per tensor (or per matrix of a batch, ``partition.MatrixKey``);
    named pieces come from tensors spread over ranks, so every rank's pieces of a tensor it
    holds (``held``: its tensors' keys, also those it holds as a copy and has no statistics
    of) are merged by name: every rank then chooses the same block.

    ``spans``: the ranks over which each named tensor is spread, for tensors spread over a part
    of ``group`` (a sub-mesh: norms on the dp mesh of a (dp, tp) model, dense weights beside
    experts). Other parts may hold replicas of the same tensor (the dp mesh of every tp rank);
    the part with the least ranks counts, and the others' pieces count nowhere, here or in the
    histogram (``Merged.copies``), so statistics and codebook are the single-process ones."""
    spans = spans or {}
    if group is None:
        return Merged({k: partition.merge_stats(v) for k, v in pieces.items()}, frozenset())
    named = {k: v for k, v in pieces.items() if isinstance(_tensor(k), str)}
    pieces = {k: v for k, v in pieces.items() if not isinstance(_tensor(k), str)}
    every = _gather(group, (named, spans))
    counts: dict[Hashable, tuple[int, ...]] = {}
    for _, their_spans in every:
        for k, ranks in their_spans.items():
            counts[k] = min(counts.get(k, ranks), ranks)
    for their_named, their_spans in every:
        for k, v in their_named.items():
            t = _tensor(k)
            if t in held and their_spans.get(t) == counts.get(t):
                pieces.setdefault(k, []).extend(v)
    copies = frozenset(k for k, ranks in spans.items() if ranks != counts[k])
    return Merged({k: partition.merge_stats(v) for k, v in pieces.items()}, copies)


def _tensor(key: Hashable) -> Hashable:
    return key.tensor if isinstance(key, partition.MatrixKey) else key


def sum_histogram(group: dist.ProcessGroup | None, counts: torch.Tensor) -> torch.Tensor:
    """Every rank learns the codebook from the sum of all ranks' g0 histograms."""
    if group is not None:
        on = counts.to(comm_device(group))
        dist.all_reduce(on, group=group)
        counts = on.to(counts.device)
    return counts


def max_cut_absmax(
    group: dist.ProcessGroup, local: dict[Hashable, dict[int, Any]]
) -> dict[Hashable, dict[int, Any]]:
    """The whole block's absmax of each block a shard boundary cuts, from every rank's pieces
    (``local``: tensor name -> block index -> the piece's absmax; a negative index holds every
    column's absmax of a column-blocked tensor or matrix, as a tensor:
    ``first_step.column_slot``)."""
    out: dict[Hashable, dict[int, Any]] = {}
    for other in _gather(group, local):
        for key, blocks in other.items():
            if key in local:
                for b, amax in blocks.items():
                    had = out.setdefault(key, {}).get(b)
                    if had is not None:
                        amax = torch.maximum(had, amax) if b < 0 else max(had, amax)
                    out[key][b] = amax
    return out


def agree_cross_slots(
    group: dist.ProcessGroup, local: dict[str, int]
) -> dict[str, tuple[int, int]]:
    """Where each tensor spread over ranks puts its v_cross sums in the per-step all-reduce:
    name -> (offset, entries), the same on every rank (``local``: the v_cross entries of the
    spread tensors this rank holds a piece of)."""
    merged: dict[str, int] = {}
    for other in _gather(group, local):
        for name, n in other.items():
            if merged.setdefault(name, n) != n:
                raise RuntimeError(
                    f"ranks disagree on the v_cross entries of {name!r} "
                    f"({merged[name]} and {n}): different block sizes on different ranks"
                )
    slots, at = {}, 0
    for name in sorted(merged):
        slots[name] = (at, merged[name])
        at += merged[name]
    return slots
