"""Where a parameter's elements live: plain tensors and DTensors sharded on dim 0 (FSDP2).

A DTensor sharded on dim 0 holds, on each rank, a contiguous run of its flattened global tensor,
which is exactly one segment. Other layouts (sharding on another dim, tensor-parallel meshes)
would scatter a block over ranks, so they are refused by name rather than silently mis-blocked.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..method.segments import Segment, plain_segments

try:
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
except ImportError:  # a torch build without distributed
    DTensor = None


def is_dtensor(t: torch.Tensor) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores and updates in place."""
    return t._local_tensor if is_dtensor(t) else t


def segments_of(p: torch.Tensor, key: str, name: str) -> list[Segment]:
    if not is_dtensor(p):
        return plain_segments(p.numel(), tuple(p.shape))
    check_layout(p, name)
    if group_of(p) is None:
        return plain_segments(p.numel(), tuple(p.shape))
    shape = tuple(p.shape)
    local_shape, offset = compute_local_shape_and_global_offset(shape, p.device_mesh, p.placements)
    row = 1
    for s in shape[1:]:
        row *= s
    numel = 1
    for s in local_shape:
        numel *= s
    start = offset[0] * row if shape else 0
    if numel == 0:
        start = 0
    return [Segment(offset=0, numel=numel, start=start, shape=shape, name=key)]


def check_layout(p: torch.Tensor, name: str) -> None:
    if p.device_mesh.ndim != 1:
        raise ValueError(
            f"{name} is a DTensor on a {p.device_mesh.ndim}-D device mesh; Gefen supports "
            "1-D meshes (FSDP2 fully_shard), not HSDP or tensor-parallel meshes"
        )
    for pl in p.placements:
        if isinstance(pl, Shard) and pl.dim != 0:
            raise ValueError(
                f"{name} is a DTensor sharded on dim {pl.dim}; Gefen needs dim-0 sharding so "
                "each rank holds a contiguous run of the tensor (FSDP2's layout)"
            )
        if not isinstance(pl, (Shard, Replicate)):
            raise ValueError(f"{name} has DTensor placement {pl}; Gefen needs Shard(0)")


def group_of(p: torch.Tensor) -> dist.ProcessGroup | None:
    """The process group over which pieces of ``p`` are spread, if any."""
    if is_dtensor(p) and any(isinstance(pl, Shard) for pl in p.placements):
        return p.device_mesh.get_group()
    return None
