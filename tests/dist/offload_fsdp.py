"""Gefen under FSDP2 with ``CPUOffloadPolicy`` on 2 ranks: the host shards' backend, and the run
against the same run without offload.

argv: OUT STEPS. The policy keeps each rank's shards (and so Gefen's state) on the host and
moves them to the compute device for forward and backward; on a machine without an accelerator
it must be built with ``pin_memory=False`` (pinning needs one), and both runs compute on the
CPU. Gefen picks an update per parameter from its local tensor's device
(``Gefen.backend_of``): host DTensors take the C++ kernel. With the same sharding the two runs
step the same numbers, so they must agree bit for bit: parameters, losses and state.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from ddp_equivalence import state_digest
from fsdp_common import build, gefen, init, train, write
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from teardown import finish


def run(steps: int, offload: bool) -> dict:
    model = build("gpt")
    kw = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if offload else {}
    for b in model.transformer.h:
        fully_shard(b, **kw)
    fully_shard(model, **kw)
    opt = gefen(model.parameters(), 4)
    losses = train("gpt", model, opt, 0, steps)
    named = list(model.named_parameters())
    return dict(
        losses=losses,
        backends={n: opt.backend_of(p) for n, p in named},
        local_devices={n: p.to_local().device.type for n, p in named},
        dtensor=all(type(p).__name__ == "DTensor" for _, p in named),
        params={n: p.to_local().detach().clone() for n, p in named},
        digest=state_digest(opt),
        report_backend=opt.memory_report()["backend"],
    )


def main() -> None:
    out, steps = sys.argv[1], int(sys.argv[2])
    init()
    plain, off = run(steps, False), run(steps, True)
    equal = {n: torch.equal(plain["params"][n], off["params"][n]) for n in plain["params"]}
    for r in (plain, off):
        del r["params"]
    write(out, dict(plain=plain, offload=off, params_equal=equal))


if __name__ == "__main__":
    main()
    finish()
