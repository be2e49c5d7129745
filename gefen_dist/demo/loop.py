"""The training loop that the demo, the benchmark suite and ``launch/train.py`` share.

Why one loop: a comparison of optimizers is only as fair as the loop around them is the same,
and copies drift (one clips, another does not; one times the batch, another does not). What
differs between the callers is what a step is (a plain backward and step, or a DeepSpeed
engine's) and what happens after one (a checkpoint, a progress bar); they pass those in. The
loop owns the order of things, the step timing, the loss window and the curve.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class Trace:
    """A run's record so far: ``curve`` holds one point per evaluation (step, the mean training
    loss since the last one, the evaluation's values); ``window`` the losses since the last
    point; ``step_ms`` each step's wall time. A resumed run continues a saved one's."""

    curve: list[dict] = field(default_factory=list)
    window: list[float] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)
    failed: str | None = None


def plain_step(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    loss_of: Callable[[], torch.Tensor],
    grad_clip: float | None,
) -> float:
    """One step as every single-process PyTorch loop takes it: zero the gradients, backward,
    clip the global norm, step. Returns the loss (``.item()`` syncs, so a GPU step's time is
    honest)."""
    loss = loss_of()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if grad_clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    opt.step()
    return loss.item()


def train(
    step: Callable[[int], float],
    steps: int,
    evaluate: Callable[[], dict],
    eval_at: Callable[[int], bool],
    *,
    trace: Trace | None = None,
    first: int = 0,
    after: Callable[[int, Trace], None] | None = None,
    mean: Callable[[list[float]], float] = lambda w: sum(w) / len(w),
    stop_on_nonfinite: bool = False,
) -> Trace:
    """Run ``step(s)`` for s in ``first + 1 .. steps``; evaluate where ``eval_at(s)``.

    ``step`` takes the step number (from 1) and returns its loss; it sets the lr, draws the
    batch and updates. ``after(s, trace)`` runs after each step and its evaluation (a
    checkpoint then saves the curve with that point in it). ``mean`` makes a point's training
    loss of the window (over the ranks, under data parallelism). With ``stop_on_nonfinite`` a
    NaN or inf loss ends the run with ``trace.failed`` saying where, instead of training on."""
    if trace is None:
        trace = Trace(curve=[dict(step=0, train_loss=None, **evaluate())])
    for s in range(first + 1, steps + 1):
        t0 = time.perf_counter()
        loss = step(s)
        trace.step_ms.append(1000 * (time.perf_counter() - t0))
        trace.window.append(loss)
        if stop_on_nonfinite and not math.isfinite(loss):
            trace.failed = f"loss became {loss} at step {s}"
            return trace
        if eval_at(s):
            trace.curve.append(dict(step=s, train_loss=mean(trace.window), **evaluate()))
            trace.window = []
        if after is not None:
            after(s, trace)
    return trace
