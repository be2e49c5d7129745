"""The Triton backend under FSDP2 on 2 gloo ranks (CPU tensors, Triton's interpreter).

argv: OUT CKDIR BITS. Runs, on the same sharded tiny GPT and data:

- ``triton``: 3 steps, a DCP checkpoint (get_state_dict / dcp.save), 3 more;
- ``resumed``: a fresh model and optimizer, dcp.load of that checkpoint, the same 3 steps;
- ``native``: the C++ kernel, 6 steps, for the backends' agreement.

Writes rank{r}.json: per run the losses, the final full parameters' digest and max |difference|
to the triton run, the backend the memory report names and the codebooks.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsdp_common import codebooks, full_params, gefen, init, train, wrap, write
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from teardown import finish

FIRST, SECOND = 3, 3


def build(backend: str, bits: int):
    model = wrap("gpt", "fsdp2")
    opt = gefen(model.parameters(), bits)
    opt.backend = backend
    return model, opt


def main() -> None:
    out, ckdir, bits = sys.argv[1], sys.argv[2], int(sys.argv[3])
    assert os.environ.get("TRITON_INTERPRET") == "1"
    init()
    res: dict = {}

    model, opt = build("triton", bits)
    losses = train("gpt", model, opt, 0, FIRST)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckdir)
    losses += train("gpt", model, opt, FIRST, SECOND)
    want = full_params(model, "fsdp2")
    res["triton"] = dict(
        losses=losses, backend=opt.memory_report()["backend"], codebooks=codebooks(opt)
    )
    del model, opt

    model, opt = build("triton", bits)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=ckdir)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    resumed = train("gpt", model, opt, FIRST, SECOND)
    got = full_params(model, "fsdp2")
    res["resumed"] = dict(
        losses=resumed,
        bits_equal=all(torch.equal(got[n], want[n]) for n in want),
        backend=opt.memory_report()["backend"],
    )
    del model, opt

    model, opt = build("native", bits)
    start = full_params(model, "fsdp2")
    native = train("gpt", model, opt, 0, FIRST + SECOND)
    other = full_params(model, "fsdp2")
    res["native"] = dict(
        losses=native,
        backend=opt.memory_report()["backend"],
        max_param_diff=max((want[n] - other[n]).abs().max().item() for n in want),
        max_moved=max((want[n] - start[n]).abs().max().item() for n in want),
        codebooks=codebooks(opt),
    )
    del model, opt
    write(out, res)


if __name__ == "__main__":
    main()
    finish()
