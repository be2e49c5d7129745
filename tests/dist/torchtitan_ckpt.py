"""Gefen in torchtitan's optimizer container, checkpointed by torchtitan's CheckpointManager.

    torchtitan_ckpt.py OUT run    MANAGER FOLDER   # STEPS steps, a checkpoint at step SAVE_AT
    torchtitan_ckpt.py OUT resume MANAGER FOLDER   # load step SAVE_AT, train to STEPS

MANAGER is ``gefen`` (``GefenCheckpointManager``) or ``plain`` (torchtitan's
``CheckpointManager``). The model is ``fsdp_common.Odd`` under FSDP2 (rows split unevenly, and
column blocks that the row split cuts), its param groups built by
``GefenOptimizersContainer`` from ``gefen_optimizers`` with an AdamW group for the biases, a
``LRSchedulersContainer`` beside it. Each rank writes its losses, the whole parameters at the
end (as lists, to compare bit for bit), the container's flat state-dict keys, and, where the
load fails, the error.
"""

from __future__ import annotations

import sys
import traceback

import torch.distributed as dist
from fsdp_common import batch, build, global_loss, init, rows, shard, write
from teardown import finish
from torchtitan.components.checkpointer import CheckpointManager
from torchtitan.components.optimizer import LRSchedulersContainer, ParamGroupConfig

from gefen_dist import Gefen
from gefen_dist.integrations.torchtitan import (
    GefenCheckpointManager,
    GefenOptimizersContainer,
    gefen_optimizers,
)

STEPS, SAVE_AT = 8, 4
KIND = "odd"


def config() -> GefenOptimizersContainer.Config:
    cfg = gefen_optimizers(lr=3e-3, weight_decay=0.1, pattern=r"weight$")
    cfg.param_groups.append(
        ParamGroupConfig(
            pattern=r"bias$",
            optimizer_name="AdamW",
            optimizer_kwargs={"lr": 3e-3, "weight_decay": 0.0},
        )
    )
    cfg.implementation = "for-loop"
    return cfg


def main() -> None:
    out, mode, manager, folder = sys.argv[1:5]
    init()
    model = build(KIND)
    shard(KIND, model)
    opts = config().build(model_parts=[model])
    kinds = sorted(type(o).__name__ for o in opts)
    scheds = LRSchedulersContainer.Config(warmup_steps=2).build(
        optimizers=opts, training_steps=STEPS
    )
    owner = GefenCheckpointManager if manager == "gefen" else CheckpointManager
    ckpt = owner.Config(enable=True, folder=folder, interval=SAVE_AT, keep_latest_k=0).build(
        dataloader=None,
        model_parts=[model],
        optimizers=opts,
        lr_schedulers=scheds,
        states={},
        sd_adapter=None,
    )
    result: dict = {"world": dist.get_world_size(), "optimizers": kinds}
    first = 0
    if mode == "resume":
        try:
            ckpt.load(step=SAVE_AT)
        except Exception as e:  # what the plain manager says at another world size
            result["error"] = f"{type(e).__name__}: {e}"
            result["trace"] = traceback.format_exc()[-3000:]
            write(out, result)
            return
        first = SAVE_AT
        gefen = next(o for o in opts if isinstance(o, Gefen))
        result["loaded_steps"] = sorted({float(st["step"]) for st in gefen.state.values() if st})
    losses = []
    for s in range(first, STEPS):
        opts.zero_grad()
        x, y = batch(KIND, s)
        loss = model(rows(x), rows(y))[1]
        loss.backward()
        opts.step()
        scheds.step()
        losses.append(global_loss(loss))
        if mode == "run" and s + 1 == SAVE_AT:
            ckpt.save(curr_step=SAVE_AT)
            result["keys"] = sorted(opts.state_dict())
    ckpt.close()
    result["losses"] = losses
    result["lr"] = [g["lr"] for o in opts for g in o.param_groups]
    result["params"] = {
        n: p.full_tensor().detach().flatten().tolist() for n, p in model.named_parameters()
    }
    write(out, result)


if __name__ == "__main__":
    main()
    finish()
