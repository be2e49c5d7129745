"""The test hook ``GEFEN_CHAOS_KILL="R:S:P"``: rank R sends itself SIGKILL at point P of step S,
so that ``launch/chaos.py`` can kill a rank inside a phase rather than at a random instant that
mostly falls in startup.

P is ``forward`` (the training forward, after the first block ran), ``step`` (the optimizer's
step pre-hook: under DeepSpeed inside ``engine.step()``, after ZeRO reduced the gradients),
``save`` (half of the rank's trainer file written, after the framework wrote its part) or
``commit`` (rank 0: the marker written, the rename not done; any other rank: past the barrier,
racing rank 0's rename). A save or commit point fires only where step S saves.

Its own module so that the points the loop and the checkpoint call (``Chaos.at``,
``Chaos.due``) are all that the rest of the script knows of it, and so that the spec parses
before any process group starts.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import NamedTuple

import torch

from gefen_dist.demo.model import Block

from .config import ConfigError
from .optimizer import stepped

CHAOS_ENV = "GEFEN_CHAOS_KILL"
CHAOS_PHASES = ("forward", "step", "save", "commit")


class ChaosKill(NamedTuple):
    """Where ``GEFEN_CHAOS_KILL`` kills: ``rank`` at ``phase`` of ``step``."""

    rank: int
    step: int
    phase: str


def parse_chaos(spec: str) -> ChaosKill | None:
    """``R:S:P`` from ``GEFEN_CHAOS_KILL`` (module docstring), checked before any process group
    starts, so that a typo fails the test at once rather than letting the run live."""
    if not spec:
        return None
    parts = spec.split(":")
    if len(parts) == 3 and parts[0].isdigit() and parts[1].isdigit() and parts[2] in CHAOS_PHASES:
        rank, step, phase = parts
        return ChaosKill(int(rank), int(step), phase)
    raise ConfigError(
        f"{CHAOS_ENV}={spec!r}: expected RANK:STEP:PHASE, PHASE one of {', '.join(CHAOS_PHASES)}"
    )


class Chaos:
    """The kill point of ``GEFEN_CHAOS_KILL`` on this rank; inert where none is set. The loop
    sets ``step`` and ``in_forward`` as it goes."""

    def __init__(self, target: ChaosKill | None, rank: int):
        self.target = target if target and target.rank == rank else None
        self.rank = rank
        self.step = 0
        self.in_forward = False

    def due(self, phase: str) -> bool:
        t = self.target
        return t is not None and (t.step, t.phase) == (self.step, phase)

    def at(self, phase: str) -> None:
        if self.due(phase):
            self.kill(phase)

    def kill(self, phase: str) -> None:
        sys.stdout.flush()
        print(f"chaos: rank {self.rank} sends itself SIGKILL in the {phase} of step {self.step}",
              file=sys.stderr, flush=True)  # fmt: skip
        os.kill(os.getpid(), signal.SIGKILL)

    def install(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        """The forward and step kill points, as hooks, only on the rank that is to die."""
        if self.target is None:
            return
        first = next(m for m in model.modules() if isinstance(m, Block))

        def forward_hook(*_):
            if self.in_forward:
                self.at("forward")

        first.register_forward_hook(forward_hook)
        stepped(opt).register_step_pre_hook(lambda *_: self.at("step"))
