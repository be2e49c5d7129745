"""Shared by the torchrun scripts: the tiny models, their batches, and a single-process reference.

Every rank builds the same model from seed 0 and the same global batch per step; a distributed
rank trains on its slice of the batch (``rows``), the reference on all of it, so with a mean loss
the averaged gradient equals the reference gradient up to fp32 rounding.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from gefen_dist import Gefen
from gefen_dist.demo.model import GPT, Block, GPTConfig
from gefen_dist.method.partition import matrix_batch

torch.set_num_threads(1)

TINY = GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=64)
BATCH = 8
HYPER = dict(lr=3e-3, weight_decay=0.1)


class Odd(nn.Module):
    """Shapes that shard unevenly on 2 ranks: dim 0 of 101 rows, 6363 + 707 + 7 elements in all
    (odd, so FSDP1 pads its flat shard), and a 101x63 weight large enough to get blocks. Its
    inputs have fixed gains of 0.1 to 10 in shuffled order, so its g0 varies by column and it
    takes column blocks, which FSDP2's row split cuts (each rank keeps v per column it holds)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(63, 101, bias=False)
        self.out = nn.Linear(101, 7)
        order = torch.randperm(63, generator=torch.Generator().manual_seed(0))
        self.register_buffer("gain", torch.logspace(-0.15, 0.15, 63)[order], persistent=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pred = self.out(torch.tanh(self.fc(x * self.gain)))
        return pred, F.mse_loss(pred, y)


def build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return GPT(TINY) if kind == "gpt" else Odd()


def batch(kind: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    if kind == "gpt":
        x = torch.randint(0, 256, (BATCH, TINY.block_size), generator=g)
        return x, torch.roll(x, -1, dims=1)
    x = torch.randn(BATCH, 63, generator=g)
    return x, torch.randn(BATCH, 7, generator=g)


def shard(kind: str, model: torch.nn.Module) -> None:
    """FSDP2 as the tests use it: each transformer block, then the root."""
    if kind == "gpt":
        for b in model.transformer.h:
            fully_shard(b)
    fully_shard(model)


def wrap(kind: str, setup: str) -> torch.nn.Module:
    model = build(kind)
    if setup == "fsdp2":
        shard(kind, model)
        return model
    policy = ModuleWrapPolicy({Block}) if kind == "gpt" else None
    return FSDP(
        model,
        auto_wrap_policy=policy,
        use_orig_params=setup == "fsdp1_orig",
        device_id=torch.device("cpu"),
    )


def full_params(model: torch.nn.Module, setup: str) -> dict[str, torch.Tensor]:
    if setup.startswith("fsdp2"):
        return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    with FSDP.summon_full_params(model):
        return {
            n.replace("_fsdp_wrapped_module.", ""): p.detach().clone()
            for n, p in model.named_parameters()
        }


def cut_blocks(opt: Gefen) -> int:
    """Blocks that a shard boundary cuts on this rank: each piece keeps its own v and absmax."""
    n = 0
    for p, st in opt.state.items():
        # a column block lies in one matrix of a batch of matrices (partition.matrix_batch)
        whole = {s.offset: _matrix_numel(s) for s in opt.segments_of(p)}
        for offset, numel, start, bs, _ in st["layout"].tolist():
            if bs > 1 and numel:
                n += int(start % bs != 0) + int((start + numel) % bs != 0)
            elif bs < 0 and 0 < numel < whole[offset]:  # a piece of a column is its own block
                n += min(numel, -bs)
    return n


def _matrix_numel(seg) -> int:
    batch = matrix_batch(seg.shape)
    return batch.numel if batch is not None else seg.tensor_numel


def padding(opt: Gefen) -> int:
    """Elements of FSDP padding on this rank (unnamed segments), kept as B = 1 state."""
    return sum(
        seg.numel for p in opt.state for seg in opt.segments_of(p) if not seg.name and seg.numel
    )


def rows(t: torch.Tensor) -> torch.Tensor:
    """This rank's slice of a global batch."""
    n = t.shape[0] // dist.get_world_size()
    return t[dist.get_rank() * n : (dist.get_rank() + 1) * n]


def global_loss(loss: torch.Tensor) -> float:
    t = loss.detach().clone()
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def train(kind: str, model, opt, first: int, steps: int, split: bool = True) -> list[float]:
    """Steps ``first .. first + steps``; ``split``: each rank takes its rows of the batch (data
    parallel), else every rank the whole batch. Returns the loss averaged over ranks."""
    losses = []
    for s in range(first, first + steps):
        opt.zero_grad()
        x, y = batch(kind, s)
        if split:
            x, y = rows(x), rows(y)
        loss = model(x, y)[1]
        loss.backward()
        opt.step()
        losses.append(global_loss(loss))
    return losses


def gefen(params, bits: int) -> Gefen:
    """Gefen as a user builds it; GEFEN_BACKEND=reference pins the update backend, to tell
    an integration fault from a kernel one."""
    opt = Gefen(params, bits=bits, **HYPER)
    if os.environ.get("GEFEN_BACKEND"):
        opt.backend = os.environ["GEFEN_BACKEND"]
    return opt


def reference(kind: str, steps: int, bits: int) -> dict:
    """Single-process Gefen on the whole batch: losses, codebook, block size per tensor, params."""
    model = build(kind)
    opt = gefen(list(model.named_parameters()), bits)
    losses = []
    for s in range(steps):
        opt.zero_grad()
        loss = model(*batch(kind, s))[1]
        loss.backward()
        opt.step()
        losses.append(loss.item())
    names = {p: n for n, p in model.named_parameters()}
    blocks = {names[p]: int(st["layout"][0, 3]) for p, st in opt.state.items()}
    codebook = next(iter(opt.state.values()))["codebook"]
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state_bytes = opt.memory_report()["state_bytes"]
    return dict(
        losses=losses, blocks=blocks, codebook=codebook, params=params, state_bytes=state_bytes
    )


def block_sizes(opt: Gefen) -> dict[str, int]:
    """Block size per named tensor piece on this rank (padding segments have no name)."""
    out = {}
    for p, st in opt.state.items():
        segs = opt.segments_of(p)
        for seg, row in zip(segs, st["layout"].tolist(), strict=True):
            if seg.name and seg.numel:
                out[seg.name] = int(row[3])
    return out


def codebooks(opt: Gefen) -> list[list[float]]:
    """Every parameter's codebook on this rank, distinct ones only."""
    seen = []
    for st in opt.state.values():
        c = st["codebook"].tolist()
        if c not in seen:
            seen.append(c)
    return seen


def write(out: str, result: dict) -> None:
    Path(out).mkdir(parents=True, exist_ok=True)
    path = Path(out) / f"rank{dist.get_rank()}.json"
    path.write_text(json.dumps(result, indent=1, sort_keys=True))


def init() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo")


def jobs(argv: list[str]):
    """The jobs of a command line joined by ``+`` (one launch's start-up for several), each as
    its list of words, in order."""
    while argv:
        if "+" in argv:
            cut = argv.index("+")
            yield argv[:cut]
            argv = argv[cut + 1 :]
        else:
            yield argv
            argv = []
