"""FSDP1 (flat and original parameters) and FSDP2 on 2 ranks against single-process Gefen.

argv: OUT STEPS BITS. Each setup runs twice: "same", every rank on the whole batch, so the
averaged gradient is bitwise the reference one and only the layout can make a difference, and
"split", data parallel on slices of it. Writes rank{r}.json with, per run, the global loss per
step, the codebooks, block sizes per original tensor, cut blocks, max |param - reference| and
the memory report; plus the reference, and the errors that unsupported layouts and misuse
raise.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from fsdp_common import (
    block_sizes,
    build,
    codebooks,
    cut_blocks,
    full_params,
    gefen,
    init,
    padding,
    reference,
    train,
    wrap,
    write,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import gefen_dist.integrations.fsdp
from gefen_dist import Gefen
from teardown import finish


def run(kind: str, setup: str, steps: int, bits: int, ref: dict, split: bool) -> dict:
    model = wrap(kind, setup)
    opt = gefen(model.parameters(), bits)
    gefen_dist.integrations.fsdp.configure(model, opt)
    losses = train(kind, model, opt, 0, steps, split)
    if setup == "fsdp2":
        blocks = {n: int(opt.state[p]["layout"][0, 3]) for n, p in model.named_parameters()}
    else:
        blocks = block_sizes(opt)
    params = full_params(model, setup)
    drift = {n: (params[n] - ref["params"][n]).abs().max().item() for n in ref["params"]}
    rep = opt.memory_report()
    return dict(
        losses=losses,
        codebooks=codebooks(opt),
        cut_blocks=cut_blocks(opt),
        padding=padding(opt),
        blocks=blocks,
        param_drift=drift,
        memory=dict(
            state_bytes=rep["state_bytes"],
            adamw_bytes=rep["adamw_bytes"],
            params=rep["params"],
            fallback_numel=rep["fallback_numel"],
            spread_v_cross=rep["spread_v_cross"],
        ),
    )


def errors() -> dict[str, str]:
    """Messages of the layouts Gefen refuses and of configure's misuse, by case."""
    out = {}
    mesh = init_device_mesh("cpu", (2,))
    w = torch.nn.Parameter(distribute_tensor(torch.randn(64, 64), mesh, [Shard(1)]))
    try:
        Gefen([("blocks.0.proj.weight", w)])
    except ValueError as e:
        out["shard_dim1"] = str(e)
    mesh2 = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    w2 = torch.nn.Parameter(distribute_tensor(torch.randn(64, 64), mesh2, [Shard(0), Shard(0)]))
    try:
        Gefen([("blocks.0.mlp.weight", w2)])
    except ValueError as e:
        out["mesh_2d"] = str(e)
    plain = build("odd")
    try:
        gefen_dist.integrations.fsdp.configure(plain, Gefen(plain.parameters()))
    except ValueError as e:
        out["not_sharded"] = str(e)
    try:
        gefen_dist.integrations.fsdp.configure(plain, torch.optim.AdamW(plain.parameters()))
    except TypeError as e:
        out["not_gefen"] = str(e)
    model = wrap("odd", "fsdp1_flat")
    opt = Gefen(model.parameters())
    try:
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
    except ValueError as e:
        out["flat_unconfigured"] = str(e)
    orig = wrap("odd", "fsdp1_orig")
    try:
        for p in orig.parameters():
            p.grad = torch.zeros_like(p)
        Gefen(orig.parameters()).step()
    except ValueError as e:
        out["orig_unconfigured"] = str(e)
    out["through_accelerate"] = through_accelerate(orig)
    opt = Gefen(model.parameters())
    gefen_dist.integrations.fsdp.configure(model, opt)
    try:
        gefen_dist.integrations.fsdp.configure(model, opt)
    except RuntimeError as e:
        out["twice"] = str(e)
    other = wrap("odd", "fsdp1_flat")
    try:
        gefen_dist.integrations.fsdp.configure(other, Gefen(model.parameters()))
    except ValueError as e:
        out["wrong_model"] = str(e)
    return out


def through_accelerate(model) -> str:
    """configure takes the optimizer Accelerate's prepare hands back (AcceleratedOptimizer)."""
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer

    Accelerator(cpu=True)
    opt = Gefen(model.parameters())
    gefen_dist.integrations.fsdp.configure(model, AcceleratedOptimizer(opt, device_placement=False))
    return "configured" if opt.attached("fsdp") is not None else "not configured"


def main() -> None:
    out, steps, bits = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    init()
    result: dict = {"world_size": dist.get_world_size()}
    for kind, setups in (
        ("gpt", ("fsdp1_flat", "fsdp1_orig", "fsdp2")),
        ("odd", ("fsdp1_flat", "fsdp2")),
    ):
        ref = reference(kind, steps, bits)
        result[f"{kind}/ref"] = dict(
            losses=ref["losses"],
            blocks=ref["blocks"],
            codebooks=[ref["codebook"].tolist()],
            state_bytes=ref["state_bytes"],
        )
        for setup in setups:
            for mode in ("same", "split"):
                split = mode == "split"
                result[f"{kind}/{setup}/{mode}"] = run(kind, setup, steps, bits, ref, split)
    result["errors"] = errors()
    write(out, result)


if __name__ == "__main__":
    main()
    finish()
