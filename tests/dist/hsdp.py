"""HSDP on 4 ranks as a 2 x 2 mesh (FSDP2 and FSDP1's hybrid strategies) against single-process
Gefen and 1-D FSDP2.

argv: OUT STEPS BITS. Runs (kind/setup/mode; setups in hsdp_common): "same", every rank on the
whole batch, so the averaged gradient is bitwise the reference one; "split", data parallel over
all 4 ranks. Writes rank{r}.json with, per run, the global loss per step, codebooks, block sizes
per original tensor, cut blocks, max |param - reference|, the memory report, the shard group's
ranks and digests of this rank's state and parameters; the reference; and the errors that
refused layouts raise.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from fsdp_common import (
    block_sizes,
    codebooks,
    cut_blocks,
    full_params,
    gefen,
    init,
    padding,
    reference,
    train,
    write,
)
from hsdp_common import FSDP1, groups, mesh2d, param_digest, state_digest, wrap
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

import gefen_dist.integrations.fsdp
from gefen_dist import Gefen
from teardown import finish

RUNS = {
    "gpt": [
        ("hsdp2", "same"),
        ("hsdp2", "split"),
        ("fsdp2_shard", "same"),
        ("fsdp2_world", "split"),
        ("hybrid", "same"),
        ("hybrid", "split"),
        ("hybrid_orig", "same"),
        ("hybrid_zero2", "same"),
    ],
    "odd": [("hsdp2", "same"), ("fsdp2_shard", "same"), ("hybrid", "same")],
}


def run(kind: str, setup: str, steps: int, bits: int, ref: dict, split: bool) -> dict:
    model = wrap(kind, setup)
    opt = gefen(model.parameters(), bits)
    if setup in FSDP1:
        gefen_dist.integrations.fsdp.configure(model, opt)
    losses = train(kind, model, opt, 0, steps, split)
    if setup in FSDP1:
        blocks = block_sizes(opt)
    else:
        blocks = {n: int(opt.state[p]["layout"][0, 3]) for n, p in model.named_parameters()}
    params = full_params(model, "fsdp2" if setup not in FSDP1 else setup)
    drift = {n: (params[n] - ref["params"][n]).abs().max().item() for n in ref["params"]}
    rep = opt.memory_report()
    return dict(
        losses=losses,
        codebooks=codebooks(opt),
        cut_blocks=cut_blocks(opt),
        padding=padding(opt),
        blocks=blocks,
        param_drift=drift,
        state_digest=state_digest(opt),
        param_digest=param_digest(opt),
        run_id=opt.attached("fsdp").run,
        **groups(opt),
        memory=dict(
            state_bytes=rep["state_bytes"],
            adamw_bytes=rep["adamw_bytes"],
            params=rep["params"],
            local_numel=sum(t["numel"] for t in rep["tensors"]),
            fallback_numel=rep["fallback_numel"],
            spread_v_cross=rep["spread_v_cross"],
        ),
    )


def refused(name: str, make) -> str:
    try:
        Gefen([(name, torch.nn.Parameter(make()))])
    except ValueError as e:
        return str(e)
    return "accepted"


def errors() -> dict[str, str]:
    """What Gefen says to DTensor layouts beyond 1-D sharding on 4 ranks, by case ("accepted",
    or the refusal)."""
    mesh = mesh2d()
    w = torch.randn(64, 64)
    local = w[: 32 // 2]  # what each rank holds under the strided layout below
    strided = [Replicate(), _StridedShard(0, split_factor=2)]
    return dict(
        hsdp_dim1=refused("h.0.w", lambda: distribute_tensor(w, mesh, [Replicate(), Shard(1)])),
        tp_2d=refused("h.0.tp", lambda: distribute_tensor(w, mesh, [Shard(0), Shard(1)])),
        strided=refused(
            "h.0.fsdp_tp", lambda: DTensor.from_local(local, mesh, strided, run_check=False)
        ),
        mesh_3d=refused(
            "h.0.w3",
            lambda: distribute_tensor(
                w,
                init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("pp", "replicate", "shard")),
                [Replicate(), Replicate(), Shard(0)],
            ),
        ),
    )


def main() -> None:
    out, steps, bits = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    init()
    result: dict = {"world_size": dist.get_world_size()}
    for kind, runs in RUNS.items():
        ref = reference(kind, steps, bits)
        result[f"{kind}/ref"] = dict(
            losses=ref["losses"],
            blocks=ref["blocks"],
            codebooks=[ref["codebook"].tolist()],
            state_bytes=ref["state_bytes"],
        )
        for setup, mode in runs:
            result[f"{kind}/{setup}/{mode}"] = run(kind, setup, steps, bits, ref, mode == "split")
    result["errors"] = errors()
    write(out, result)


if __name__ == "__main__":
    main()
    finish()
