"""A mixture-of-experts LM (grouped 3-D expert weights) under FSDP2 and FSDP1 on 2 ranks.

argv: OUT. Writes rank{r}.json with:

- ``ref``: one process on the whole batch: losses, block size per tensor, codebook;
- ``fsdp2/same``, ``fsdp1_flat/same``: every rank on the whole batch, so the averaged gradient
  is the reference one and only the layout can differ (FSDP2 gives each rank 4 whole experts
  of 8; FSDP1's flat shard cuts the model in two, through an expert's matrix);
- ``fsdp2/split``: data parallel, a ``dcp.save`` of ``get_state_dict`` at SAVE_AT, on to STEPS;
  ``fsdp2/resumed``: a fresh model and Gefen loading that checkpoint with ``dcp.load``, on to
  STEPS. The test consolidates the checkpoint and resumes it in one process.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from fsdp_common import block_sizes, codebooks, cut_blocks, gefen, global_loss, init, rows, write
from teardown import finish
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import fully_shard

import gefen_dist.integrations.fsdp
from gefen_dist.bench.moe import MoEConfig, MoELM

CONFIG = MoEConfig(dim=64, n_layers=2, n_heads=2, n_experts=8, top_k=2, hidden=80, seq=16)
STEPS, SAVE_AT, BITS, BATCH = 8, 4, 4, 8


def build() -> MoELM:
    torch.manual_seed(0)
    return MoELM(CONFIG)


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(2000 + step)
    return torch.randint(0, 256, (BATCH, CONFIG.seq + 1), generator=g)


def loss_of(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1))


def train(model, opt, first: int, last: int, split: bool, single: bool = False) -> list[float]:
    losses = []
    for s in range(first, last):
        opt.zero_grad()
        tokens = rows(batch(s)) if split else batch(s)
        loss = loss_of(model, tokens)
        loss.backward()
        opt.step()
        losses.append(loss.item() if single else global_loss(loss))
    return losses


def wrap(setup: str) -> torch.nn.Module:
    model = build()
    if setup == "fsdp2":
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        return model
    return FSDP(model, use_orig_params=False, device_id=torch.device("cpu"))


def optimizer(model: torch.nn.Module, setup: str):
    opt = gefen(model.parameters(), BITS)
    if setup == "fsdp1_flat":
        gefen_dist.integrations.fsdp.configure(model, opt)
    return opt


def run(setup: str, split: bool) -> dict:
    model = wrap(setup)
    opt = optimizer(model, setup)
    losses = train(model, opt, 0, STEPS, split)
    if setup == "fsdp2":
        blocks = {n: int(opt.state[p]["layout"][0, 3]) for n, p in model.named_parameters()}
    else:
        blocks = block_sizes(opt)
    return dict(losses=losses, blocks=blocks, codebooks=codebooks(opt), cut_blocks=cut_blocks(opt))


def save_and_resume(out: str) -> dict:
    model = wrap("fsdp2")
    opt = optimizer(model, "fsdp2")
    losses = train(model, opt, 0, SAVE_AT, split=True)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{out}/dcp")
    losses += train(model, opt, SAVE_AT, STEPS, split=True)
    fresh = wrap("fsdp2")
    opt2 = optimizer(fresh, "fsdp2")
    msd, osd = get_state_dict(fresh, opt2)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=f"{out}/dcp")
    set_state_dict(fresh, opt2, model_state_dict=msd, optim_state_dict=osd)
    resumed = train(fresh, opt2, SAVE_AT, STEPS, split=True)
    return dict(losses=losses, resumed=resumed)


def reference() -> dict:
    model = build()
    opt = gefen(list(model.named_parameters()), BITS)
    losses = train(model, opt, 0, STEPS, split=False, single=True)
    names = {p: n for n, p in model.named_parameters()}
    blocks = {names[p]: int(st["layout"][0, 3]) for p, st in opt.state.items()}
    return dict(losses=losses, blocks=blocks, codebooks=codebooks(opt))


def main() -> None:
    out = sys.argv[1]
    init()
    result = {"ref": reference()}
    for setup in ("fsdp2", "fsdp1_flat"):
        result[f"{setup}/same"] = run(setup, split=False)
    result["fsdp2/split"] = save_and_resume(out)
    write(out, result)


if __name__ == "__main__":
    main()
    finish()
