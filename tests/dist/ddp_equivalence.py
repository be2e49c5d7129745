"""DDP on 2 ranks against single-process Gefen, and a DDP checkpoint round trip.

argv: OUT STEPS. DDP hands Gefen whole, replicated parameters and all-reduced gradients, so Gefen
needs no integration: every rank must end with the same block sizes, codebook and optimizer state,
bit for bit, and follow the single-process run. Runs "same" (every rank on the whole batch: the
averaged gradient is bitwise the reference one, so the run must equal it exactly) and "split"
(data parallel: fp32 rounding of the gradient average only). Then the usual DDP checkpoint: rank 0
saves ``optimizer.state_dict()``, a new model and optimizer load it and must continue exactly as
the uninterrupted run.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from fsdp_common import build, codebooks, gefen, init, reference, train, write
from torch.nn.parallel import DistributedDataParallel as DDP
from teardown import finish


def state_digest(opt) -> str:
    """One hash of every state tensor of every parameter, in parameter order."""
    h = hashlib.sha256()
    for g in opt.param_groups:
        for p in g["params"]:
            for k, v in sorted(opt.state.get(p, {}).items()):
                h.update(k.encode())
                h.update(v.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def solo_codebooks(first: dict[str, torch.Tensor], bits: int) -> list[list[float]]:
    """The codebook one process learns from these first gradients: with the batch split, DDP's
    averaged gradient differs from the whole batch's by fp32 rounding, and an exact DP codebook
    is not continuous in its input (a sample crossing a histogram bin edge can move a sparse
    tail level by a fraction of a bin), so the split run is held to the codebook of its own
    gradient, exactly, rather than to the whole batch's within a tolerance."""
    solo = build("gpt")
    for n, p in solo.named_parameters():
        p.grad = first[n].clone()
    opt = gefen(solo.parameters(), bits)
    opt.step()
    return codebooks(opt)


def run(steps: int, bits: int, split: bool, ref: dict) -> dict:
    model = DDP(build("gpt"))
    opt = gefen(model.parameters(), bits)
    names = {p: n.removeprefix("module.") for n, p in model.named_parameters()}
    first: dict[str, torch.Tensor] = {}
    step = opt.step

    def step_keeping_the_first_gradients(*args, **kwargs):
        if not first:
            first.update({names[p]: p.grad.detach().clone() for p in model.parameters()})
        return step(*args, **kwargs)

    opt.step = step_keeping_the_first_gradients
    losses = train("gpt", model, opt, 0, steps, split)
    drift = {
        names[p]: (p.detach() - ref["params"][names[p]]).abs().max().item()
        for p in model.parameters()
    }
    rep = opt.memory_report()
    return dict(
        losses=losses,
        codebooks=codebooks(opt),
        solo_codebooks=solo_codebooks(first, bits),
        blocks={names[p]: int(st["layout"][0, 3]) for p, st in opt.state.items()},
        digest=state_digest(opt),
        param_drift=drift,
        memory=dict(state_bytes=rep["state_bytes"], adamw_bytes=rep["adamw_bytes"]),
    )


def resume(ckdir: Path, bits: int) -> dict:
    model = DDP(build("gpt"))
    opt = gefen(model.parameters(), bits)
    train("gpt", model, opt, 0, 3)
    if dist.get_rank() == 0:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, ckdir / "ddp.pt")
    dist.barrier()
    whole = train("gpt", model, opt, 3, 3)
    fresh = DDP(build("gpt"))
    fresh_opt = gefen(fresh.parameters(), bits)
    ck = torch.load(ckdir / "ddp.pt", weights_only=True)
    fresh.load_state_dict(ck["model"])
    fresh_opt.load_state_dict(ck["opt"])
    resumed = train("gpt", fresh, fresh_opt, 3, 3)
    pairs = zip(model.parameters(), fresh.parameters(), strict=True)
    exact = all(torch.equal(a, b) for a, b in pairs)
    return dict(
        losses=whole,
        resumed_losses=resumed,
        params_exact=exact,
        state_exact=state_digest(opt) == state_digest(fresh_opt),
    )


def main() -> None:
    out, steps = sys.argv[1], int(sys.argv[2])
    init()
    ref = reference("gpt", steps, 8)
    result: dict = {
        "ref": dict(
            losses=ref["losses"], blocks=ref["blocks"], codebooks=[ref["codebook"].tolist()]
        )
    }
    for mode in ("same", "split"):
        result[mode] = run(steps, 8, mode == "split", ref)
    Path(out).mkdir(parents=True, exist_ok=True)
    result["resume"] = resume(Path(out), 4)
    write(out, result)


if __name__ == "__main__":
    main()
    finish()
