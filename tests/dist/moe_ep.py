"""Expert parallelism as torchtitan lays it out, on 4 ranks: a (dp_mod_ep=2, ep=2) mesh.

argv: OUT. The experts of each layer are a submodule (``experts``: w1/w3 (E, F, D), w2 (E, D, F))
whose weights are DTensors sharded on dim 0 over ``ep`` and then by FSDP2 over ``dp_mod_ep``
(placements (_StridedShard(0), Shard(0)) on the 2-D mesh: each rank holds 2 of 8 experts); every
other parameter is FSDP2-sharded over the flattened 4-rank ``dp_shard`` mesh. The MoE layer
gathers its ep group's tokens, computes its own experts' outputs for all of them, and sums the
outputs over ``ep`` (what torchtitan's all-to-all dispatch computes, with all tokens sent to
every expert rank). ``Gefen(model.parameters())`` with nothing else.

Writes rank{r}.json: ``ref`` (one process, the whole global batch: losses, block sizes, codebook),
``ep`` (data parallel, each rank a quarter: global losses, block sizes, codebook, the layout of
one expert tensor), and ``resumed``: a ``dcp.save`` at SAVE_AT, loaded into a fresh model and
Gefen with ``dcp.load``, on to STEPS; ``other_mesh``: the same checkpoint loaded the same way on
a (1, 4) mesh, where each rank holds two other experts. The test consolidates that checkpoint
and resumes it in one process.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from fsdp_common import codebooks, init, write
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from gefen_dist import Gefen
from gefen_dist.bench.moe import MoEConfig, MoEFeedForward, MoELM
from teardown import finish

CONFIG = MoEConfig(dim=64, n_layers=2, n_heads=2, n_experts=8, top_k=2, hidden=80, seq=16)
STEPS, SAVE_AT, BITS, BATCH = 8, 4, 4, 8
HYPER = dict(lr=3e-3, weight_decay=0.1, bits=BITS)


class _Gather(torch.autograd.Function):
    """The ep group's tokens, concatenated in rank order; the gradient of this rank's slice is
    the sum over the group of that slice's gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        n = grad.shape[0] // dist.get_world_size(ctx.group)
        me = dist.get_rank(ctx.group)
        return grad[me * n : (me + 1) * n], None


class _Sum(torch.autograd.Function):
    """The sum over the ep group; each rank's partial gets the sum's gradient, which is itself
    the sum of every rank's (each rank's loss reads its own slice)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _Scale(torch.autograd.Function):
    """Identity forward; the gradient times ``k``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, k: float) -> torch.Tensor:
        ctx.k = k
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.k, None


class GroupedExperts(nn.Module):
    """torchtitan's ``GroupedExperts``: w1/w3 (E, F, D), w2 (E, D, F), called by the MoE layer
    (FSDP2 gathers a module's parameters when it is called). Under expert parallelism its
    weights hold this ep rank's experts, from global index ``first``."""

    def __init__(self, w1: nn.Parameter, w2: nn.Parameter, w3: nn.Parameter):
        super().__init__()
        self.w1, self.w2, self.w3 = w1, w2, w3

    def forward(
        self, xs: torch.Tensor, chosen: torch.Tensor, weight: torch.Tensor, rank: int, ep: int
    ) -> torch.Tensor:
        # each expert sees the ep group's tokens, so its gradient sums the ep ranks' losses,
        # and FSDP averages it over dp_mod_ep only: 1 / ep makes it the mean over every rank
        # (FSDP's set_gradient_divide_factor would, but gloo has no PREMUL_SUM)
        w1, w2, w3 = (
            _Scale.apply(w.to_local() if isinstance(w, DTensor) else w, 1.0 / ep)
            for w in self.parameters()
        )
        local = w1.shape[0]
        out = torch.zeros_like(xs)
        for j in range(local):
            tok, slot = torch.nonzero(chosen == rank * local + j, as_tuple=True)
            if tok.numel() == 0:
                continue
            h = xs[tok]
            y = F.linear(F.silu(F.linear(h, w1[j])) * F.linear(h, w3[j]), w2[j])
            out.index_add_(0, tok, y * weight[tok, slot, None])
        return out


class ExpertParallel(MoEFeedForward):
    """``MoEFeedForward`` (grouped storage) with its experts in a ``GroupedExperts`` submodule,
    computing, under expert parallelism (``group``: the ep group), only this rank's experts."""

    group: dist.ProcessGroup | None = None
    w1 = property(lambda self: self.experts.w1)
    w2 = property(lambda self: self.experts.w2)
    w3 = property(lambda self: self.experts.w3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return super().forward(x)
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        n, me = x.shape[0], dist.get_rank(self.group)
        xs = _Gather.apply(x, self.group)  # the ep group's tokens
        probs = F.softmax(self.router(xs), dim=-1)
        weight, chosen = probs.topk(self.top_k, dim=-1)
        weight = weight / weight.sum(-1, keepdim=True)
        out = self.experts(xs, chosen, weight, me, dist.get_world_size(self.group))
        out = _Sum.apply(out, self.group)  # each token's experts, wherever they are
        return out[me * n : (me + 1) * n].reshape(shape)


def build() -> MoELM:
    torch.manual_seed(0)
    model = MoELM(CONFIG)
    for layer in model.layers:
        moe = layer.moe
        weights = [moe._parameters.pop(name) for name in ("w1", "w2", "w3")]
        moe.__class__ = ExpertParallel
        moe.experts = GroupedExperts(*weights)
    return model


def parallelize(model: MoELM, shape: tuple[int, int] = (2, 2)) -> None:
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp_mod_ep", "ep"))
    dp = mesh._flatten("dp_shard")
    for layer in model.layers:
        experts = layer.moe.experts
        for name in ("w1", "w2", "w3"):
            w = getattr(experts, name)
            setattr(experts, name, nn.Parameter(distribute_tensor(w.data, mesh["ep"], [Shard(0)])))
        fully_shard(experts, mesh=mesh["dp_mod_ep"])
        layer.moe.group = mesh["ep"].get_group()
        fully_shard(layer, mesh=dp)
    fully_shard(model, mesh=dp)


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(3000 + step)
    return torch.randint(0, 256, (BATCH, CONFIG.seq + 1), generator=g)


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1))


def train(model, opt, first: int, last: int, parallel: bool) -> list[float]:
    losses = []
    for s in range(first, last):
        opt.zero_grad()
        tokens = batch(s)
        if parallel:
            k = BATCH // dist.get_world_size()
            tokens = tokens[dist.get_rank() * k : (dist.get_rank() + 1) * k]
        loss = loss_of(model, tokens)
        loss.backward()
        opt.step()
        if parallel:
            loss = loss.detach().clone()
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        losses.append(loss.item())
    return losses


def blocks_of(model: nn.Module, opt: Gefen) -> dict[str, int]:
    return {n: int(opt.state[p]["layout"][0, 3]) for n, p in model.named_parameters()}


def reference() -> dict:
    model = build()
    opt = Gefen(model.parameters(), **HYPER)
    losses = train(model, opt, 0, STEPS, parallel=False)
    return dict(losses=losses, blocks=blocks_of(model, opt), codebooks=codebooks(opt))


def expert_parallel(out: str) -> dict:
    model = build()
    parallelize(model)
    opt = Gefen(model.parameters(), **HYPER)
    losses = train(model, opt, 0, SAVE_AT, parallel=True)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{out}/dcp")
    losses += train(model, opt, SAVE_AT, STEPS, parallel=True)
    w2 = model.layers[0].moe.experts.w2
    result = dict(
        losses=losses,
        blocks=blocks_of(model, opt),
        codebooks=codebooks(opt),
        placements=[str(p) for p in w2.placements],
        w2_layout=opt.state[w2]["layout"].tolist(),
    )
    fresh = build()
    parallelize(fresh)
    opt2 = Gefen(fresh.parameters(), **HYPER)
    msd, osd = get_state_dict(fresh, opt2)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=f"{out}/dcp")
    set_state_dict(fresh, opt2, model_state_dict=msd, optim_state_dict=osd)
    result["resumed"] = train(fresh, opt2, SAVE_AT, STEPS, parallel=True)
    # the same checkpoint on a (1, 4) mesh, each rank 2 other experts, with plain DCP
    other = build()
    parallelize(other, (1, 4))
    opt3 = Gefen(other.parameters(), **HYPER)
    msd, osd = get_state_dict(other, opt3)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=f"{out}/dcp")
    set_state_dict(other, opt3, model_state_dict=msd, optim_state_dict=osd)
    result["other_mesh"] = train(other, opt3, SAVE_AT, STEPS, parallel=True)
    return result


def main() -> None:
    out = sys.argv[1]
    init()
    write(out, {"ref": reference(), "ep": expert_parallel(out)})


if __name__ == "__main__":
    main()
    finish()
