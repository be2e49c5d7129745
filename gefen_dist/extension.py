"""How framework integrations reach Gefen: one interface, registered once.

Why: the optimizer must not import the integrations (they import it, and a framework may not
be installed), yet some layouts are only known to the framework that made them. FSDP2's DTensor
parameters carry their process group, which Gefen takes itself; but FSDP2's checkpoints need
per-rank keys, FSDP1's flat parameters need the layout only FSDP's units know, and DeepSpeed's
engine must bind a Gefen built while DeepSpeed is loaded. Each integration implements
``Integration`` and calls ``register`` at import (``integrations/register.py``); Gefen calls
the three moments below, and nothing else. An integration keeps what it learns about one
optimizer with ``Gefen.attach`` (read with ``Gefen.attached``), not in private attributes.
"""

from __future__ import annotations

from typing import Protocol

from torch.optim import Optimizer

__all__ = ["Integration", "constructed", "register", "registered", "sharded", "unconfigured"]


class Integration(Protocol):
    name: str

    def constructed(self, opt: Optimizer) -> None:
        """Every Gefen, at the end of its construction."""

    def sharded(self, opt: Optimizer) -> None:
        """Once, when a Gefen not yet configured by an integration first finds DTensor
        parameters on a process group."""

    def unconfigured(self, opt: Optimizer) -> None:
        """Before the state exists (at construction, and at each step, state dict and load
        until it does) while no integration has configured the optimizer: a wrapper may swap
        its parameters for a framework's after construction (Accelerate, the HF Trainer)."""


_REGISTERED: dict[str, Integration] = {}


def register(integration: Integration) -> None:
    """Add an integration (again under the same name: replaced, so a reload is harmless)."""
    _REGISTERED[integration.name] = integration


def registered() -> list[str]:
    return list(_REGISTERED)


def constructed(opt: Optimizer) -> None:
    for integration in list(_REGISTERED.values()):
        integration.constructed(opt)


def sharded(opt: Optimizer) -> None:
    for integration in list(_REGISTERED.values()):
        integration.sharded(opt)


def unconfigured(opt: Optimizer) -> None:
    for integration in list(_REGISTERED.values()):
        integration.unconfigured(opt)
