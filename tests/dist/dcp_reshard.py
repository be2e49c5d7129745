"""Plain DCP checkpoints of Gefen under FSDP2 and HSDP, saved on N ranks, loaded on M.

Jobs, joined by ``+`` in one launch (each frees its models before the next):

- ``save OUT CK LAYOUT STEPS SAVE_AT BITS``: the demo GPT under LAYOUT (``fsdp2``: 1-D over
  this world; ``hsdp2``: a 2 x 2 (replicate, shard) mesh), data parallel over the same global
  batches; at SAVE_AT ``get_state_dict`` and ``dcp.save`` into CK/LAYOUT-w{world}, and each
  rank's Gefen state as it was (for the same-layout check); then on to STEPS: the uninterrupted
  run's losses, in OUT/save-LAYOUT-w{world}/.
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
from fsdp_common import gefen, init, train, write
from hsdp_common import wrap
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from teardown import finish


def built(layout: str, bits: int):
    model = wrap("gpt", "fsdp2_world" if layout == "fsdp2" else layout)
    return model, gefen(model.parameters(), bits)


def raw(opt) -> list[dict[str, torch.Tensor]]:
    return [{k: v.detach().cpu().clone() for k, v in st.items()} for st in opt.state.values()]


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


def saved_bytes(path: str) -> int:
    """Bytes of the checkpoint's optimizer state, every rank's, from its metadata."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(path).read_metadata().state_dict_metadata
    return sum(
        m.size.numel() * torch.empty(0, dtype=m.properties.dtype).element_size()
        for k, m in md.items()
        if k.startswith("optim.state.") and isinstance(m, TensorStorageMetadata)
    )


def save(out: str, ck: str, layout: str, steps: int, save_at: int, bits: int) -> None:
    name = f"{layout}-w{dist.get_world_size()}"
    model, opt = built(layout, bits)
    losses = train("gpt", model, opt, 0, save_at)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{ck}/{name}")
    torch.save(raw(opt), f"{ck}/{name}/raw{dist.get_rank()}.pt")
    losses += train("gpt", model, opt, save_at, steps - save_at)
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
        was = torch.load(mine, weights_only=True)
        now = raw(opt)
        same = len(was) == len(now) and all(
            a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
            for a, b in zip(was, now, strict=True)
        )
    result = dict(
        blocks=blocks(model, opt), state_as_saved=same, read_bytes=read, saved_bytes=whole
    )
    result["losses"] = train("gpt", model, opt, save_at, steps - save_at)
    result["peak_rss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    write(f"{out}/resume-{saved}-to-{layout}-w{dist.get_world_size()}", result)


def main() -> None:
    init()
    argv = sys.argv[1:]
    while argv:
        job, argv = (
            (argv[: argv.index("+")], argv[argv.index("+") + 1 :]) if "+" in argv else (argv, [])
        )
        mode, out, ck, *rest = job
        if mode == "save":
            layout, steps, save_at, bits = rest
            save(out, ck, layout, int(steps), int(save_at), int(bits))
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
