"""``gefen_dist.check_gradients``: refuse a step with a non-finite gradient, on every rank at once.

Why opt-in and not part of every step: ``method/load_check.py``'s docstring (a read of every
gradient costs 0.2-0.3 of a CPU step). At the first step Gefen refuses by itself
(``first_step``), since that gradient chooses the blocks and the codebook.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .distributed import sharding
from .distributed.collectives import comm_device


def check_gradients(optimizer: Any) -> None:
    """Refuse, before ``optimizer.step()``, a step whose gradients hold NaN or inf: raises
    ValueError naming the parameters, on every rank of the optimizer's process group where any
    rank holds one, so that ranks skip or stop together instead of leaving the others waiting
    in the step's collectives. Nothing is written: call it before ``step()``, and skip the step
    with ``zero_grad()`` where it raises. Why opt-in: its read of every gradient costs 0.2-0.3
    of a CPU step (module docstring). One fused norm per device, then ``isfinite`` only on the
    gradients whose norm is not finite: a norm also overflows for finite |g| of 2**64 /
    sqrt(numel), which are not refused."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    grads = [sharding.local(p.grad) for p in params]
    bad: list[str] = []
    by_device: dict[torch.device, list[int]] = {}
    for i, g in enumerate(grads):
        if g.numel():
            by_device.setdefault(g.device, []).append(i)
    for idx in by_device.values():
        norms = torch.stack(torch._foreach_norm([grads[i] for i in idx])).float()
        suspect = (~torch.isfinite(norms)).nonzero().view(-1).tolist()
        for j in suspect:
            i = idx[j]
            if not bool(torch.isfinite(grads[i]).all()):
                bad.append(optimizer.name_of(params[i]))
    group = getattr(optimizer, "process_group", None)
    anywhere = bool(bad)
    if group is not None:
        flag = torch.tensor([int(anywhere)], device=comm_device(group))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        anywhere = bool(flag.item())
    if anywhere:
        where = ", ".join(bad) if bad else "a parameter on another rank"
        raise ValueError(
            f"non-finite gradient in {where}: the step would write NaN/inf into Gefen's state "
            "and the parameters (check the loss; zero_grad() and skip the step to go on)"
        )
