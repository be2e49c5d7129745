"""Gefen under FSDP1 (flat shards: pieces spread over ranks, their v_cross sums all-reduced,
blocks cut by the shard boundary) and DDP, its steps taken with torch's default device set to
meta and as usual: every rank writes whether both left the same parameters and state.

The meta default stands in for a default device other than the parameters' (a GPU run with a
CUDA default, as test_devices.py explains): a tensor the optimizer makes without naming a
device lands on meta and fails at its first use with a CPU one. FSDP2 is not run this way:
torch's own DTensor offsets are computed on the default device."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from fsdp_common import TINY
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

import gefen_dist.integrations.fsdp
from gefen_dist import Gefen
from gefen_dist.demo.model import GPT
from teardown import finish


def run(mode: str, default: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(TINY)
    if mode == "fsdp1":
        model = FSDP(model, device_id=torch.device("cpu"))
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = Gefen(model.parameters(), lr=3e-3, weight_decay=0.1, bits=4)
    if mode == "fsdp1":
        gefen_dist.integrations.fsdp.configure(model, opt)
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(3):
        x = torch.randint(0, 256, (2, TINY.block_size), generator=gen)
        opt.zero_grad(set_to_none=True)
        model(x, x)[1].backward()
        with torch.device(default):
            opt.step()
    state = [v for st in opt.state.values() for k, v in sorted(st.items()) if k != "layout"]
    return [p.detach().clone() for p in model.parameters()] + [v.clone() for v in state]


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    equal = {}
    for mode in ("fsdp1", "ddp"):
        want, got = run(mode, "cpu"), run(mode, "meta")
        equal[mode] = len(want) == len(got) and all(
            a.device == b.device and torch.equal(a, b) for a, b in zip(want, got, strict=True)
        )
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(equal))


if __name__ == "__main__":
    main()
    finish()
