"""Accelerate ``save_state`` at one number of processes, ``load_state`` at another.

Run by tests/test_accelerate_elastic.py under torchrun, with ``ACCELERATE_USE_CPU=true``
(MULTI_CPU DDP, ``Gefen`` passed to ``prepare``) or ``ACCELERATE_USE_DEEPSPEED=true
ACCELERATE_DEEPSPEED_CONFIG_FILE=configs/ds_zero2_auto_cpu.json`` (``DummyOptim``; DeepSpeed
builds Gefen from the JSON):

- ``save OUT CKPT``: the tiny GPT, STEPS steps over the same global batches of 4 sequences at
  any number of processes (the prepared DataLoader's batch of 4 / processes, which Accelerate's
  sharding hands process r as its slice of each global batch), ``save_state(CKPT)`` after
  SAVE_AT: the uninterrupted run.
- ``resume OUT CKPT``: the same script at another number of processes, ``load_state(CKPT)``,
  then steps SAVE_AT .. STEPS.

Each process writes OUT/rank{r}.json: its losses (the mean over processes, each step).

One launch runs a list of jobs in turn: ``accel_elastic.py JOBS``, JOBS a JSON file of
``{"env": {...}, "mode": ..., "out": ..., "ckpt": ...}`` objects, ``env`` the job's Accelerate
variables (above). Between jobs Accelerate's process-wide state is reset (what a new process
would start from; the process group stays) and the job's model, optimizer and engine are freed:
every launch pays seconds of start-up, a job a fraction of that.
"""

import gc
import json
import os
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType, DummyOptim, InitProcessGroupKwargs
from torch.utils.data import DataLoader, TensorDataset

import gefen_dist
from gefen_dist import Gefen
from gefen_dist.demo.model import GPT, GPTConfig
from teardown import finish

torch.set_num_threads(1)
TINY = GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=64)
STEPS, SAVE_AT, GLOBAL_BATCH = 30, 10, 4


LAYOUT_VARS = ("ACCELERATE_USE_CPU", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_DEEPSPEED_CONFIG_FILE")


def job(mode: str, out_dir: Path, ckpt: str) -> Accelerator:
    # Without a GPU, Accelerate's DeepSpeed path needs gloo named (tests/dist/reg_accel.py).
    cpu = not torch.cuda.is_available()
    acc = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")] if cpu else [])
    torch.manual_seed(0)
    model = GPT(TINY)
    ds = acc.distributed_type == DistributedType.DEEPSPEED
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, 256, (GLOBAL_BATCH * STEPS, 16), generator=g)
    data = TensorDataset(x, torch.roll(x, -1, dims=1))
    dl = DataLoader(data, batch_size=GLOBAL_BATCH // acc.num_processes)
    if ds:
        opt = DummyOptim(model.parameters(), lr=3e-3, weight_decay=0.1)
    else:
        opt = Gefen(model.parameters(), lr=3e-3, weight_decay=0.1, bits=4)
    model, opt, dl = acc.prepare(model, opt, dl)
    batches = list(dl)
    assert len(batches) == STEPS

    def step(s: int) -> float:
        loss = model(*batches[s])[1]
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        return float(acc.reduce(loss.detach(), "mean"))

    if mode == "save":
        losses = [step(s) for s in range(SAVE_AT)]
        acc.save_state(ckpt)
        losses += [step(s) for s in range(SAVE_AT, STEPS)]
    inner = acc.deepspeed_engine_wrapped.engine.basic_optimizer if ds else opt.optimizer
    loaded_steps = None
    if mode == "resume":
        acc.load_state(ckpt)
        loaded_steps = sorted({float(st["step"]) for st in inner.state.values() if st})
        losses = [step(s) for s in range(SAVE_AT, STEPS)]
    out = {
        "rank": acc.process_index,
        "world": acc.num_processes,
        "distributed_type": str(acc.distributed_type),
        "basic": type(inner).__name__,
        "losses": losses,
        "loaded_steps": loaded_steps,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"rank{acc.process_index}.json").write_text(json.dumps(out))
    return acc


def main() -> None:
    gefen_dist.register()
    # One process group for all the jobs, ended by ``finish``: Accelerate and DeepSpeed take the
    # one they find. A group destroyed (``end_training``) and made again between jobs hung a
    # 4-process launch.
    for spec in json.loads(Path(sys.argv[1]).read_text()):
        for var in LAYOUT_VARS:
            os.environ.pop(var, None)
        os.environ.update(spec["env"])
        AcceleratorState._reset_state(reset_partial_state=True)
        acc = job(spec["mode"], Path(spec["out"]), spec["ckpt"])
        acc.wait_for_everyone()
        acc.free_memory()  # the prepared model, optimizer and engine, while the group is up
        gc.collect()


if __name__ == "__main__":
    main()
    finish()
