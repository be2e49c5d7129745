"""Full and sharded state dicts of FSDP2 and FSDP1 saved at one world size, resumed at another.

``save OUT CKDIR STEPS SAVE_AT BITS``: the demo GPT under FSDP2, FSDP1 with flat parameters and
FSDP1 with original ones, one after the other, each data parallel over the same global batches
(``fsdp_common.train``). At step SAVE_AT each writes its checkpoints into CKDIR (below), then
trains on to STEPS: the uninterrupted run, whose losses OUT/rank{r}.json keeps per setup.

- FSDP2: ``fsdp2_full.pt``, DCP's ``get_*_state_dict(full_state_dict=True, cpu_offload=True)``
  saved by rank 0; ``fsdp2_dcp_full/``, ``dcp.save`` of the full state dicts every rank holds
  (``full_state_dict=True`` alone).
- FSDP1: ``{setup}_full.pt``, ``FSDP.optim_state_dict`` under FULL_STATE_DICT, saved by rank 0;
  ``{setup}_rank0.pt`` the same with ``rank0_only=True`` (only rank 0 builds it);
  ``{setup}_sharded/``, ``dcp.save`` of the SHARDED_STATE_DICT model and optimizer dicts.

``resume OUT CKDIR SAVE_AT STEPS BITS``: at this world size, for every checkpoint, the same
model and Gefen built afresh (Gefen configures itself: nobody calls configure), the checkpoint
loaded through the frameworks' own functions (FSDP1 full ones also with ``rank0_only=True``:
rank 0 alone passes the dict), steps SAVE_AT .. STEPS: losses per case. Then bad
input, whose errors are kept by case: another model, and a checkpoint lacking a rank's entry.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsdp_common import TINY, gefen, init, jobs, shard, train, wrap, write
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from gefen_dist import checkpoint
from gefen_dist.demo.model import GPT, Block, GPTConfig
from teardown import finish

SETUPS = ("fsdp2", "fsdp1_flat", "fsdp1_orig")
CASES = [  # (setup, checkpoint, how it is loaded)
    ("fsdp2", "full", "full"),
    ("fsdp2", "full", "broadcast"),
    ("fsdp2", "dcp_full", "full"),
    ("fsdp1_flat", "full", "fsdp1"),
    ("fsdp1_flat", "rank0", "fsdp1"),
    ("fsdp1_flat", "sharded", "fsdp1"),
    ("fsdp1_orig", "full", "fsdp1"),
    ("fsdp1_orig", "rank0", "fsdp1"),
    ("fsdp1_orig", "sharded", "fsdp1"),
    ("fsdp1_flat", "rank0", "fsdp1_rank0"),
    ("fsdp1_orig", "rank0", "fsdp1_rank0"),
]
FULL = StateDictType.FULL_STATE_DICT
SHARDED = StateDictType.SHARDED_STATE_DICT


def rank0() -> bool:
    return dist.get_rank() == 0


def save_fsdp2(model, opt, ck: Path) -> None:
    offload = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd = get_model_state_dict(model, options=offload)
    osd = get_optimizer_state_dict(model, opt, options=offload)
    if rank0():
        torch.save({"model": msd, "optim": osd}, ck / "fsdp2_full.pt")
    every = StateDictOptions(full_state_dict=True)
    msd = get_model_state_dict(model, options=every)
    osd = get_optimizer_state_dict(model, opt, options=every)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(ck / "fsdp2_dcp_full"))


def save_fsdp1(model, opt, ck: Path, setup: str) -> None:
    for name, only in (("full", False), ("rank0", True)):
        cfg = FullStateDictConfig()  # the model's rank0_only dict fails on CPU ranks
        ocfg = FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=only)
        with FSDP.state_dict_type(model, FULL, cfg, ocfg):
            msd, osd = model.state_dict(), FSDP.optim_state_dict(model, opt)
        if rank0():
            torch.save({"model": msd, "optim": osd}, ck / f"{setup}_{name}.pt")
    with FSDP.state_dict_type(model, SHARDED):
        msd, osd = model.state_dict(), FSDP.optim_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(ck / f"{setup}_sharded"))


def save(out: str, ck: Path, steps: int, save_at: int, bits: int) -> None:
    ck.mkdir(parents=True, exist_ok=True)
    result = {"world": dist.get_world_size()}
    for setup in SETUPS:
        model = wrap("gpt", setup)
        opt = gefen(model.parameters(), bits)
        losses = train("gpt", model, opt, 0, save_at)
        if setup == "fsdp2":
            save_fsdp2(model, opt, ck)
        else:
            save_fsdp1(model, opt, ck, setup)
        losses += train("gpt", model, opt, save_at, steps - save_at)
        result[setup] = losses
    write(out, result)


def read(ck: Path, setup: str, saved: str, how: str) -> dict:
    """The checkpoint as the loading rank sees it: a file every rank reads (a broadcast: rank 0
    alone), or a DCP directory read whole (``checkpoint.read_dcp``)."""
    if saved in ("full", "rank0"):
        if how == "broadcast" and not rank0():
            return {"model": {}, "optim": {}}
        return torch.load(ck / f"{setup}_{saved}.pt", weights_only=True)
    return checkpoint.read_dcp(ck / f"{setup}_{saved}")


def load(model, opt, tree: dict, how: str) -> None:
    if how == "fsdp1":
        with FSDP.state_dict_type(model, FULL):
            model.load_state_dict(tree["model"])
            osd = FSDP.optim_state_dict_to_load(model, opt, tree["optim"])
        opt.load_state_dict(osd)
        return
    if how == "fsdp1_rank0":  # Accelerate's FULL_STATE_DICT load: rank 0 alone holds the dict
        only = FullOptimStateDictConfig(rank0_only=True)
        with FSDP.state_dict_type(model, FULL, FullStateDictConfig(), only):
            model.load_state_dict(tree["model"])
            optim = tree["optim"] if rank0() else {}
            osd = FSDP.optim_state_dict_to_load(model, opt, optim)
        opt.load_state_dict(osd)
        return
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=how == "broadcast")
    set_model_state_dict(model, tree["model"], options=options)
    set_optimizer_state_dict(model, opt, tree["optim"], options=options)


def built(setup: str, bits: int, config: GPTConfig = TINY):
    if config is TINY:
        model = wrap("gpt", setup)
    else:
        torch.manual_seed(0)
        model = GPT(config)
        if setup == "fsdp2":
            shard("gpt", model)
        else:
            model = FSDP(
                model,
                auto_wrap_policy=ModuleWrapPolicy({Block}),
                use_orig_params=setup == "fsdp1_orig",
                device_id=torch.device("cpu"),
            )
    return model, gefen(model.parameters(), bits)


def errors(ck: Path, bits: int) -> dict[str, str]:
    """What bad input is refused with: another model (wider), a missing rank's entry."""
    out = {}
    wide = GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=96)
    for setup in SETUPS:
        tree = read(ck, setup, "full", "full")
        model, opt = built(setup, bits, wide)
        try:
            if setup == "fsdp2":
                options = StateDictOptions(full_state_dict=True)
                set_optimizer_state_dict(model, opt, tree["optim"], options=options)
            else:
                with FSDP.state_dict_type(model, FULL):
                    osd = FSDP.optim_state_dict_to_load(model, opt, tree["optim"])
                opt.load_state_dict(osd)
        except ValueError as e:
            out[f"{setup}/other_model"] = str(e)
    for setup in ("fsdp1_flat", "fsdp1_orig"):
        tree = read(ck, setup, "full", "fsdp1")
        for st in tree["optim"]["state"].values():
            st.pop("gefen.rank1", None)
        model, opt = built(setup, bits)
        try:
            load(model, opt, tree, "fsdp1")
        except ValueError as e:
            out[f"{setup}/missing_rank"] = str(e)
    return out


def resume(out: str, ck: Path, save_at: int, steps: int, bits: int) -> None:
    result = {"world": dist.get_world_size(), "losses": {}}
    for setup, saved, how in CASES:
        model, opt = built(setup, bits)
        load(model, opt, read(ck, setup, saved, how), how)
        losses = train("gpt", model, opt, save_at, steps - save_at)
        result["losses"][f"{setup}/{saved}/{how}"] = losses
    result["errors"] = errors(ck, bits)
    write(out, result)


def main() -> None:
    """Runs each job of the command line in turn: ``save ...``, ``resume ...``, or both
    joined by ``+`` (the save, then its resume at this world size: one launch's start-up, not
    two); the job's models are freed before the next."""
    init()
    for job in jobs(sys.argv[1:]):
        mode, out, ck, *rest = job
        if mode == "save":
            steps, save_at, bits = map(int, rest)
            save(out, Path(ck), steps, save_at, bits)
        elif mode == "resume":
            save_at, steps, bits = map(int, rest)
            resume(out, Path(ck), save_at, steps, bits)
        else:
            raise ValueError(f"job mode: save or resume, got {mode!r}")
        gc.collect()
        dist.barrier()  # the resume reads what the save wrote


if __name__ == "__main__":
    main()
    finish()
