"""Elastic resume with HSDP: checkpoints of FSDP2 on a 2 x 2 (replicate, shard) mesh loaded at
another mesh, and 1-D FSDP2 checkpoints loaded into HSDP.

``save OUT STEPS SAVE_AT BITS`` (4 ranks): the demo GPT under HSDP (``hsdp2``) and under 1-D
FSDP2 over the 4 ranks (``fsdp2_world``), one after the other, data parallel over the same
global batches; at SAVE_AT a DCP checkpoint (``dcp.save`` of ``get_state_dict``) in
OUT/<layout>/dcp, and on to STEPS: the uninterrupted runs' losses. Then each checkpoint is
consolidated (``checkpoint.read_dcp`` by all ranks, ``checkpoint.consolidate``; rank 0 writes
OUT/<layout>.pt), and the 1-D one resumed under HSDP in the same launch (``to_hsdp2``).

``resume OUT CONSOLIDATED SAVE_AT STEPS BITS LAYOUT``: the model and Gefen built afresh at this
world size under LAYOUT (``hsdp2``, ``fsdp2``: 1-D over this world), the model and Gefen state
loaded from a consolidated checkpoint (``python -m gefen_dist.checkpoint consolidate``), then
steps SAVE_AT .. STEPS.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsdp_common import gefen, init, train, write
from hsdp_common import wrap
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
)

from gefen_dist import checkpoint
from teardown import finish

SAVED = ("hsdp2", "fsdp2_world")


def built(layout: str, bits: int):
    model = wrap("gpt", "fsdp2_world" if layout == "fsdp2" else layout)
    return model, gefen(model.parameters(), bits)


def blocks(model, opt) -> dict[str, int]:
    return {n: int(opt.state[p]["layout"][0, 3]) for n, p in model.named_parameters()}


def save(out: str, steps: int, save_at: int, bits: int) -> None:
    result = {}
    for layout in SAVED:
        model, opt = built(layout, bits)
        losses = train("gpt", model, opt, 0, save_at)
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{out}/{layout}/dcp")
        losses += train("gpt", model, opt, save_at, steps - save_at)
        result[layout] = dict(losses=losses, blocks=blocks(model, opt))
    for layout in SAVED:
        tree, _ = checkpoint.consolidate(checkpoint.read_dcp(f"{out}/{layout}/dcp"))
        if dist.get_rank() == 0:
            torch.save(tree, f"{out}/{layout}.pt")
    dist.barrier()
    result["to_hsdp2"] = run_from(f"{out}/fsdp2_world.pt", save_at, steps, bits, "hsdp2")
    write(out, dict(world=dist.get_world_size(), **result))


def run_from(consolidated: str, save_at: int, steps: int, bits: int, layout: str) -> dict:
    tree = torch.load(consolidated, weights_only=True)
    model, opt = built(layout, bits)
    set_model_state_dict(model, tree["model"], options=StateDictOptions(full_state_dict=True))
    checkpoint.load_optimizer(opt, model, tree["optim"])
    losses = train("gpt", model, opt, save_at, steps - save_at)
    return dict(losses=losses, blocks=blocks(model, opt))


def resume(out: str, consolidated: str, save_at: int, steps: int, bits: int, layout: str) -> None:
    result = run_from(consolidated, save_at, steps, bits, layout)
    write(out, dict(world=dist.get_world_size(), **result))


def main() -> None:
    init()
    mode, out, *rest = sys.argv[1:]
    if mode == "save":
        steps, save_at, bits = map(int, rest)
        save(out, steps, save_at, bits)
    else:
        consolidated, save_at, steps, bits, layout = rest
        resume(out, consolidated, int(save_at), int(steps), int(bits), layout)


if __name__ == "__main__":
    main()
    finish()
