"""Plain DCP checkpoints of Gefen under FSDP2 and HSDP, saved on N ranks, loaded on M.

Jobs, joined by ``+`` in one launch (each frees its models before the next):

- ``save OUT CK LAYOUT STEPS SAVE_AT BITS``: the demo GPT under LAYOUT (``fsdp2``: 1-D over
  this world; ``hsdp2``: a 2 x 2 (replicate, shard) mesh), or ``odd``: ``fsdp_common.Odd``
  under 1-D FSDP2 (101 rows: column blocks that every row split cuts; every rank takes the
  whole batch, so that no data-parallel average rounds and a drift is the re-cut's), data parallel over the same global
  batches; at SAVE_AT ``get_state_dict`` and ``dcp.save`` into CK/LAYOUT-w{world}, and each
  rank's Gefen state as it was (for the same-layout check); then on to STEPS: the uninterrupted
  run's losses, in OUT/save-LAYOUT-w{world}/.
- ``legacy OUT DIR``: a per-rank-format checkpoint (tests/data) loaded the same way.
- ``resume OUT CK SAVED LAYOUT SAVE_AT STEPS BITS``: the model and Gefen built afresh under
  LAYOUT at this world size, then what a user writes: ``get_state_dict``, ``dcp.load`` with no
  planner, ``set_state_dict``; steps SAVE_AT .. STEPS. Writes the losses, the block size per
  tensor, whether each rank's Gefen state equals the saved one, the bytes of optimizer state
  DCP read into this rank's template against the checkpoint's whole, and the rank's peak RSS.
"""

from __future__ import annotations

import gc
import resource
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsdp_checkpoint import equal_states, raw_state
from fsdp_common import gefen, init, jobs, train, write
from hsdp_common import wrap
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from gefen_dist import checkpoint
from teardown import finish


def kind_of(layout: str) -> str:
    return "odd" if layout == "odd" else "gpt"


def built(layout: str, bits: int):
    if layout == "odd":  # column blocks, which FSDP2's uneven row split cuts
        from fsdp_common import wrap as wrap1

        model = wrap1("odd", "fsdp2")
    else:
        model = wrap("gpt", "fsdp2_world" if layout == "fsdp2" else layout)
    return model, gefen(model.parameters(), bits)


def blocks(model, opt) -> dict[str, int]:
    return {n: int(opt.state[p]["layout"][0, 3]) for n, p in model.named_parameters()}


def nbytes(tree) -> int:
    """Bytes of the tensors in ``tree`` that this rank holds (a DTensor's local piece): what
    DCP read into Gefen's template here."""
    if isinstance(tree, dict):
        return sum(nbytes(v) for v in tree.values())
    if isinstance(tree, torch.Tensor):
        t = tree.to_local() if hasattr(tree, "to_local") else tree
        return t.numel() * t.element_size()
    return 0


def saved_bytes(path: str, fields: tuple[str, ...] = ()) -> int:
    """Bytes of the checkpoint's optimizer state, every rank's, from its metadata; of the
    fields named ``fields`` alone where given."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(path).read_metadata().state_dict_metadata
    return sum(
        m.size.numel() * torch.empty(0, dtype=m.properties.dtype).element_size()
        for k, m in md.items()
        if k.startswith("optim.state.")
        and isinstance(m, TensorStorageMetadata)
        and (not fields or k.rsplit(".", 1)[-1] in fields)
    )


def save(out: str, ck: str, layout: str, steps: int, save_at: int, bits: int) -> None:
    name = f"{layout}-w{dist.get_world_size()}"
    model, opt = built(layout, bits)
    losses = train(kind_of(layout), model, opt, 0, save_at, split=layout != "odd")
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{ck}/{name}")
    torch.save(raw_state(opt), f"{ck}/{name}/raw{dist.get_rank()}.pt")
    losses += train(kind_of(layout), model, opt, save_at, steps - save_at, split=layout != "odd")
    write(f"{out}/save-{name}", dict(losses=losses, blocks=blocks(model, opt)))


def resume(out: str, ck: str, saved: str, layout: str, save_at: int, steps: int, bits: int) -> None:
    model, opt = built(layout, bits)
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=f"{ck}/{saved}")
    read, whole = nbytes(osd["state"]), saved_bytes(f"{ck}/{saved}")
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    mine = Path(f"{ck}/{saved}/raw{dist.get_rank()}.pt")
    same = None
    if saved == f"{layout}-w{dist.get_world_size()}" and mine.exists():
        same = equal_states(raw_state(opt), torch.load(mine, weights_only=True))
    result = dict(
        blocks=blocks(model, opt), state_as_saved=same, read_bytes=read, saved_bytes=whole
    )
    result["losses"] = train(
        kind_of(layout), model, opt, save_at, steps - save_at, split=layout != "odd"
    )
    result["peak_rss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    write(f"{out}/resume-{saved}-to-{layout}-w{dist.get_world_size()}", result)


def legacy(out: str, ck: str) -> None:
    """A checkpoint in the per-rank format (``gefen.rank{r}`` entries: tests/data, saved on 2
    ranks by gefen_dist before format 2) loaded with the same plain loop at this world size."""
    from fsdp_common import wrap as wrap1

    model = wrap1("odd", "fsdp2")
    opt = gefen(model.parameters(), 4)
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=ck)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    # the documented way for such a checkpoint at another layout before format 2: in one
    # process the same state (at more ranks a re-cut of the whole differs from one of the pieces)
    other = wrap1("odd", "fsdp2")
    other_opt = gefen(other.parameters(), 4)
    tree, _ = checkpoint.consolidate(checkpoint.read_dcp(ck))
    set_model_state_dict(other, tree["model"], options=StateDictOptions(full_state_dict=True))
    checkpoint.load_optimizer(other_opt, other, tree["optim"])
    same = equal_states(raw_state(other_opt), raw_state(opt))
    losses = train("odd", model, opt, 3, 4)
    write(f"{out}/legacy-w{dist.get_world_size()}", dict(losses=losses, as_consolidated=same))


def main() -> None:
    init()
    for job in jobs(sys.argv[1:]):
        mode, out, ck, *rest = job
        if mode == "save":
            layout, steps, save_at, bits = rest
            save(out, ck, layout, int(steps), int(save_at), int(bits))
        elif mode == "legacy":
            legacy(out, ck)
        elif mode == "resume":
            saved, layout, save_at, steps, bits = rest
            resume(out, ck, saved, layout, int(save_at), int(steps), int(bits))
        else:
            raise ValueError(f"job mode: save or resume, got {mode!r}")
        gc.collect()
        dist.barrier()


if __name__ == "__main__":
    main()
    finish()
