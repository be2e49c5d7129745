"""Shared by the HSDP torchrun scripts: the 2 x 2 layouts on 4 ranks, and digests of what a rank
holds, so that replicas can be checked for the same bits.

Layouts (``wrap``): "hsdp2", FSDP2 on a (replicate=2, shard=2) mesh; "fsdp2_shard", FSDP2 on the
mesh's 1-D shard dimension alone (the same shard boundaries, each replica group on its own);
"fsdp2_world", FSDP2 over all 4 ranks; "hybrid" and "hybrid_orig", FSDP1 HYBRID_SHARD with flat
and original parameters; "hybrid_zero2", FSDP1 _HYBRID_SHARD_ZERO2 with original parameters.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
from fsdp_common import build
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy, fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from gefen_dist.demo.model import Block

SHAPE = (2, 2)
FSDP1 = {
    "hybrid": (ShardingStrategy.HYBRID_SHARD, False),
    "hybrid_orig": (ShardingStrategy.HYBRID_SHARD, True),
    "hybrid_zero2": (ShardingStrategy._HYBRID_SHARD_ZERO2, True),
}


def mesh2d() -> DeviceMesh:
    return init_device_mesh("cpu", SHAPE, mesh_dim_names=("replicate", "shard"))


def fully_shard_on(kind: str, model: torch.nn.Module, mesh: DeviceMesh) -> None:
    if kind == "gpt":
        for b in model.transformer.h:
            fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)


def wrap(kind: str, setup: str) -> torch.nn.Module:
    model = build(kind)
    if setup in FSDP1:
        strategy, orig = FSDP1[setup]
        return FSDP(
            model,
            auto_wrap_policy=ModuleWrapPolicy({Block}) if kind == "gpt" else None,
            use_orig_params=orig,
            device_id=torch.device("cpu"),
            sharding_strategy=strategy,
            device_mesh=mesh2d(),
        )
    if setup == "hsdp2":
        mesh = mesh2d()
    elif setup == "fsdp2_shard":
        mesh = mesh2d()["shard"]
    elif setup == "fsdp2_world":
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    else:
        raise ValueError(setup)
    fully_shard_on(kind, model, mesh)
    return model


def _hash(h, t: torch.Tensor) -> None:
    t = t.detach().cpu().contiguous().reshape(-1)
    h.update(f"{t.dtype}:{t.numel()};".encode())
    h.update(t.view(torch.uint8).numpy().tobytes())


def state_digest(opt) -> str:
    """sha256 over this rank's Gefen state tensors, in parameter order."""
    h = hashlib.sha256()
    for g in opt.param_groups:
        for p in g["params"]:
            for k, v in sorted(opt.state.get(p, {}).items()):
                h.update(k.encode())
                _hash(h, v)
    return h.hexdigest()


def param_digest(opt) -> str:
    """sha256 over this rank's pieces of the parameters it steps."""
    h = hashlib.sha256()
    for g in opt.param_groups:
        for p in g["params"]:
            _hash(h, p._local_tensor if hasattr(p, "_local_tensor") else p)
    return h.hexdigest()


def groups(opt) -> dict:
    """The global ranks of the optimizer's process group (the shard group under HSDP)."""
    return dict(shard_group=dist.get_process_group_ranks(opt.process_group) if opt.process_group else None)
