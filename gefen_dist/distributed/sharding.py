"""Where a parameter's elements live: plain tensors and DTensors (FSDP2, its HSDP, FSDP2 or HSDP
with tensor parallelism, expert parallelism).

A rank's local tensor is contiguous, and it holds, per tensor dim, some of the global indices
(the placements say which: ``Shard``, and FSDP2's ``_StridedShard`` over a tensor-parallel
``Shard``). Its elements, in order, are therefore runs of the global flattened tensor: one run
when only dim 0 is cut (FSDP2), one per local row when an inner dim is cut (a ``RowwiseParallel``
weight: some columns of every row). Each run is a segment in the original tensor's coordinates,
so blocks lie where one process would put them and a block that a run boundary cuts keeps one
v and absmax per piece, as FSDP's boundary cuts do.

The ranks that must agree on blocks, codebook and v_cross (``group_of``) are those holding
distinct pieces of a tensor:

- a 1-D mesh (FSDP2): its group;
- a 2-D mesh whose dim 0 is ``Replicate()`` (FSDP2's HSDP, or replicas of a tensor-parallel
  mesh): the group of mesh dim 1; the replicas see the same averaged gradient and each replica
  group keeps its own, identical, copy of the state;
- a 2-D mesh whose dim 0 is sharded (FSDP2 over dp with tensor parallelism on tp): the group of
  the whole mesh, for every parameter on it, also those ``Replicate()`` on tp (norms under
  ``SequenceParallel``). Ranks holding a copy of another rank's piece (a nonzero coordinate on
  a ``Replicate()`` mesh dim, ``is_copy``) then count nowhere in the statistics or the
  histogram, so both are the single-process ones;
- meshes of more dimensions by the same rule: the mesh dimensions from the first that shards the
  tensor on (an HSDP mesh with tensor parallelism, (replicate, shard, tp): each replica's
  (shard, tp) ranks; expert parallelism with tensor parallelism, (dp, ep, tp): the whole mesh).

One optimizer may hold parameters of different groups when they nest (layers left out of a TP
plan on the dp mesh, inside the (dp, tp) mesh's ranks): it agrees over the largest, and a
tensor spread over a part of it counts once (``Gefen._use_group``, ``collectives.merge_stats``).

``Partial()`` placements, and more than one replicate dimension before the first that shards,
are refused by name.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..method.segments import Segment, plain_segments

try:
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import _get_shard_size_and_offsets
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # a torch build without distributed
    DTensor = None


def is_dtensor(t: torch.Tensor) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores and updates in place."""
    return t._local_tensor if is_dtensor(t) else t


def is_shard(pl: object) -> bool:
    return isinstance(pl, (Shard, _StridedShard))


def segments_of(p: torch.Tensor, key: str, name: str) -> list[Segment]:
    if not is_dtensor(p):
        return plain_segments(p.numel(), tuple(p.shape))
    check_layout(p, name)
    if group_of(p) is None:
        return plain_segments(p.numel(), tuple(p.shape))
    return piece_segments(p, key)


def dim_indices(p: torch.Tensor) -> list[torch.Tensor | None]:
    """Per tensor dim, the global indices this rank holds, in local order (None: all, in
    order); the same walk over the placements as DTensor's own offsets
    (``compute_local_shape_and_global_offset``), keeping every index rather than the first."""
    shape = tuple(p.shape)
    mesh = p.device_mesh
    coord = mesh.get_coordinate()
    sizes = list(shape)
    held: dict[int, torch.Tensor] = {}
    for md, pl in enumerate(p.placements):
        if not is_shard(pl):
            continue
        size, index = _get_shard_size_and_offsets(
            sizes[pl.dim], mesh.size(md), coord[md], pl, held.get(pl.dim), shape[pl.dim], False
        )
        sizes[pl.dim] = size
        held[pl.dim] = index[:size]
    out: list[torch.Tensor | None] = []
    for d, n in enumerate(shape):
        ix = held.get(d)
        out.append(None if ix is None or torch.equal(ix, torch.arange(n)) else ix.long())
    return out


def piece_segments(p: torch.Tensor, key: str) -> list[Segment]:
    """This rank's local tensor as the runs of the global flattened tensor it holds."""
    shape = tuple(p.shape)
    lt = local(p)
    if lt.numel() == 0 or not shape:
        return [Segment(offset=0, numel=lt.numel(), start=0, shape=shape, name=key)]
    ix = dim_indices(p)
    got = tuple(len(i) if i is not None else n for i, n in zip(ix, shape, strict=True))
    if got != tuple(lt.shape):
        raise RuntimeError(
            f"{key}: local tensor {tuple(lt.shape)} is not the piece its placements "
            f"{tuple(p.placements)} give ({got})"
        )
    return runs_of(shape, ix, key)


def runs_of(
    shape: tuple[int, ...], indices: list[torch.Tensor | None], key: str = ""
) -> list[Segment]:
    """The segments of a contiguous local tensor that holds, per dim d of a tensor of ``shape``,
    the global indices ``indices[d]`` (None: all, in order), in local (C) order: consecutive
    local runs that are consecutive globally make one segment, so a piece cut on dim 0 alone
    is one segment and a piece cut on an inner dim one per row (and per stretch of indices)."""
    shape = tuple(shape)
    full = [torch.arange(n) if i is None else i.long() for i, n in zip(indices, shape, strict=True)]
    numel = 1
    for i in full:
        numel *= len(i)
    k = len(shape) - 1
    while k >= 0 and (indices[k] is None or torch.equal(full[k], torch.arange(shape[k]))):
        k -= 1
    if k < 0 or numel == 0:
        return [Segment(offset=0, numel=numel, start=0, shape=shape, name=key)]
    inner = 1
    for n in shape[k + 1 :]:
        inner *= n
    gstride = [inner]
    for n in reversed(shape[1 : k + 1]):
        gstride.insert(0, gstride[0] * n)
    d = full[k]  # runs of consecutive indices along dim k
    cut = torch.ones(len(d), dtype=torch.bool)
    cut[1:] = d[1:] != d[:-1] + 1
    first = torch.nonzero(cut).view(-1)
    length = torch.diff(first, append=torch.tensor([len(d)]))
    rows = torch.zeros(1, dtype=torch.long)  # global offset of each local row of dims < k
    for i, s in zip(full[:k], gstride[:k], strict=True):
        rows = (rows[:, None] + i[None, :] * s).reshape(-1)
    starts = (rows[:, None] + d[first][None, :] * inner).reshape(-1)
    numels = (length * inner).repeat(len(rows))
    offsets = (
        torch.arange(len(rows))[:, None] * (len(d) * inner) + first[None, :] * inner
    ).reshape(-1)
    new = torch.ones(len(starts), dtype=torch.bool)
    new[1:] = starts[1:] != starts[:-1] + numels[:-1]
    head = torch.nonzero(new).view(-1)
    sums = torch.cumsum(numels, 0)
    ends = torch.cat([head[1:], torch.tensor([len(starts)])]) - 1
    total = sums[ends] - sums[head] + numels[head]
    return [
        Segment(offset=o, numel=n, start=s, shape=shape, name=key)
        for o, n, s in zip(
            offsets[head].tolist(), total.tolist(), starts[head].tolist(), strict=True
        )
    ]


def layout(p: torch.Tensor) -> str:
    """A DTensor's placements by mesh dimension, as errors name them."""
    mesh = p.device_mesh
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    dims = ", ".join(f"{n}={s}" for n, s in zip(names, mesh.shape, strict=True))
    return f"placements {tuple(p.placements)} on a {mesh.ndim}-D mesh ({dims})"


def check_layout(p: torch.Tensor, name: str) -> None:
    """Refuse, naming the layout, what Gefen cannot place in the tensor's coordinates:
    placements other than Shard, _StridedShard (FSDP2 over a tensor-parallel Shard) and
    Replicate (a Partial tensor holds no rank's elements), and replicate dimensions of a mesh
    of more than two dimensions that Gefen cannot make one group of (``group_of``)."""
    for pl in p.placements:
        if not (is_shard(pl) or isinstance(pl, Replicate)):
            raise ValueError(
                f"{name} has {layout(p)}: {pl} is not supported; Gefen needs each mesh "
                "dimension to shard (Shard, _StridedShard) or replicate (Replicate) the tensor"
            )
    first = _first_shard(p)
    mesh = p.device_mesh
    # _inner_group flattens by name
    if first is not None and first > 0 and mesh.ndim - first > 1 and not mesh.mesh_dim_names:
        raise ValueError(
            f"{name} has {layout(p)}: Gefen makes one group of the mesh dimensions from "
            "the first that shards the tensor on, which needs the mesh's dimension names "
            "(init_device_mesh(..., mesh_dim_names=...))"
        )
    if first is not None and first > 1:
        raise ValueError(
            f"{name} has {layout(p)}: Gefen supports one replicate dimension before the "
            "dimensions that shard the tensor (HSDP), not several"
        )


def _first_shard(p: torch.Tensor) -> int | None:
    """The first mesh dimension that shards ``p``: the dimensions before it replicate it
    (HSDP's replicate dimension), those from it on spread it (``group_of``)."""
    for i, pl in enumerate(p.placements):
        if is_shard(pl):
            return i
    return None


_WHOLE: dict[tuple, dist.ProcessGroup] = {}


def _whole_group(mesh) -> dist.ProcessGroup:
    """One group object per mesh's ranks (the optimizer checks that its parameters share one),
    made once: every rank builds the same parameters' groups in the same order."""
    ranks = tuple(sorted(mesh.mesh.flatten().tolist()))
    if ranks == tuple(range(dist.get_world_size())):
        return dist.group.WORLD
    key = (id(dist.group.WORLD), ranks)
    if key not in _WHOLE:
        _WHOLE[key] = dist.new_group(list(ranks))
    return _WHOLE[key]


def _inner_group(mesh, first: int) -> dist.ProcessGroup:
    """The group of the mesh dimensions ``first`` on, one per coordinate of those before (each
    replica's): DeviceMesh's own flattening, which makes every replica's group at once over
    the root mesh, so no rank waits on a group the others do not make."""
    names = mesh.mesh_dim_names[first:]
    flat = mesh[names]._flatten("_gefen_" + "_".join(names))
    return flat.get_group()


def shard_dim(p: torch.Tensor) -> int | None:
    """The mesh dimension whose group spreads ``p`` (after ``check_layout``), if one mesh
    dimension alone does: the sharding dimension of a 1-D mesh or of a (replicate, shard)
    mesh; None where no mesh dim shards it, or where several do (``group_of``)."""
    if not is_dtensor(p):
        return None
    first = _first_shard(p)
    if first is None or p.device_mesh.ndim - first > 1:
        return None
    return first


def group_of(p: torch.Tensor) -> dist.ProcessGroup | None:
    """The process group over which pieces of ``p`` are spread, if any: the mesh dimensions
    from the first that shards it on. Under HSDP (a leading Replicate dimension) that leaves the
    replicas out, which already agree; on a (dp, tp) mesh it is the whole mesh's; on an HSDP
    mesh with tensor parallelism, (replicate, shard, tp), each replica's (shard, tp) ranks."""
    if not is_dtensor(p):
        return None
    first = _first_shard(p)
    if first is None:
        return None
    mesh = p.device_mesh
    if mesh.ndim - first == 1:
        return mesh.get_group(mesh_dim=first)
    if first == 0:
        return _whole_group(mesh)
    return _inner_group(mesh, first)


def is_copy(p: torch.Tensor) -> bool:
    """Whether this rank's piece of ``p`` is a copy of another rank's in ``group_of(p)`` (a
    nonzero coordinate on a Replicate mesh dim inside the group: a norm's tp copies): such a
    piece adds nothing to the statistics and histogram the group sums."""
    if not is_dtensor(p):
        return False
    first = _first_shard(p)
    if first is None:
        return False
    coord = p.device_mesh.get_coordinate()
    return any(
        isinstance(pl, Replicate) and coord[i] != 0
        for i, pl in enumerate(p.placements)
        if i > first
    )


def replica_group_of(p: torch.Tensor) -> dist.ProcessGroup | None:
    """The group of ranks holding copies of this rank's piece of ``p`` in other replica groups
    (HSDP's replicate mesh dimension), if any; ``None`` where the mesh has no such dimension
    (copies inside one group, ``is_copy``, write entries of their own)."""
    first = _first_shard(p) if is_dtensor(p) else None
    if not first:
        return None
    return p.device_mesh.get_group(mesh_dim=0)
