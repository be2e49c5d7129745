"""One run on one rank, from the device to the process group's end: the order in which the other
parts are called, and nothing else (torchtitan's ``Trainer.__init__``, ``train`` and ``close``, in
one function at this script's scale).
"""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist

from gefen_dist.demo import loop
from gefen_dist.demo.model import GPT, GPTConfig

from .checkpoint import load_checkpoint
from .checkpoint_dir import find_checkpoint, remove_torn
from .config import ConfigError
from .faults import Chaos, ChaosKill
from .launchers import Wrapped, rank_device, setup, what_ran
from .loop import RunData, prepare_data, run_steps
from .optimizer import stepped
from .results import (
    Outcome,
    RankStats,
    gather_digests,
    gather_stats,
    print_summary,
    results,
    write,
)

if TYPE_CHECKING:
    from accelerate import Accelerator


def gpt_config(cfg: dict) -> GPTConfig:
    m = cfg["model"]
    return GPTConfig(
        block_size=m["block_size"], n_layer=m["n_layer"], n_head=m["n_head"], n_embd=m["n_embd"]
    )


class Start(NamedTuple):
    """Where the steps begin: after ``step`` (0 for a fresh run), continuing ``trace`` (None for
    a fresh run, whose loop evaluates step 0 first)."""

    step: int
    trace: loop.Trace | None


def resume(cfg: dict, run: Wrapped, data: RunData) -> Start:
    """Load ``checkpoint.resume`` into the run where it is set, and continue its batch stream."""
    ck = cfg["checkpoint"]
    if not ck["resume"]:
        return Start(0, None)
    src = find_checkpoint(ck["resume"])
    if src is None:  # checked in main(); here for a caller of train() itself
        raise ConfigError(f"checkpoint.resume {ck['resume']!r}: no complete checkpoint")
    trainer = load_checkpoint(cfg, src, run)
    data.gen.set_state(trainer.data_rng)
    if dist.get_rank() == 0:
        print(f"resuming at step {trainer.step} from {src}", flush=True)
    return Start(trainer.step, loop.Trace(curve=trainer.curve, window=trainer.window))


def teardown(accelerator: Accelerator | None) -> None:
    """End the process group after a barrier; the caller has dropped the model and optimizer.

    A rank that exits with gloo's threads still live can abort in teardown ("terminate called
    without an active exception"), as one accelerate rank and later one DeepSpeed rank did in CI.
    DDP's C++ Reducer holds the group as well and keeps the GIL in its destructor: freed after
    the group was destroyed, it joined a gloo thread waiting for the GIL and the rank hung (twice
    in accelerate runs). Freed here, while the group is still registered, it leaves the last
    reference to the group object, which releases the GIL."""
    if accelerator is not None:
        accelerator.free_memory()
    gc.collect()
    if accelerator is not None:
        accelerator.wait_for_everyone()
        accelerator.end_training()
    else:
        dist.barrier()
        dist.destroy_process_group()


def train(
    cfg: dict,
    out: str | None = None,
    progress: bool = True,
    with_digest: bool = False,
    chaos: ChaosKill | None = None,
) -> dict | None:
    """Train under the configured sharding; rank 0 returns (and writes to ``out``) the results.
    ``chaos`` is the parsed ``GEFEN_CHAOS_KILL`` test hook (``trainer.faults``)."""
    torch.set_num_threads(1)
    mcfg = gpt_config(cfg)
    torch.manual_seed(cfg["seed"])
    device = rank_device(cfg)
    run = setup(cfg, GPT(mcfg), device)
    rank, world = dist.get_rank(), dist.get_world_size()
    killer = Chaos(chaos, rank)
    killer.install(run.model, run.opt)
    data = prepare_data(cfg, rank, run)
    ck = cfg["checkpoint"]
    if ck["dir"] and rank == 0:
        gone = remove_torn(Path(ck["dir"]))
        if gone:
            print(f"removed torn checkpoints in {ck['dir']}: {', '.join(gone)}", flush=True)
    start = resume(cfg, run, data)

    t_start = time.perf_counter()
    trace = run_steps(cfg, run, killer, data, start.step, start.trace, progress)
    wall = time.perf_counter() - t_start
    ran = what_ran(cfg, run)
    ranks = gather_stats(RankStats.mine(run, [ms / 1000 for ms in trace.step_ms]))
    digests = gather_digests(run) if with_digest else None
    result = None
    if rank == 0:
        outcome = Outcome(
            ran=ran,
            world_size=world,
            resumed_from_step=start.step,
            n_params=sum(p.numel() for p in GPT(mcfg).parameters()),
            curve=trace.curve,
            final_lr=stepped(run.opt).param_groups[0]["lr"],
            wall_time_s=wall,
        )
        result = results(cfg, outcome, ranks, digests)
        write(result, out)
        print_summary(result)
    accelerator = run.accelerator
    del run  # the last reference to the model and optimizer, which must go first (teardown)
    teardown(accelerator)
    return result
