"""Pure-bf16 weights with ``bf16_stochastic_round`` under DDP and FSDP2 on 2 ranks, against one
process.

argv: OUT STEPS. A small language model in bf16 (weights, hence gradients, in bf16; FSDP2
without a MixedPrecisionPolicy, so no fp32 master anywhere), every rank on the whole batch, so
DDP's and FSDP2's averaged gradient is bitwise the single-process one. The write's draw depends
only on (step, the element's index in its tensor), so DDP must end with the single-process
parameters bit for bit, and FSDP2 likewise wherever no shard boundary cuts a block: a cut block
keeps a v and absmax per piece, which changes the update itself, rounding or not (and, through
the loss, every tensor's later steps). Its matrices have power-of-two rows, so the halves
usually cut nothing; where a block rule cuts one, only the first step of each uncut tensor is
comparable, and the test says which held. Each rank writes per parameter whether the full
tensor equals the single-process one after the first step and after all, and whether some
rank's piece of it cut a block; and how many elements stochastic rounding changed against the
same run with nearest rounding (the option must reach the sharded path).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from fsdp_common import HYPER, batch, init, write
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from gefen_dist import Gefen
from teardown import finish


class Lm(nn.Module):
    """Next-byte prediction through one residual MLP: matrices of 2^k rows and columns, biases
    and a norm (B = 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, 128)
        self.ln = nn.LayerNorm(128)
        self.fc = nn.Linear(128, 512)
        self.proj = nn.Linear(512, 128)
        self.head = nn.Linear(128, 256, bias=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.emb(x)
        h = h + self.proj(F.gelu(self.fc(self.ln(h))))
        logits = self.head(h).float()
        return logits, F.cross_entropy(logits.view(-1, 256), y.reshape(-1))


def bf16_model(setup: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = Lm().to(torch.bfloat16)
    if setup == "ddp":
        return DDP(model)
    if setup == "fsdp2":
        fully_shard(model)
    return model


def train(model: torch.nn.Module, opt: Gefen, steps: int) -> None:
    for s in range(steps):
        opt.zero_grad()
        model(*batch("gpt", s))[1].backward()
        opt.step()


def full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for n, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[n.removeprefix("module.")] = t.detach().clone()
    return out


def cut(opt: Gefen) -> dict[str, bool]:
    """Per parameter: whether some rank's piece of it starts or ends inside a block."""
    names = {
        p: n for g in opt.param_groups for n, p in zip(g["param_names"], g["params"], strict=True)
    }
    mine = {}
    for p, st in opt.state.items():
        flag = False
        for _, numel, start, bs, _ in st["layout"].tolist():
            if bs > 1 and numel:
                flag |= start % bs != 0 or (start + numel) % bs != 0
            elif bs < 0 and numel < p.numel():
                flag = True
        mine[names[p]] = flag
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {n: any(r.get(n, False) for r in every) for n in mine}


def run(setup: str, steps: int, stochastic: bool) -> tuple[list[dict], Gefen]:
    """The full parameters after the first step and after ``steps``."""
    model = bf16_model(setup)
    inner = model.module if setup == "ddp" else model
    opt = Gefen(list(inner.named_parameters()), bf16_stochastic_round=stochastic, **HYPER)
    train(model, opt, 1)
    first = full(inner)
    train(model, opt, steps - 1)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    return [first, full(inner)], opt


def main() -> None:
    out, steps = sys.argv[1], int(sys.argv[2])
    init()
    ref, _ = run("single", steps, True)
    ref_nearest, _ = run("single", steps, False)
    result = {}
    for setup in ("ddp", "fsdp2"):
        params, opt = run(setup, steps, True)
        nearest, _ = run(setup, steps, False)
        names = list(params[0])
        result[setup] = dict(
            first_equal={n: torch.equal(params[0][n], ref[0][n]) for n in names},
            equal={n: torch.equal(params[1][n], ref[1][n]) for n in names},
            cut=cut(opt) if setup == "fsdp2" else {n: False for n in names},
            nearest_equal={n: torch.equal(nearest[1][n], ref_nearest[1][n]) for n in names},
            rounding_changed=sum(int((params[1][n] != nearest[1][n]).sum()) for n in names),
            blocks=sorted({r[3] for st in opt.state.values() for r in st["layout"].tolist()}),
            backend=opt.memory_report()["backend"],
        )
    write(out, result)


if __name__ == "__main__":
    main()
    finish()
