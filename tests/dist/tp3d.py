"""Meshes of three dimensions on 4 ranks against single-process Gefen: HSDP with tensor
parallelism, FSDP2 on a (replicate, shard, tp) mesh; and a grouped expert weight on a
(dp_mod_ep, ep, tp) mesh, as expert parallelism with tensor-parallel experts lays it out.

argv: OUT STEPS BITS. For each shape of ``SHAPES``, the tiny Llama-style block of tp_common with
its TP plan on mesh["tp"] (norms Replicate on tp), then ``fully_shard`` over
mesh["replicate", "shard"]; each data-parallel rank (replicate x shard) trains on its rows of
the batch. Records per shape: the losses, block sizes, codebooks, placements and the
optimizer's group; and a DCP checkpoint saved at ``SAVE_AT`` and loaded by a fresh model and
optimizer in the same processes (``get_state_dict``, ``dcp.load``, ``set_state_dict``), whose
steps to STEPS are compared with the uninterrupted run's, state and parameters, bit for bit;
then each shape's checkpoint loaded the same way at the other shape ("2x1x2->1x2x2" and back),
whose losses from SAVE_AT on are recorded.
Under "reference", tp_train's single-process run of the same block. Under "ep_tp", an (E, F, D)
expert weight placed (Shard(0), Shard(0), Shard(1)) on a (2, 1, 2) mesh (experts over dp_mod_ep
and ep, F over tp) stepped with given gradients, against one process on the whole tensor: its
block sizes, codebook and final parameters.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsdp_checkpoint import equal_states, raw_state
from fsdp_common import codebooks, gefen, global_loss, init, write
from teardown import finish
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from tp_common import batch, build, full_params, parallelize
from tp_train import reference

SHAPES = ((2, 1, 2), (1, 2, 2))
SAVE_AT = 3


def setup(shape: tuple[int, int, int], bits: int):
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard", "tp"))
    model = parallelize(build(), mesh, dp=("replicate", "shard"))
    return mesh, model, gefen(model.parameters(), bits)


def rows(t: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """This data-parallel rank's rows (tp ranks of one (replicate, shard) coordinate share them)."""
    rep, shard = mesh["replicate"], mesh["shard"]
    n = rep.size() * shard.size()
    r = rep.get_local_rank() * shard.size() + shard.get_local_rank()
    k = t.shape[0] // n
    return t[r * k : (r + 1) * k]


def train(model, opt, mesh: DeviceMesh, first: int, last: int) -> list[float]:
    losses = []
    for s in range(first, last):
        opt.zero_grad()
        x, y = batch(s)
        loss = model(rows(x, mesh), rows(y, mesh))[1]
        loss.backward()
        opt.step()
        losses.append(global_loss(loss))
    return losses


def run(shape: tuple[int, int, int], steps: int, bits: int, ck: Path) -> dict:
    mesh, model, opt = setup(shape, bits)
    losses = train(model, opt, mesh, 0, SAVE_AT)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(ck))
    saved_state = raw_state(opt)
    losses += train(model, opt, mesh, SAVE_AT, steps)
    named = dict(model.named_parameters())
    result = dict(
        losses=losses,
        codebooks=codebooks(opt),
        blocks={
            n: sorted({int(r[3]) for r in opt.state[p]["layout"].tolist()})
            for n, p in named.items()
        },
        placements={n: str(tuple(p.placements)) for n, p in named.items()},
        group=dist.get_process_group_ranks(opt.process_group),
    )
    final = full_params(model)
    _, model, opt = setup(shape, bits)
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(ck))
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    resumed_state = equal_states(raw_state(opt), saved_state)
    resumed = train(model, opt, mesh, SAVE_AT, steps)
    again = full_params(model)
    result["resume"] = dict(
        state_exact=resumed_state,
        losses=resumed,
        params_exact=all(torch.equal(again[n], final[n]) for n in final),
    )
    return result


EXPERT = (4, 64, 64)  # E, F, D: matrices of 4096 elements, a batch of matrices


def expert_grad(step: int) -> torch.Tensor:
    """A gradient with a scale per expert and per column, as routed experts' have."""
    g = torch.Generator().manual_seed(4000 + step)
    scale = torch.logspace(-1, 1, EXPERT[0])[:, None, None] * torch.logspace(-0.5, 0.5, EXPERT[2])
    return torch.randn(EXPERT, generator=g) * scale


def expert_run(steps: int, bits: int, mesh: DeviceMesh | None) -> dict:
    torch.manual_seed(0)
    w = torch.randn(EXPERT) * 0.02
    placements = [Shard(0), Shard(0), Shard(1)]
    p = torch.nn.Parameter(w if mesh is None else distribute_tensor(w, mesh, placements))
    opt = gefen([("experts.w1", p)], bits)
    for s in range(steps):
        g = expert_grad(s)
        p.grad = g if mesh is None else distribute_tensor(g, mesh, placements)
        opt.step()
    full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
    return dict(
        blocks=sorted({int(r[3]) for r in opt.state[p]["layout"].tolist()}),
        codebook=codebooks(opt)[0],
        params=full.detach().clone(),
        group=None
        if opt.process_group is None
        else dist.get_process_group_ranks(opt.process_group),
        placements=str(tuple(p.placements)) if isinstance(p, DTensor) else None,
    )


def main() -> None:
    out, steps, bits = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    init()
    ref = reference(steps, bits)
    result: dict = {
        "x".join(map(str, shape)): run(shape, steps, bits, Path(out) / f"ck{i}")
        for i, shape in enumerate(SHAPES)
    }
    for src, dst in ((0, 1), (1, 0)):  # each checkpoint at the other mesh
        mesh, model, opt = setup(SHAPES[dst], bits)
        msd, osd = get_state_dict(model, opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(Path(out) / f"ck{src}"))
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
        name = "x".join(map(str, SHAPES[src])) + "->" + "x".join(map(str, SHAPES[dst]))
        result[name] = dict(losses=train(model, opt, mesh, SAVE_AT, steps))
    result["reference"] = {k: v for k, v in ref.items() if k not in ("params", "grads")}
    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("dp_mod_ep", "ep", "tp"))
    one, spread = expert_run(steps, bits, None), expert_run(steps, bits, mesh)
    result["ep_tp"] = dict(
        ref_blocks=one["blocks"],
        blocks=spread["blocks"],
        codebook_drift=(torch.tensor(spread["codebook"]) - torch.tensor(one["codebook"]))
        .abs()
        .max()
        .item(),
        param_drift=(spread["params"] - one["params"]).abs().max().item(),
        param_scale=one["params"].abs().max().item(),
        group=spread["group"],
        placements=spread["placements"],
    )
    write(out, result)


if __name__ == "__main__":
    main()
    finish()
