"""The training steps: this rank's data, one step under each launcher, the evaluation, and what
runs after a step (a checkpoint where one is due, the progress bar), around the loop that the
demo and the benchmark suite share (``gefen_dist.demo.loop``), which owns the order of things.

Here, and not in the setups, because a step is the same under every launcher but for who runs
the backward and the update (``_update``), and the checkpoint and fault hook only need to be told
the step.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from gefen_dist.demo import loop
from gefen_dist.demo.corpus import get_batch, load_corpus
from gefen_dist.distributed.collectives import comm_device

from .checkpoint import TrainerState, save_checkpoint
from .config import lr_factor
from .faults import Chaos
from .launchers import Wrapped


@dataclass
class RunData:
    """What the steps draw from: the training tokens, the fixed validation batches (the same on
    every rank), this rank's batch generator, and each param group's lr before the schedule."""

    train_tokens: torch.Tensor
    val_batches: list[tuple[torch.Tensor, torch.Tensor]]
    gen: torch.Generator
    base_lr: list[float]


def prepare_data(cfg: dict, rank: int, run: Wrapped) -> RunData:
    """The corpus, ``data.val_batches`` validation batches on the rank's device, and the batch
    generator seeded by the seed and the rank; the lr is read before a resume changes it."""
    d, T = cfg["data"], cfg["model"]["block_size"]
    train_tokens, val_tokens = load_corpus(max_bytes=d["max_bytes"])
    g_val = torch.Generator().manual_seed(10_000 + cfg["seed"])
    val = []
    for _ in range(d["val_batches"]):
        x, y = get_batch(val_tokens, d["batch_size"], T, g_val)
        val.append((x.to(run.device), y.to(run.device)))
    gen = torch.Generator().manual_seed(1000 * cfg["seed"] + rank)
    base_lr = [g["lr"] for g in run.opt.param_groups]
    return RunData(train_tokens=train_tokens, val_batches=val, gen=gen, base_lr=base_lr)


def clip(cfg: dict, run: Wrapped) -> None:
    """The gradient clipping each wrapper needs: Accelerate's, FSDP1's own (its flat shards),
    or torch's (DDP, and FSDP2's DTensors); DeepSpeed clips inside its step."""
    limit = cfg["optimizer"]["grad_clip"]
    if limit <= 0:
        return
    if run.accelerator is not None:
        run.accelerator.clip_grad_norm_(run.model.parameters(), limit)
    elif cfg["sharding"]["mode"] == "fsdp1":
        run.model.clip_grad_norm_(limit)
    else:
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), limit)


def _update(cfg: dict, run: Wrapped, loss: torch.Tensor) -> None:
    """Backward and step: DeepSpeed's engine does both (and clips); otherwise the optimizer
    after the backward (Accelerate's, where it runs) and the clipping."""
    if run.engine is not None:
        run.engine.backward(loss)
        run.engine.step()
        return
    run.opt.zero_grad(set_to_none=True)
    if run.accelerator is not None:
        run.accelerator.backward(loss)
    else:
        loss.backward()
    clip(cfg, run)
    run.opt.step()


def _bar(step: int, steps: int, loss: float, t0: float) -> None:
    width = 30
    done = int(width * step / steps)
    rate = (time.perf_counter() - t0) / step
    sys.stdout.write(
        f"\r[{'#' * done}{'.' * (width - done)}] {step}/{steps}  loss {loss:.3f}  "
        f"{rate:.2f} s/step  eta {rate * (steps - step):4.0f} s"
    )
    if step == steps:
        sys.stdout.write("\n")
    sys.stdout.flush()


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """The mean loss over ``batches``, in eval mode."""
    model.eval()
    total = 0.0
    for x, y in batches:
        _, loss = model(x, y)
        total += loss.item()
    model.train()
    return total / len(batches)


def mean_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=comm_device())
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def run_steps(
    cfg: dict,
    run: Wrapped,
    killer: Chaos,
    data: RunData,
    first: int,
    trace: loop.Trace | None,
    progress: bool,
) -> loop.Trace:
    """Steps ``first + 1 .. steps`` through the shared loop, with this script's checkpoints and
    progress bar after each. A function of its own so that the model and optimizer it closes over
    are released when it returns (``run.train``'s teardown)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    bs, T = cfg["data"]["batch_size"], cfg["model"]["block_size"]
    ck = cfg["checkpoint"]
    save_at = (ck["save_at"] or cfg["steps"]) if ck["dir"] else None
    every = ck["every"] if ck["dir"] else 0
    t_start = time.perf_counter()

    def step(s: int) -> float:
        killer.step = s
        for g, lr in zip(run.opt.param_groups, data.base_lr, strict=True):
            g["lr"] = lr * lr_factor(cfg, s - 1)
        x, y = get_batch(data.train_tokens, bs, T, data.gen)
        x, y = x.to(run.device), y.to(run.device)
        killer.in_forward = True
        _, loss = run.model(x, y)
        killer.in_forward = False
        _update(cfg, run, loss)
        return loss.item()

    def after(s: int, trace: loop.Trace) -> None:
        if s == save_at or (every and s % every == 0):
            trainer = TrainerState(step=s, data_rng=data.gen.get_state(), window=trace.window,
                                   curve=trace.curve, config=cfg, world_size=world)  # fmt: skip
            save_checkpoint(cfg, Path(ck["dir"]), s, run, trainer, killer)
        if rank == 0 and progress:
            last = trace.window[-1] if trace.window else trace.curve[-1]["train_loss"]
            _bar(s - first, cfg["steps"] - first, last, t_start)

    return loop.train(
        step,
        cfg["steps"],
        lambda: dict(val_loss=mean_over_ranks(evaluate(run.model, data.val_batches))),
        lambda s: s % cfg["eval_every"] == 0 or s == cfg["steps"],
        trace=trace,
        first=first,
        after=after,
        mean=lambda w: mean_over_ranks(sum(w) / len(w)),
    )
