"""Where a parameter's elements live: plain tensors and DTensors sharded on dim 0 over one mesh
dimension (FSDP2, and FSDP2's HSDP: ``Replicate()`` on the other mesh dimensions).

A DTensor sharded on dim 0 holds, on each rank, a contiguous run of its flattened global tensor,
which is exactly one segment. Replicated mesh dimensions (HSDP's replica groups) hold copies of
that run and see the same averaged gradient, so the ranks that must agree on blocks, codebook and
v_cross are those of the one sharded mesh dimension (``group_of``), and each replica group keeps
its own identical copy of the state. Other layouts (sharding on another dim, or on several mesh
dimensions as tensor parallelism does) would scatter a block over ranks, so they are refused by
name rather than silently mis-blocked.
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


def layout(p: torch.Tensor) -> str:
    """A DTensor's placements by mesh dimension, as errors name them."""
    mesh = p.device_mesh
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    dims = ", ".join(f"{n}={s}" for n, s in zip(names, mesh.shape, strict=True))
    return f"placements {tuple(p.placements)} on a {mesh.ndim}-D mesh ({dims})"


def check_layout(p: torch.Tensor, name: str) -> None:
    """Refuse, naming the layout, what is not dim-0 sharding over one mesh dimension with every
    other dimension replicated (FSDP2, HSDP)."""
    shards = [pl for pl in p.placements if isinstance(pl, Shard)]
    if p.device_mesh.ndim > 2:
        raise ValueError(
            f"{name} has {layout(p)}: Gefen supports 1-D meshes (FSDP2 fully_shard) and 2-D "
            "(replicate, shard) meshes (HSDP), not meshes of more dimensions"
        )
    for pl in p.placements:
        if not isinstance(pl, (Shard, Replicate)):
            raise ValueError(
                f"{name} has {layout(p)}: {pl} is not supported; Gefen needs Shard(0) on one mesh "
                "dimension and Replicate() on the others (FSDP2 fully_shard, HSDP)"
            )
    if len(shards) > 1:
        raise ValueError(
            f"{name} has {layout(p)}: it is sharded over {len(shards)} mesh dimensions "
            "(tensor-parallel style), which Gefen does not support; it needs Shard(0) on one "
            "mesh dimension and Replicate() on the others (FSDP2 fully_shard, HSDP)"
        )
    if shards and shards[0].dim != 0:
        raise ValueError(
            f"{name} has {layout(p)}: a DTensor sharded on dim {shards[0].dim}; Gefen needs dim-0 "
            "sharding so each rank holds a contiguous run of the tensor (FSDP2's layout)"
        )


def shard_dim(p: torch.Tensor) -> int | None:
    """The mesh dimension over which ``p`` is sharded (after ``check_layout``), if any."""
    if not is_dtensor(p):
        return None
    for i, pl in enumerate(p.placements):
        if isinstance(pl, Shard):
            return i
    return None


def group_of(p: torch.Tensor) -> dist.ProcessGroup | None:
    """The process group over which pieces of ``p`` are spread, if any: under HSDP the shard
    mesh dimension's group, not the whole mesh (the replicas already agree)."""
    i = shard_dim(p)
    return None if i is None else p.device_mesh.get_group(mesh_dim=i)


def replica_group_of(p: torch.Tensor) -> dist.ProcessGroup | None:
    """The group of ranks holding copies of this rank's piece of ``p`` (HSDP's replicate mesh
    dimension), if any; ``None`` where the mesh has no replicated dimension."""
    i = shard_dim(p)
    if i is None or p.device_mesh.ndim == 1:
        return None
    return p.device_mesh.get_group(mesh_dim=1 - i)
