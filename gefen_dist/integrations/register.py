"""``gefen_dist.register()``: make frameworks that build optimizers from configs know Gefen.

Why a call and not an import side effect alone: ``import gefen_dist`` must stay cheap and must work
without DeepSpeed installed, while DeepSpeed's config path (``"optimizer": {"type": "Gefen"}``,
used by ``deepspeed.initialize`` without ``optimizer=``, Accelerate's ``DummyOptim`` and the Hugging
Face Trainer's ``--deepspeed``) only knows Gefen once ``integrations.deepspeed.install()`` has
patched it. ``import gefen_dist`` installs it by itself when DeepSpeed is already imported, and so
does Gefen's constructor; ``register()`` does it whatever the import order. Importing
``integrations.deepspeed`` alone patches nothing. DDP, FSDP and Accelerate's DDP need no
registration: they take the optimizer object. FSDP's layout is read through the integrations this
module registers with ``extension``: FSDP2's when Gefen finds DTensor parameters, FSDP1's when it
finds FSDP1's flat or flattened ones.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

from torch.optim import Optimizer

from .. import extension

__all__ = ["register"]

_INTEGRATIONS = {"deepspeed": "gefen_dist.integrations.deepspeed"}


def register(*frameworks: str) -> list[str]:
    """Install Gefen's integration into each installed framework (all known ones by default:
    ``"deepspeed"``), and return the names installed. Idempotent. Naming a framework that is not
    installed, or one Gefen has no integration for, raises."""
    names = frameworks or tuple(_INTEGRATIONS)
    done = []
    for name in names:
        if name not in _INTEGRATIONS:
            raise ValueError(f"no Gefen integration for {name!r}; known: {sorted(_INTEGRATIONS)}")
        if importlib.util.find_spec(name) is None:
            if frameworks:
                raise ImportError(f"gefen_dist.register({name!r}): {name} is not installed")
            continue
        _install(name)
        done.append(name)
    return done


def register_loaded() -> None:
    """Install the integrations of frameworks already imported (what ``import gefen_dist`` does)."""
    for name in _INTEGRATIONS:
        if name in sys.modules:
            _install(name)


def _install(name: str) -> None:
    importlib.import_module(_INTEGRATIONS[name]).install()


class _DeepSpeed:
    """deepspeed.initialize must map ZeRO partitions to segments; without the integration each
    flat partition would be blocked as one 1-D tensor. So a Gefen built while DeepSpeed is
    loaded installs it."""

    name = "deepspeed"

    def constructed(self, opt: Optimizer) -> None:
        if "deepspeed" in sys.modules:
            _install("deepspeed")

    def sharded(self, opt: Optimizer) -> None:
        pass

    def unconfigured(self, opt: Optimizer) -> None:
        pass


class _FSDP:
    """FSDP2's DTensor state is keyed per rank for DCP once Gefen finds it; FSDP1's flat
    parameters (use_orig_params=False) and pieces of original ones (True) carry FSDP's marks,
    and their layout is read from FSDP's units. The integration is imported only where needed."""

    name = "fsdp"

    def constructed(self, opt: Optimizer) -> None:
        pass

    def sharded(self, opt: Optimizer) -> None:
        importlib.import_module("gefen_dist.integrations.fsdp").configure(None, opt)

    def unconfigured(self, opt: Optimizer) -> None:
        if any(
            getattr(p, "_is_flat_param", False) or getattr(p, "_fsdp_flattened", False)
            for g in opt.param_groups
            for p in g["params"]
        ):
            importlib.import_module("gefen_dist.integrations.fsdp").configure_found(opt)


extension.register(_DeepSpeed())
extension.register(_FSDP())
