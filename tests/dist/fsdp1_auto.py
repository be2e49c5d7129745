"""Gefen under FSDP1 with no configure call, through the calls Accelerate's FSDP plugin makes.

argv: OUT CKDIR. On 2 ranks, for FSDP1 with original parameters (``use_orig_params=True``) and
with flat ones, the sequence of calls the Hugging Face Trainer makes through Accelerate's
FSDP1 plugin (which asks for a GPU on CPU ranks, so its calls are made here one by one, with the
plugin's own objects and checkpoint functions):

- ``orig``: the user builds ``Gefen(model.parameters())`` before the model is wrapped (what
  ``Trainer(..., optimizers=(Gefen(...), None))`` hands over); the Trainer's
  ``accelerator.prepare(model)`` wraps it (``plugin.set_auto_wrap_policy`` and FSDP with the
  plugin's arguments), ``accelerator.prepare(optimizer)`` wraps the optimizer in an
  ``AcceleratedOptimizer``. ``flat``: the optimizer is built from the wrapped model (the
  Trainer's ``create_optimizer(model)``), since FSDP replaces the parameters it was built on.
- Trains 6 steps; at step 3 saves the model and optimizer with the plugin's
  ``save_fsdp_model`` / ``save_fsdp_optimizer`` under SHARDED_STATE_DICT (DCP) and
  FULL_STATE_DICT. The same run with ``configure(model, optimizer)`` called gives the losses
  to compare with.
- Each checkpoint is loaded with ``load_fsdp_model`` / ``load_fsdp_optimizer`` into a fresh
  model and Gefen (no step yet: the load is where Gefen first meets FSDP's parameters), and
  steps 3-5 replayed.
- Misuse: a later ``configure`` (same model: nothing changes; another model: refused).

Writes OUT/rank{r}.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import FullyShardedDataParallelPlugin
from accelerate.utils.fsdp_utils import (
    load_fsdp_model,
    load_fsdp_optimizer,
    save_fsdp_model,
    save_fsdp_optimizer,
)
from fsdp_common import HYPER, TINY, batch, init, rows, write
from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

import gefen_dist.integrations.fsdp
from gefen_dist import Gefen
from gefen_dist.demo.model import GPT
from teardown import finish

STEPS, SAVE_AT = 6, 3
TYPES = ("FULL_STATE_DICT", "SHARDED_STATE_DICT")


def plugin(setup: str, state_dict_type: str, load: bool = False) -> FullyShardedDataParallelPlugin:
    """The plugin as the Trainer's ``fsdp_config`` builds it: a FULL_STATE_DICT optimizer dict
    is saved as the plugin saves it (rank0_only, offloaded to the CPU), and loaded on every
    rank (``load``)."""
    fsdp = FullyShardedDataParallelPlugin(
        fsdp_version=1,
        use_orig_params=setup == "orig",
        sync_module_states=False,  # True asks for the current GPU
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["Block"],
        state_dict_type=state_dict_type,
    )
    if state_dict_type == "FULL_STATE_DICT" and load:
        # FSDP1's rank0_only load moves every state value of rank 0's dict back with .cpu(),
        # which Gefen's bytes entries do not have: the full dict is read on every rank
        fsdp.optim_state_dict_config = FullOptimStateDictConfig(offload_to_cpu=True)
    return fsdp


def save_model(fsdp: FullyShardedDataParallelPlugin, acc: Accelerator, model, where: Path) -> None:
    """``save_fsdp_model``, except for FULL_STATE_DICT: there it sets the model's config to
    rank0_only with CPU offload, which crashes FSDP1 on CPU ranks (a segfault in FSDP's
    param_hook, Gefen or not), so FSDP's own full model state dict is saved instead."""
    if fsdp.state_dict_type != StateDictType.FULL_STATE_DICT:
        save_fsdp_model(fsdp, acc, model, str(where))
        return
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig()):
        msd = model.state_dict()
    if dist.get_rank() == 0:
        torch.save(msd, where / "model_full.pt")


def load_model(fsdp: FullyShardedDataParallelPlugin, acc: Accelerator, model, where: Path) -> None:
    if fsdp.state_dict_type != StateDictType.FULL_STATE_DICT:
        load_fsdp_model(fsdp, acc, model, str(where))
        return
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig()):
        model.load_state_dict(torch.load(where / "model_full.pt", weights_only=True))


def prepare_model(model: torch.nn.Module, fsdp: FullyShardedDataParallelPlugin) -> FSDP:
    """``Accelerator.prepare_model``'s FSDP1 branch, with the CPU as the device."""
    fsdp.set_auto_wrap_policy(model)
    return FSDP(
        model,
        sharding_strategy=fsdp.sharding_strategy,
        cpu_offload=fsdp.cpu_offload,
        auto_wrap_policy=fsdp.auto_wrap_policy,
        mixed_precision=fsdp.mixed_precision_policy,
        sync_module_states=fsdp.sync_module_states,
        backward_prefetch=fsdp.backward_prefetch,
        forward_prefetch=fsdp.forward_prefetch,
        use_orig_params=fsdp.use_orig_params,
        param_init_fn=fsdp.param_init_fn,
        ignored_modules=fsdp.ignored_modules,
        limit_all_gathers=fsdp.limit_all_gathers,
        device_id=torch.device("cpu"),
    )


def built(setup: str, fsdp: FullyShardedDataParallelPlugin, configure: bool = False):
    """The model and the optimizer as the Trainer holds them after ``_prepare_for_training``."""
    torch.manual_seed(0)
    model = GPT(TINY)
    if setup == "orig":
        opt = Gefen(model.parameters(), **HYPER)
        model = prepare_model(model, fsdp)
    else:
        model = prepare_model(model, fsdp)
        opt = Gefen(model.parameters(), **HYPER)
    wrapped = AcceleratedOptimizer(opt, device_placement=False)
    if configure:
        gefen_dist.integrations.fsdp.configure(model, wrapped)
    return model, wrapped


def step(model, opt, s: int) -> float:
    opt.zero_grad()
    x, y = batch("gpt", s)
    loss = model(rows(x), rows(y))[1]
    loss.backward()
    opt.step()
    t = loss.detach().clone()
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def train(setup: str, acc: Accelerator, ck: Path, configure: bool) -> dict:
    fsdp = plugin(setup, TYPES[0])
    model, opt = built(setup, fsdp, configure)
    losses = []
    for s in range(STEPS):
        if s == SAVE_AT and not configure:
            for kind in TYPES:
                where = ck / f"{setup}_{kind}"
                where.mkdir(parents=True, exist_ok=True)
                save_model(plugin(setup, kind), acc, model, where)
                save_fsdp_optimizer(plugin(setup, kind), acc, opt, model, str(where))
        losses.append(step(model, opt, s))
    integ = opt.optimizer.attached("fsdp")
    return dict(losses=losses, found=integ.found, model=integ.model is model)


def resume(setup: str, acc: Accelerator, ck: Path, kind: str) -> list[float]:
    fsdp = plugin(setup, kind, load=True)
    model, opt = built(setup, fsdp)
    where = ck / f"{setup}_{kind}"
    load_model(fsdp, acc, model, where)
    load_fsdp_optimizer(fsdp, acc, opt, model, str(where))
    return [step(model, opt, s) for s in range(SAVE_AT, STEPS)]


def misuse(setup: str) -> dict[str, str]:
    out = {}
    model, opt = built(setup, plugin(setup, TYPES[0]))
    step(model, opt, 0)
    integ = opt.optimizer.attached("fsdp")
    gefen_dist.integrations.fsdp.configure(model, opt)
    out["again_same"] = "unchanged" if opt.optimizer.attached("fsdp") is integ else "changed"
    other, _ = built(setup, plugin(setup, TYPES[0]))
    try:
        gefen_dist.integrations.fsdp.configure(other, opt)
    except ValueError as e:
        out["again_other"] = str(e)
    return out


def main() -> None:
    out, ck = sys.argv[1], Path(sys.argv[2])
    init()
    acc = Accelerator(cpu=True)
    result = {}
    for setup in ("orig", "flat"):
        result[f"{setup}/auto"] = train(setup, acc, ck, configure=False)
        result[f"{setup}/configured"] = train(setup, acc, ck, configure=True)
        for kind in TYPES:
            result[f"{setup}/resume/{kind}"] = resume(setup, acc, ck, kind)
        result[f"{setup}/misuse"] = misuse(setup)
    write(out, result)


if __name__ == "__main__":
    main()
    finish()
