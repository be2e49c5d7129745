"""The optimizer a run config names, and the one that actually updates the weights once DeepSpeed
or Accelerate has wrapped it: the config check, the setups, the fault hook, the digest and the
results all need one or the other, and must agree on which.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import torch

from gefen_dist import Gefen


class StateBytes(NamedTuple):
    """What an optimizer holds on this rank: ``bytes`` of state, for ``params`` parameters."""

    bytes: int
    params: int


def build_optimizer(cfg: dict, params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    """Gefen or AdamW with the config's lr, betas and weight decay (and Gefen's bits)."""
    o = cfg["optimizer"]
    common = dict(lr=o["lr"], betas=tuple(o["betas"]), weight_decay=o["weight_decay"])
    if o["name"] == "adamw":
        return torch.optim.AdamW(params, **common)
    return Gefen(params, bits=o["bits"], **common)


def stepped(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that updates the weights, inside DeepSpeed's and Accelerate's wrappers."""
    while hasattr(opt, "optimizer"):
        opt = opt.optimizer
    return opt


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece: a DTensor's (FSDP2) numel() is the whole tensor's."""
    return t.to_local() if hasattr(t, "to_local") else t


def state_bytes(opt: torch.optim.Optimizer) -> StateBytes:
    """Optimizer-state bytes on this rank, and how many parameters they are for."""
    opt = stepped(opt)
    if isinstance(opt, Gefen):
        rep = opt.memory_report()
        return StateBytes(int(rep["state_bytes"]), int(rep["params"]))
    held = sum(
        local(v).numel() * v.element_size()
        for st in opt.state.values()
        for k, v in st.items()
        if torch.is_tensor(v) and k != "step"
    )
    return StateBytes(held, sum(local(p).numel() for p in opt.state))
