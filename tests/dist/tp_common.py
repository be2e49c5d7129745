"""Shared by the tensor-parallel torchrun scripts: a tiny Llama-style block, and FSDP2 over dp
with tensor parallelism on tp on a (dp=2, tp=2) mesh of 4 ranks.

The block: RMSNorm, attention (q/k/v ColwiseParallel, o RowwiseParallel), RMSNorm, a SwiGLU MLP
(gate/up ColwiseParallel, down RowwiseParallel). The norms are replicated on tp (their weights
Replicate DTensors, activations whole on every tp rank), then every module is fully_shard'ed over
dp: the q/k/v/gate/up weights become (_StridedShard(0), Shard(0)), the o/down weights
(Shard(0), Shard(1)) (some columns of every row on each rank), the norms (Shard(0), Replicate()).

``parallelize(..., sequence_parallel=True)``: the torchtitan-style plan. The residual stream is
sharded on the sequence (Shard(1)) between the sublayers: ``SequenceParallel()`` on the norms,
``PrepareModuleInput(Shard(1) -> Replicate())`` on attn and mlp (an all-gather of the sequence
before q/k/v and gate/up), ``RowwiseParallel(output_layouts=Shard(1))`` on o and down (a
reduce-scatter back to the sequence shard). The block's input and target are this tp rank's
``seq_shard``, so its loss is a mean over half the sequence; ``train(..., sp=True)`` divides it
by tp before backward. The tp collectives' backward sums the tp ranks' gradients, and the norms'
Replicate weights, whose gradients each tp rank computes from its sequence shard only, come out
summed over tp too: with the division every first-step gradient, the norms' included, is the
single-process one within 4.5e-7 relative (measured, tp_train.py's "grad_drift"), without it
exactly twice. Then the same fully_shard over dp, giving the same placements as the first plan.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from fsdp_common import BATCH, global_loss
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

DIM, HEADS, HIDDEN, SEQ = 64, 4, 96, 8
SHAPE = (2, 2)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(DIM, DIM, bias=False) for _ in range(3))
        self.o = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        hd = DIM // HEADS
        # under ColwiseParallel each rank holds its heads: the head count is the local one
        q, k, v = (m(x).view(b, t, -1, hd).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(DIM, HIDDEN, bias=False)
        self.up = nn.Linear(DIM, HIDDEN, bias=False)
        self.down = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Llama(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(DIM)
        self.attn = Attention()
        self.mlp_norm = nn.RMSNorm(DIM)
        self.mlp = MLP()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x + self.attn(self.attn_norm(x))
        h = h + self.mlp(self.mlp_norm(h))
        return h, F.mse_loss(h, y)


def build() -> Llama:
    torch.manual_seed(0)
    model = Llama()
    with torch.no_grad():
        for n in (model.attn_norm, model.mlp_norm):  # not all ones: a gradient with structure
            n.weight.uniform_(0.5, 1.5)
    return model


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + step)
    return torch.randn(BATCH, SEQ, DIM, generator=g), torch.randn(BATCH, SEQ, DIM, generator=g)


def mesh2d(shape: tuple[int, int] = SHAPE) -> DeviceMesh:
    return init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))


def _replicate_in(_mod, inputs, mesh):
    return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs)


def _local_out(_mod, out, _mesh):
    return out.to_local()


def parallelize(
    model: Llama,
    mesh: DeviceMesh,
    sequence_parallel: bool = False,
    attention_only: bool = False,
    dp: tuple[str, ...] = ("dp",),
) -> Llama:
    """TP on mesh["tp"], then FSDP2 on mesh["dp"]. ``sequence_parallel``: the torchtitan-style
    plan, the residual stream Shard(1) between the sublayers (feed it ``seq_shard`` inputs).
    ``attention_only``: tensor parallelism on attention's linear layers only; the norms and the
    MLP stay plain modules, so FSDP2 makes their weights DTensors on the 1-D dp mesh (Shard(0)):
    a group of 2 ranks inside the attention weights' 4, with a replica on each tp rank.
    ``dp``: the mesh dimensions FSDP2 shards over (("replicate", "shard"): HSDP)."""
    tp = mesh["tp"]
    out = dict(output_layouts=Shard(1)) if sequence_parallel else {}
    colwise, rowwise = ["attn.q", "attn.k", "attn.v"], ["attn.o"]
    if not attention_only:
        colwise, rowwise = colwise + ["mlp.gate", "mlp.up"], rowwise + ["mlp.down"]
    plan = {n: ColwiseParallel() for n in colwise}
    plan |= {n: RowwiseParallel(**out) for n in rowwise}
    if sequence_parallel:
        for norm, sub in (("attn_norm", "attn"), ("mlp_norm", "mlp")):
            plan[norm] = SequenceParallel()
            plan[sub] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            )
    parallelize_module(model, tp, plan)
    if not sequence_parallel and not attention_only:
        for norm in (model.attn_norm, model.mlp_norm):
            distribute_module(norm, tp, input_fn=_replicate_in, output_fn=_local_out)
    for m in (model.attn, model.mlp, model):
        fully_shard(m, mesh=mesh[dp] if len(dp) > 1 else mesh[dp[0]])
    return model


def dp_rows(t: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """This dp rank's slice of a global batch (tp ranks of one dp rank take the same rows)."""
    n, r = mesh["dp"].size(), mesh["dp"].get_local_rank()
    k = t.shape[0] // n
    return t[r * k : (r + 1) * k]


def seq_shard(t: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """This tp rank's slice of the sequence (dim 1), the residual stream's Shard(1) piece."""
    n, r = mesh["tp"].size(), mesh["tp"].get_local_rank()
    k = t.shape[1] // n
    return t[:, r * k : (r + 1) * k]


def train(
    model,
    opt,
    first: int,
    steps: int,
    mesh: DeviceMesh | None,
    split: bool,
    sp: bool = False,
    grads: dict | None = None,
) -> list:
    """Steps ``first .. first + steps``: the mean loss over ranks per step (one process when
    ``mesh`` is None); ``split``: each dp rank on its rows of the batch; ``sp`` (the
    ``sequence_parallel`` plan): each tp rank on its ``seq_shard`` of those rows, backward
    through its loss over 1/tp of the sequence divided by tp (the tp ranks' gradients come out
    summed, the norms' included), the recorded loss undivided
    (its mean over ranks is the whole batch's). ``grads``: filled with the first step's whole
    gradients (``grad_of``), before the optimizer step."""
    losses = []
    for s in range(first, first + steps):
        opt.zero_grad()
        x, y = batch(s)
        if split and mesh is not None:
            x, y = dp_rows(x, mesh), dp_rows(y, mesh)
        if sp:
            x, y = seq_shard(x, mesh), seq_shard(y, mesh)
        loss = model(x, y)[1]
        (loss / mesh["tp"].size() if sp else loss).backward()
        if grads is not None and s == first:
            grads.update({n: grad_of(p) for n, p in model.named_parameters()})
        opt.step()
        losses.append(loss.item() if mesh is None else global_loss(loss))
    return losses


def grad_of(p: nn.Parameter) -> torch.Tensor:
    """A parameter's whole gradient (a collective on every rank for a DTensor one)."""
    g = p.grad
    return (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in model.named_parameters()
    }


def world() -> int:
    return dist.get_world_size()
