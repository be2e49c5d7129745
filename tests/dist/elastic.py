"""Elastic resume under FSDP2: train, save with DCP at one world size, resume at another.

One launch runs a list of jobs in turn: ``elastic.py JOBS``, JOBS a JSON file of ``[MODE, OUT,
ARGS...]`` lists (the modes below), each job's model and optimizer built afresh and freed before
the next (every launch pays seconds of start-up, a job a fraction of that).

``save OUT STEPS SAVE_AT BITS LAYOUT``: the demo GPT under FSDP2 on this world (LAYOUT
``fsdp2``), or in one process without FSDP (``plain``), data parallel over the same global
batches at any world size (``fsdp_common.batch``); at step SAVE_AT a checkpoint (FSDP2:
``dcp.save`` of ``get_state_dict``; plain: ``torch.save`` of the same FQN-keyed dicts, what one
process writes), and on to STEPS: the uninterrupted run's losses.

``resume OUT CONSOLIDATED SAVE_AT STEPS BITS LAYOUT``: the same model and optimizer built
afresh at this world size and layout, model and Gefen state loaded from the consolidated
checkpoint (``python -m gefen_dist.checkpoint consolidate``, or the plain save as it is), then
steps SAVE_AT .. STEPS.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsdp_common import build, gefen, init, train, wrap, write
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
)

from gefen_dist import checkpoint
from teardown import finish


def block_sizes(model, opt) -> dict[str, int]:
    """Each parameter's block size by FQN: the same names in every layout."""
    return {n: int(opt.state[p]["layout"][0, 3]) for n, p in model.named_parameters()}


def save(out: str, steps: int, save_at: int, bits: int, layout: str) -> None:
    model = wrap("gpt", "fsdp2") if layout == "fsdp2" else build("gpt")
    opt = gefen(model.parameters(), bits)
    losses = train("gpt", model, opt, 0, save_at)
    msd, osd = get_state_dict(model, opt)
    if layout == "fsdp2":
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{out}/dcp")
    else:
        torch.save({"model": msd, "optim": osd}, f"{out}.pt")
    losses += train("gpt", model, opt, save_at, steps - save_at)
    write(out, dict(losses=losses, world=dist.get_world_size(), blocks=block_sizes(model, opt)))


def resume(out: str, consolidated: str, save_at: int, steps: int, bits: int, layout: str) -> None:
    tree = torch.load(consolidated, weights_only=True)
    model = wrap("gpt", "fsdp2") if layout == "fsdp2" else build("gpt")
    opt = gefen(model.parameters(), bits)
    if layout == "fsdp2":
        set_model_state_dict(model, tree["model"], options=StateDictOptions(full_state_dict=True))
    else:
        model.load_state_dict(tree["model"])
    checkpoint.load_optimizer(opt, model, tree["optim"])
    losses = train("gpt", model, opt, save_at, steps - save_at)
    write(out, dict(losses=losses, world=dist.get_world_size(), blocks=block_sizes(model, opt)))


def main() -> None:
    init()
    for mode, out, *rest in json.loads(Path(sys.argv[1]).read_text()):
        if mode == "save":
            steps, save_at, bits, layout = rest
            save(out, int(steps), int(save_at), int(bits), layout)
        elif mode == "resume":
            consolidated, save_at, steps, bits, layout = rest
            resume(out, consolidated, int(save_at), int(steps), int(bits), layout)
        else:
            raise ValueError(f"job mode: save or resume, got {mode!r}")
        gc.collect()  # the job's model and optimizer, before the next job builds its own
        dist.barrier()  # a later job may read what this one saved


if __name__ == "__main__":
    main()
    finish()
