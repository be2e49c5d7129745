"""Checkpoints of Gefen under FSDP through the frameworks' own functions, on 2 ranks.

argv: MODE OUT CKDIR BITS. Cases are (model, setup, path): FSDP1 flat or original parameters
with FSDP.optim_state_dict / optim_state_dict_to_load under FULL_STATE_DICT (rank 0 saves one
file; "full_rank0": FSDP builds the optimizer state dict on rank 0 only)
and SHARDED_STATE_DICT (one file per rank), and DCP (get_state_dict / set_state_dict with
dcp.save / dcp.load) for FSDP2 and both FSDP1 setups.

- ``save``: train 3 steps, save, dump each rank's raw Gefen state, train 3 more and keep the
  final full parameters: the uninterrupted run.
- ``resume`` (a fresh process): build everything anew, load, compare the raw state with the
  dump, train the same 3 steps and compare the final parameters and losses with the
  uninterrupted run; and a rank entry that is not the checkpoint's must be refused.
- ``world1`` (1 rank): load the 2-rank checkpoints, which must fail with a clear error.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsdp_common import build, full_params, gefen, init, shard, train, wrap, write
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

import gefen_dist.integrations.fsdp
from teardown import finish

FIRST, SECOND = 3, 3
WORLD1 = {("gpt", "full"), ("gpt", "dcp"), ("gpt", "dcp_unconfigured")}
CASES = [
    ("gpt", "fsdp1_flat", "full"),
    ("gpt", "fsdp1_flat", "full_rank0"),
    ("odd", "fsdp1_flat", "full"),
    ("gpt", "fsdp1_flat", "sharded"),
    ("gpt", "fsdp1_orig", "full"),
    ("gpt", "fsdp1_orig", "sharded"),
    ("gpt", "fsdp2", "dcp"),
    ("gpt", "fsdp2", "dcp_unconfigured"),
    ("gpt", "fsdp2_accelerate", "dcp"),
    ("odd", "fsdp2", "dcp"),
    ("gpt", "fsdp1_orig", "dcp"),
    ("gpt", "fsdp1_flat", "dcp"),
]


def setup_run(kind: str, setup: str, bits: int, path: str = ""):
    if setup == "fsdp2_accelerate":
        return accelerate_fsdp2(kind, bits)
    model = wrap(kind, setup)
    opt = gefen(model.parameters(), bits)
    if path != "dcp_unconfigured":  # FSDP2 users who skip configure: Gefen configures itself
        gefen_dist.integrations.fsdp.configure(model, opt)
    return model, opt


def accelerate_fsdp2(kind: str, bits: int):
    """What ``Accelerator.prepare`` does under FSDP2, which Accelerate will not run on CPU: the
    optimizer is built on the plain model, each of its params is swapped for a placeholder
    carrying the param's address, the model is sharded, and Accelerate's own
    ``fsdp2_switch_optimizer_parameters`` puts the DTensors in. Nobody calls configure."""
    from accelerate.utils import fsdp2_switch_optimizer_parameters

    model = build(kind)
    opt = gefen(model.parameters(), bits)
    address = {n: p.data_ptr() for n, p in model.named_parameters()}
    for group in opt.param_groups:
        for i, p in enumerate(group["params"]):
            group["params"][i] = torch.empty(1, dtype=p.dtype)
            group["params"][i].data_ptr = p.data_ptr()
    shard(kind, model)
    fsdp2_switch_optimizer_parameters(
        opt, {address[n]: p for n, p in model.named_parameters()}
    )
    return model, opt


def raw_state(opt) -> list[dict[str, torch.Tensor]]:
    return [
        {k: v.clone() for k, v in opt.state[p].items()} if opt.state.get(p) else {}
        for g in opt.param_groups
        for p in g["params"]
    ]


def fsdp1_type(model, path: str, saving: bool):
    """FSDP1's rank0_only load (optim_state_dict_to_load) calls .cpu() on every state value, so
    it cannot load non-tensor state: a rank0_only save is loaded on every rank."""
    if path.startswith("full"):
        return FSDP.state_dict_type(
            model,
            StateDictType.FULL_STATE_DICT,
            FullStateDictConfig(rank0_only=False),
            FullOptimStateDictConfig(rank0_only=saving and path == "full_rank0"),
        )
    return FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT)


def save(model, opt, path: str, d: Path) -> None:
    rank = dist.get_rank()
    if path.startswith("dcp"):
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(d / "dcp"))
        return
    with fsdp1_type(model, path, saving=True):
        ck = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, opt)}
    if path == "sharded":
        torch.save(ck, d / f"sharded{rank}.pt")
    elif rank == 0:
        torch.save(ck, d / "full.pt")
    else:
        assert path != "full_rank0" or not ck["optim"]


def load(model, opt, path: str, d: Path) -> None:
    if path.startswith("dcp"):
        msd, osd = get_state_dict(model, opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(d / "dcp"))
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
        return
    if path == "sharded":
        # the model's sharded state dict holds ShardedTensors, which weights_only refuses
        ck = torch.load(d / f"sharded{dist.get_rank()}.pt", weights_only=False)
    else:
        ck = torch.load(d / "full.pt", weights_only=True)
    with fsdp1_type(model, path, saving=False):
        model.load_state_dict(ck["model"])
        opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, ck["optim"]))


def equal_states(a: list[dict], b: list[dict]) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if x.keys() != y.keys():
            return False
        for k in x:
            if x[k].dtype != y[k].dtype or not torch.equal(x[k].cpu(), y[k].cpu()):
                return False
    return True


def template_leak(bits: int) -> str | None:
    """A loader that leaves this rank's own values in place of the checkpoint's (DCP's loader
    with ``allow_partial_load`` keeps local values for keys the checkpoint lacks) must be
    caught: here each parameter's block pieces come from another run."""
    model, opt = setup_run("gpt", "fsdp2", bits)
    train("gpt", model, opt, 0, 1)
    saved = opt.state_dict()
    other_model, other = setup_run("gpt", "fsdp2", bits)
    train("gpt", other_model, other, 0, 1)
    mixed = other.state_dict()
    for i, entry in saved["state"].items():
        theirs = {k: v for k, v in mixed["state"][i].items() if k.startswith("pieces.")}
        mixed["state"][i] = {**entry, **theirs}
    try:
        opt.load_state_dict(mixed)
    except ValueError as e:
        return str(e)
    return None


def main() -> None:
    mode, out, ckdir, bits = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
    init()
    rank = dist.get_rank()
    result: dict = {}
    for kind, setup, path in CASES:
        name = f"{kind}/{setup}/{path}"
        if mode == "world1" and (kind, path) not in WORLD1:
            continue
        d = ckdir / name.replace("/", "-")
        d.mkdir(parents=True, exist_ok=True)
        model, opt = setup_run(kind, setup, bits, path)
        if mode == "save":
            first = train(kind, model, opt, 0, FIRST)
            save(model, opt, path, d)
            torch.save(raw_state(opt), d / f"raw{rank}.pt")
            second = train(kind, model, opt, FIRST, SECOND)
            torch.save(full_params(model, setup), d / f"final{rank}.pt")
            result[name] = dict(losses=first + second, codebook=opt.codebooks[bits].tolist())
        elif mode == "resume":
            load(model, opt, path, d)
            state_exact = equal_states(raw_state(opt), torch.load(d / f"raw{rank}.pt"))
            second = train(kind, model, opt, FIRST, SECOND)
            final = full_params(model, setup)
            saved = torch.load(d / f"final{rank}.pt")
            diff = max((final[n] - saved[n]).abs().max().item() for n in saved)
            exact = all(torch.equal(final[n], saved[n]) for n in saved)
            result[name] = dict(
                losses=second, state_exact=state_exact, params_exact=exact, param_diff=diff
            )
        else:
            try:
                load(model, opt, path, d)
                result[name] = dict(error=None)
            except ValueError as e:
                result[name] = dict(error=str(e))
    if mode == "resume":
        result["template_leak"] = template_leak(bits)
    write(out, result)


if __name__ == "__main__":
    main()
    finish()
