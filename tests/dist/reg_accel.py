"""Gefen through Accelerate on 2 CPU ranks: DDP, and DeepSpeed with the optimizer from the JSON.

Run by tests/test_registration.py: ``reg_accel.py OUT CKPT`` under torchrun with
``ACCELERATE_USE_CPU=true`` (MULTI_CPU DDP, ``Gefen`` passed to ``prepare``), with
``ACCELERATE_USE_FSDP=true FSDP_VERSION=1|2`` (GPUs only; FSDP1 needs
``gefen_dist.integrations.fsdp.configure``, FSDP2 nothing), or
``ACCELERATE_USE_DEEPSPEED=true ACCELERATE_DEEPSPEED_CONFIG_FILE=configs/ds_zero*_auto_cpu.json``
(``DummyOptim`` passed to ``prepare``; DeepSpeed builds Gefen from ``"type": "Gefen"``; the one
Gefen-specific line is ``gefen_dist.register()``, since Accelerate imports DeepSpeed only inside
``prepare``). Trains 6 steps, saving with ``save_state`` after 3, then ``load_state`` and replays
steps 3-5: losses and weights must come out bitwise equal, which needs Gefen's state restored.
Each rank writes OUT/rank{r}.json.
"""

import json
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, DummyOptim, InitProcessGroupKwargs
from torch.utils.data import DataLoader, TensorDataset

import gefen_dist
import gefen_dist.integrations.fsdp
from gefen_dist import Gefen
from gefen_dist.demo.model import GPT, GPTConfig
from teardown import finish

torch.set_num_threads(1)
TINY = GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=64)
STEPS, SAVE_AT = 6, 3


def main():
    out_dir, ckpt = (Path(a) for a in sys.argv[1:3])
    gefen_dist.register()
    # Without a GPU, Accelerate's DeepSpeed path finds no backend and calls every rank rank 0 of 1
    # (DataLoader unsharded); naming gloo makes it use the 2-rank group DeepSpeed initialises.
    cpu = not torch.cuda.is_available()
    acc = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")] if cpu else [])
    torch.manual_seed(0)
    model = GPT(TINY)
    ds = acc.distributed_type == DistributedType.DEEPSPEED
    fsdp1 = acc.distributed_type == DistributedType.FSDP and acc.is_fsdp2 is False
    x = torch.randint(0, 256, (4 * 2 * STEPS, 16), generator=torch.Generator().manual_seed(7))
    dl = DataLoader(TensorDataset(x, torch.roll(x, -1, dims=1)), batch_size=4)
    if ds:
        opt = DummyOptim(model.parameters(), lr=3e-3, weight_decay=0.1)
    elif fsdp1:  # FSDP1 wants the model wrapped before the optimizer sees its parameters
        model = acc.prepare(model)
    if not ds:
        opt = Gefen(model.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.999))
    if fsdp1:
        opt, dl = acc.prepare(opt, dl)
        gefen_dist.integrations.fsdp.configure(model, opt.optimizer)
    else:
        model, opt, dl = acc.prepare(model, opt, dl)
    batches = list(dl)
    assert len(batches) == STEPS

    def step(s):
        loss = model(*batches[s])[1]
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        return loss.item()

    def weights():
        """This rank's weights: whole tensors (DDP, ZeRO-2) or local shards (FSDP)."""
        local = {n: getattr(p, "to_local", lambda p=p: p)() for n, p in model.named_parameters()}
        return {n: t.detach().clone() for n, t in local.items()}

    losses = []
    for s in range(STEPS):
        if s == SAVE_AT:
            acc.save_state(str(ckpt))
        losses.append(step(s))
    final = weights()
    acc.load_state(str(ckpt))
    replay = [step(s) for s in range(SAVE_AT, STEPS)]
    again = weights()

    out = {
        "rank": acc.process_index,
        "world_size": acc.num_processes,
        "distributed_type": str(acc.distributed_type),
        "losses": losses,
        "replay": replay,
        "resume_exact": all(torch.equal(final[n], again[n]) for n in final),
    }
    if ds:
        import gefen_dist.integrations.deepspeed as gd

        eng = acc.deepspeed_engine_wrapped.engine
        out["basic"] = type(eng.basic_optimizer).__name__
        out["wrapper"] = type(eng.optimizer).__name__
        out["zero_stage"] = eng.zero_optimization_stage()
        out["lr"] = eng.basic_optimizer.param_groups[0]["lr"]
        mem = gd.memory_report(eng)
        out["memory"] = [mem["state_bytes"], mem["adamw_bytes"]]
    else:
        inner = opt.optimizer
        out["basic"] = type(inner).__name__
        out["model"] = type(model).__name__
        mem = inner.memory_report()
        out["memory"] = [mem["state_bytes"], mem["adamw_bytes"]]
    (out_dir / f"rank{acc.process_index}.json").write_text(json.dumps(out))
    acc.wait_for_everyone()
    acc.end_training()


if __name__ == "__main__":
    main()
    finish()
