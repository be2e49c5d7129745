"""Checkpoints of Gefen under FSDP2 with tensor parallelism on 4 ranks as a (dp=2, tp=2) mesh.

argv: MODE OUT CKDIR BITS. Each mode runs twice: tensor parallelism on every linear layer, and on
attention alone, the norms and MLP left to FSDP2 on the dp mesh
(``tp_common.parallelize(attention_only=True)``; its files
under CKDIR/tp_attn, its results under "tp_attn").

- ``save`` (``save_run``, also called by tp_train.py to spare a launch): train FIRST steps
  (each dp rank on its half of the batch), save a DCP checkpoint (``dcp.save`` of
  ``get_state_dict``) and a full state dict
  (``get_optimizer_state_dict(full_state_dict=True, cpu_offload=True)``, rank 0 writes it), dump
  each rank's raw Gefen state, train SECOND more steps and keep the final full parameters: the
  uninterrupted run.
- ``resume`` (a fresh process): build everything anew; load the DCP checkpoint, compare the raw
  state with the dump, train the same steps and compare parameters and losses with the
  uninterrupted run; then, anew, load the full state dict at the same mesh
  (``set_optimizer_state_dict(full_state_dict=True)``: each rank cuts its pieces from the whole
  tensors' state, ``method.portable``) and train the same steps; and load it into one process
  (``checkpoint.load_optimizer``, no TP nor FSDP) and train the same steps on the whole batch.
- ``reshard`` (a fresh process): the DCP checkpoint of the (2, 2) mesh loaded with nothing but
  DCP's own calls (``get_state_dict``, ``dcp.load``, ``set_state_dict``) at another layout:
  a (dp=1, tp=4) mesh, and FSDP2 alone over the 4 ranks (no tensor parallelism); the full
  state dict at (1, 4) (``set_optimizer_state_dict(full_state_dict=True)``); then a run saved at
  (1, 4) loaded at (2, 2). Each trains the same steps as the run that never stopped;
  each records the bytes of optimizer state DCP read into the rank's template against the
  checkpoint's whole (``dcp_reshard.nbytes``, ``saved_bytes``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dcp_reshard import nbytes, saved_bytes
from fsdp_checkpoint import equal_states, raw_state
from fsdp_common import gefen, init, write
from teardown import finish
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from tp_common import SHAPE, build, full_params, mesh2d, parallelize, train

from gefen_dist import checkpoint

FIRST, SECOND = 3, 3


def setup_run(bits: int, attention_only: bool = False, shape: tuple[int, int] = SHAPE):
    mesh = mesh2d(shape)
    model = parallelize(build(), mesh, attention_only=attention_only)
    return model, gefen(model.parameters(), bits), mesh


def setup_fsdp(bits: int):
    """FSDP2 alone over every rank: the layout of a run that drops tensor parallelism."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    model = build()
    for m in (model.attn, model.mlp, model):
        fully_shard(m, mesh=mesh)
    return model, gefen(model.parameters(), bits), mesh


def save_run(
    ck: Path, bits: int, attention_only: bool = False, shape: tuple[int, int] = SHAPE
) -> dict:
    rank = dist.get_rank()
    ck.mkdir(parents=True, exist_ok=True)
    model, opt, mesh = setup_run(bits, attention_only, shape)
    first = train(model, opt, 0, FIRST, mesh, True)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(ck / "dcp"))
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    fmsd = get_model_state_dict(model, options=full)
    fosd = get_optimizer_state_dict(model, opt, options=full)
    if rank == 0:
        torch.save({"model": fmsd, "optim": fosd}, ck / "full.pt")
    torch.save(raw_state(opt), ck / f"raw{rank}.pt")
    second = train(model, opt, FIRST, SECOND, mesh, True)
    torch.save(full_params(model), ck / f"final{rank}.pt")
    return dict(losses=first + second, run=opt.attached("fsdp").run)


def resume_run(ck: Path, bits: int, attention_only: bool = False) -> dict:
    rank = dist.get_rank()
    model, opt, mesh = setup_run(bits, attention_only)
    result = {}
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(ck / "dcp"))
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    state_exact = equal_states(raw_state(opt), torch.load(ck / f"raw{rank}.pt"))
    second = train(model, opt, FIRST, SECOND, mesh, True)
    final, saved = full_params(model), torch.load(ck / f"final{rank}.pt")
    result["dcp"] = dict(
        losses=second,
        state_exact=state_exact,
        params_exact=all(torch.equal(final[n], saved[n]) for n in saved),
        param_diff=max((final[n] - saved[n]).abs().max().item() for n in saved),
    )
    model, opt, mesh = setup_run(bits, attention_only)
    tree = torch.load(ck / "full.pt", weights_only=True)
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, tree["model"], options=options)
    set_optimizer_state_dict(model, opt, tree["optim"], options=options)
    result["full"] = dict(losses=train(model, opt, FIRST, SECOND, mesh, True))
    # the same full state dict in one process (no TP, no FSDP) on the whole batch
    tree = torch.load(ck / "full.pt", weights_only=True)  # set_*_state_dict took the first
    plain = build()
    plain.load_state_dict(tree["model"])
    one = gefen(plain.parameters(), bits)
    checkpoint.load_optimizer(one, plain, tree["optim"])
    result["one_process"] = dict(
        losses=train(plain, one, FIRST, SECOND, None, False),
        blocks=sorted({int(st["layout"][0, 3]) for st in one.state.values()}),
    )
    return result


def load_elsewhere(ck: Path, built) -> dict:
    """The plain loop at the layout ``built`` gives: (model, Gefen, mesh) afresh."""
    model, opt, mesh = built
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(ck))
    read = nbytes(osd["state"])
    per_element = nbytes(_per_element(osd["state"]))
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    return dict(
        losses=train(model, opt, FIRST, SECOND, mesh, True),
        read_bytes=read,
        saved_bytes=saved_bytes(str(ck)),
        read_per_element=per_element,
        saved_per_element=saved_bytes(str(ck), _PER_ELEMENT),
        share_per_element=_share(ck, model),
        blocks={n: int(opt.state[p]["layout"][0, 3]) for n, p in model.named_parameters()},
    )


_PER_ELEMENT = ("codes", "exp_avg", "exp_avg_sq")


def _per_element(state: dict) -> dict:
    return {(fqn, k): v for fqn, st in state.items() for k, v in st.items() if k in _PER_ELEMENT}


def _share(ck: Path, model) -> float:
    """Bytes of the saved per-element fields that this rank's pieces hold: each parameter's
    fields times the share of its elements the rank holds (all of a tp-replicated norm)."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(ck)).read_metadata().state_dict_metadata
    out = 0.0
    for name, p in model.named_parameters():
        share = p.to_local().numel() / p.numel()
        for k in _PER_ELEMENT:
            m = md.get(f"optim.state.{name}.{k}")
            if m is not None:
                out += (
                    share * m.size.numel() * torch.empty(0, dtype=m.properties.dtype).element_size()
                )
    return out


def reshard_run(ck: Path, bits: int) -> dict:
    result = {
        "tp4": load_elsewhere(ck / "dcp", setup_run(bits, shape=(1, 4))),
        "fsdp": load_elsewhere(ck / "dcp", setup_fsdp(bits)),
    }
    model, opt, mesh = setup_run(bits, shape=(1, 4))
    tree = torch.load(ck / "full.pt", weights_only=True)
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, tree["model"], options=options)
    set_optimizer_state_dict(model, opt, tree["optim"], options=options)
    result["full_tp4"] = dict(losses=train(model, opt, FIRST, SECOND, mesh, True))
    result["saved_tp4"] = save_run(ck / "tp4", bits, shape=(1, 4))
    result["tp4_to_2x2"] = load_elsewhere(ck / "tp4" / "dcp", setup_run(bits))
    return result


def main() -> None:
    mode, out, ck, bits = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
    init()
    if mode == "reshard":
        write(out, reshard_run(ck, bits))
        return
    run = save_run if mode == "save" else resume_run
    write(out, {**run(ck, bits), "tp_attn": run(ck / "tp_attn", bits, attention_only=True)})


if __name__ == "__main__":
    main()
    finish()
