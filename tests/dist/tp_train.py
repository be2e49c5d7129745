"""FSDP2 with tensor parallelism on 4 ranks as a (dp=2, tp=2) mesh against single-process Gefen.

argv: OUT STEPS BITS [CKDIR]. Runs: "same", every rank on the whole batch (the gradient is the
reference one up to the rounding of the row-parallel sums); "split", each dp rank on its half;
"tp_attn", each dp rank on its half, with tensor parallelism on attention alone (the norms and
the MLP FSDP2-sharded over the dp mesh: two groups of ranks in one optimizer); "sp", the
sequence-parallel plan (tp_common.parallelize(sequence_parallel=True)), each dp rank
on its half and each tp rank on its half of the sequence, its loss divided by tp; its record
adds "grad_drift", per tensor the first step's max |grad - reference| over max |reference|.
Writes rank{r}.json with, per run, the loss per step, codebooks, block sizes per tensor, this
rank's placements and segment count per tensor, its state bytes beside AdamW's and its v_cross
entries per tensor,
max |param - reference| and the optimizer's group; the reference; and the errors that
still-refused layouts raise. With CKDIR, also tp_checkpoint.py's save (its result under
"ckpt"), to spare the test a launch.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from fsdp_common import codebooks, gefen, init, write
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from tp_checkpoint import save_run
from tp_common import build, full_params, mesh2d, parallelize, train

from gefen_dist import Gefen
from teardown import finish


def reference(steps: int, bits: int) -> dict:
    model = build()
    opt = gefen(list(model.named_parameters()), bits)
    grads: dict = {}
    losses = train(model, opt, 0, steps, None, False, grads=grads)
    names = {p: n for n, p in model.named_parameters()}
    return dict(
        losses=losses,
        blocks={names[p]: int(st["layout"][0, 3]) for p, st in opt.state.items()},
        cross={names[p]: st["v_cross"].numel() for p, st in opt.state.items()},
        v={names[p]: st["v"].numel() for p, st in opt.state.items()},
        codebook=next(iter(opt.state.values()))["codebook"].tolist(),
        params={n: p.detach().clone() for n, p in model.named_parameters()},
        grads=grads,
    )


def run(
    steps: int, bits: int, ref: dict, split: bool, sp: bool = False, attention_only: bool = False
) -> dict:
    mesh = mesh2d()
    model = parallelize(build(), mesh, sequence_parallel=sp, attention_only=attention_only)
    opt = gefen(model.parameters(), bits)
    grads: dict | None = {} if sp else None
    losses = train(model, opt, 0, steps, mesh, split, sp, grads)
    named = dict(model.named_parameters())
    blocks, segments = {}, {}
    for n, p in named.items():
        rows = opt.state[p]["layout"].tolist()
        blocks[n] = sorted({int(r[3]) for r in rows})
        segments[n] = len(rows)
    params = full_params(model)
    rep = opt.memory_report()
    result = dict(
        memory=dict(
            state_bytes=rep["state_bytes"],
            adamw_bytes=rep["adamw_bytes"],
            v_cross={n: opt.state[p]["v_cross"].numel() for n, p in named.items()},
            v={n: opt.state[p]["v"].numel() for n, p in named.items()},
            spread_v_cross=rep["spread_v_cross"],
        ),
        losses=losses,
        codebooks=codebooks(opt),
        blocks=blocks,
        segments=segments,
        placements={n: str(tuple(p.placements)) for n, p in named.items()},
        param_drift={n: (params[n] - ref["params"][n]).abs().max().item() for n in params},
        group=dist.get_process_group_ranks(opt.process_group),
    )
    if grads is not None:
        result["grad_drift"] = grad_drift(grads, ref["grads"])
    return result


def grad_drift(grads: dict, ref: dict) -> dict[str, float]:
    """Per tensor, max |grad - reference grad| over max |reference grad| at the first step."""
    return {n: ((g - ref[n]).abs().max() / ref[n].abs().max()).item() for n, g in grads.items()}


def refused(name: str, make) -> str:
    try:
        Gefen([(name, torch.nn.Parameter(make()))])
    except ValueError as e:
        return str(e)
    return "accepted"


def crossing() -> str:
    """One optimizer over a weight on the dp mesh and one on the tp mesh: neither group holds
    the other's ranks."""
    mesh = mesh2d()
    w = torch.randn(16, 16)
    a = torch.nn.Parameter(distribute_tensor(w, mesh["dp"], [Shard(0)]))
    b = torch.nn.Parameter(distribute_tensor(w, mesh["tp"], [Shard(0)]))
    try:
        Gefen([("on_dp", a), ("on_tp", b)])
    except ValueError as e:
        return str(e)
    return "accepted"


def errors() -> dict[str, str]:
    w = torch.randn(16, 16)
    mesh3 = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("replicate", "dp", "tp"))
    return dict(
        crossing=crossing(),
        two_replicate=refused(
            "w3", lambda: distribute_tensor(w, mesh3, [Replicate(), Replicate(), Shard(0)])
        ),
        partial=refused(
            "wp",
            lambda: DTensor.from_local(torch.zeros(16, 16), mesh2d(), [Shard(0), Partial()]),
        ),
    )


def main() -> None:
    out, steps, bits = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    init()
    ref = reference(steps, bits)
    result: dict = dict(
        ref={k: v for k, v in ref.items() if k not in ("params", "grads")},
        same=run(steps, bits, ref, False),
        split=run(steps, bits, ref, True),
        sp=run(steps, bits, ref, True, sp=True),
        tp_attn=run(steps, bits, ref, True, attention_only=True),
        errors=errors(),
    )
    if len(sys.argv) > 4:
        ck = Path(sys.argv[4])
        result["ckpt"] = {
            **save_run(ck, bits),
            "tp_attn": save_run(ck / "tp_attn", bits, attention_only=True),
        }
    write(out, result)


if __name__ == "__main__":
    main()
    finish()
