"""What the Gefen optimizer inside a DeepSpeed engine holds on this rank: its memory and the
block size of each tensor it steps a piece of."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from deepspeed.runtime.engine import DeepSpeedEngine

from ...method.state import layout_rows
from .binding import stepped
from .meta import placement

__all__ = ["block_sizes", "memory_report"]


def _unsharded_meta(engine: Any) -> dict[str, Any]:
    """Every data-parallel rank keeps the whole state; the world size says over how many."""
    if not dist.is_initialized():
        return placement("ZeRO-0", 0, 1)
    group = engine.seq_data_parallel_group if isinstance(engine, DeepSpeedEngine) else None
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    return placement("ZeRO-0", rank, world)


def memory_report(engine: Any) -> dict[str, Any]:
    """``Gefen.memory_report()`` of this rank's partitions, with the wrapper, rank and world size.

    ``adamw_bytes`` is what AdamW keeps for the same partitions under the same ZeRO stage; under
    ZeRO-0 (``wrapper`` "ZeRO-0") every rank holds the whole model's state."""
    gefen, b = stepped(engine)
    if b is None:
        return {**gefen.memory_report(), **_unsharded_meta(engine)}
    return {**b.with_all_params(b.gefen.memory_report), **b.meta()}


def block_sizes(engine: Any) -> dict[str, int]:
    """Block size chosen for each original tensor with a piece on this rank, by parameter name."""
    gefen, b = stepped(engine)
    if b is not None:
        return b.block_sizes()
    module = engine.module if isinstance(engine, DeepSpeedEngine) else None
    names = {id(p): n for n, p in module.named_parameters()} if module is not None else {}
    return {
        names.get(id(p)) or gefen.name_of(p): layout_rows(st)[0].block
        for p, st in gefen.state.items()
        if st
    }
