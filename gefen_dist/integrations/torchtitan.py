"""Gefen in a torchtitan job, through torchtitan's own extension points (no fork, no patch).

torchtitan (0.3) builds its optimizers from ``Trainer.Config.optimizer``, an
``OptimizersContainer.Config``, whose ``build(model_parts=...)`` constructs the class that
declares the config, and resolves each ``ParamGroupConfig.optimizer_name`` through
``OptimizersContainer._resolve_optimizer_factory`` (Adam, AdamW, DistMuon). A subclass with a
config of its own is therefore what a job names, and the trainer builds it unchanged::

    from gefen_dist.integrations.torchtitan import GefenCheckpointManager, gefen_optimizers

    config = Trainer.Config(
        ...,
        optimizer=gefen_optimizers(lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95)),
        checkpoint=GefenCheckpointManager.Config(enable=True, interval=500),
    )

``GefenOptimizersContainer`` knows the name ``"Gefen"`` besides torchtitan's own, so param
groups may mix them (``ParamGroupConfig(pattern=r"norm", optimizer_name="AdamW", ...)``), and it
carries Gefen's state through torchtitan's flat, FQN-keyed optimizer state dict. Why it has to:
torchtitan's ``load_flat_optim_state_dict`` asks the live optimizer which state names to look up
(``state.{fqn}.{name}`` for each name in ``optim.state[p]``). Under FSDP2 Gefen's state dict
holds, per parameter, this rank's state as one ``gefen.rank{r}`` entry (``integrations.fsdp``),
not the live names (codes, v, ...), so the stock loader would find the step and codebook only,
not the state itself. For Gefen's optimizers this container reads back every key saved under a
parameter's prefix; for the others it is torchtitan's.

Checkpoints. torchtitan's ``CheckpointManager`` saves ``{"optimizer": container, ...}`` with
``dcp.save``; each rank writes its ``gefen.rank{r}`` entries, and a resume at the same world size
and sharding loads each rank's own: bit for bit. A resume at another world size needs every
saved rank's entries of a parameter to cut the new rank's piece (``method.portable``), while a
DCP load reads only the keys of the loading rank's template. ``GefenCheckpointManager`` reads
the checkpoint's metadata before loading and asks the container to put every saved rank's entry
key in its template, so DCP reads them all and Gefen recuts: 2 -> 1, 1 -> 2, 2 -> 4 ranks, with
the stock manager's config fields. Its cost: during the load each rank holds every saved rank's
entries of every parameter, the whole checkpoint's optimizer state, until Gefen has cut its own
piece. The plain ``CheckpointManager`` works at the same world size and refuses another one,
naming the missing ranks.

Importing this module does not import torchtitan; its classes are made on first use
(``__getattr__``), so ``gefen_dist`` imports and documents without torchtitan installed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..optimizer import Gefen

if TYPE_CHECKING:  # pragma: no cover
    from torchtitan.components.optimizer import OptimizersContainer

# the two classes are made on first use, by the module's __getattr__
__all__ = [  # noqa: F822
    "GefenCheckpointManager",
    "GefenOptimizersContainer",
    "gefen_optimizers",
    "saved_entries",
    "NAME",
]

NAME = "Gefen"
"""The ``optimizer_name`` of a ``ParamGroupConfig`` that ``GefenOptimizersContainer`` builds
with Gefen."""

_ENTRY = re.compile(r"^state\.(?P<fqn>.+)\.gefen\.rank(?P<rank>\d+)$")
_classes: dict[str, type] = {}


def __getattr__(name: str) -> Any:
    if name in ("GefenOptimizersContainer", "GefenCheckpointManager"):
        if not _classes:
            _make_classes()
        return _classes[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def gefen_optimizers(
    lr: float = 8e-4, *, pattern: str = r".*", **optimizer_kwargs: Any
) -> OptimizersContainer.Config:
    """A ``GefenOptimizersContainer.Config`` with one param group: every parameter matching
    ``pattern`` (all by default) trained by Gefen with ``lr`` and ``optimizer_kwargs`` (Gefen's
    arguments: ``betas``, ``eps``, ``weight_decay``, ``bits``, ``bf16_stochastic_round``).
    torchtitan's ``default_adamw`` for Gefen; for mixed groups build the Config yourself."""
    container = __getattr__("GefenOptimizersContainer")
    from torchtitan.components.optimizer import ParamGroupConfig

    return container.Config(
        param_groups=[
            ParamGroupConfig(
                pattern=pattern,
                optimizer_name=NAME,
                optimizer_kwargs={"lr": lr, **optimizer_kwargs},
            )
        ]
    )


def _make_classes() -> None:
    from torchtitan.components.checkpointer import OPTIMIZER, CheckpointManager
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.components.optimizer.utils import (
        get_flat_optim_state_dict,
        init_optim_state,
        load_flat_optim_state_dict,
    )
    from torchtitan.config import Configurable

    class GefenOptimizersContainer(OptimizersContainer):
        """torchtitan's ``OptimizersContainer`` that also builds ``"Gefen"`` param groups and
        carries Gefen's per-rank checkpoint entries through torchtitan's flat state dict
        (module docstring). Other optimizer names go to torchtitan's factories as before."""

        @dataclass(kw_only=True, slots=True)
        class Config(OptimizersContainer.Config):
            """``OptimizersContainer.Config``; its ``build`` makes a ``GefenOptimizersContainer``.
            ``implementation`` ("fused" by default) reaches Gefen as ``fused``/``foreach``,
            which Gefen accepts and ignores."""

        def __init__(self, config: Any, *, model_parts: list) -> None:
            self._saved_entries: set[str] = set()
            super().__init__(config, model_parts=model_parts)

        @staticmethod
        def _resolve_optimizer_factory(name: str) -> Any:
            if name == NAME:
                return Gefen
            return OptimizersContainer._resolve_optimizer_factory(name)

        def expect_saved_entries(self, keys: set[str]) -> None:
            """Make the next ``state_dict()``, the template a DCP load fills, ask for these
            flat keys (``state.{fqn}.gefen.rank{r}``: every saved rank's entries) in place of
            this rank's own, for the parameters of this container's Gefen optimizers
            (``_as_saved``); ``load_state_dict`` clears them. What ``GefenCheckpointManager``
            calls before a load."""
            self._saved_entries = set(keys)

        def state_dict(self) -> dict[str, Any]:
            out: dict[str, Any] = {}
            for optim in self.optimizers:
                init_optim_state(optim)
                flat = get_flat_optim_state_dict(optim)
                if isinstance(optim, Gefen) and self._saved_entries:
                    flat = _as_saved(optim, flat, self._saved_entries)
                out.update(flat)
            return out

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            for optim in self.optimizers:
                init_optim_state(optim)
                if isinstance(optim, Gefen):
                    optim.load_state_dict(_unflatten(optim, state_dict))
                else:
                    load_flat_optim_state_dict(optim, state_dict)
            self._saved_entries = set()

    class GefenCheckpointManager(CheckpointManager):
        """torchtitan's DCP ``CheckpointManager`` that resumes Gefen's state at another world
        size: before each DCP load it reads the checkpoint's metadata and has the optimizer
        container ask for every saved rank's entry (module docstring: what that costs)."""

        @dataclass(kw_only=True, slots=True)
        class Config(CheckpointManager.Config):
            """``CheckpointManager.Config``; its ``build`` makes a ``GefenCheckpointManager``."""

        def dcp_load(
            self,
            state_dict: dict[str, Any],
            checkpoint_id: str,
            from_hf: bool,
            from_quantized: bool,
        ) -> None:
            opt = state_dict.get(OPTIMIZER)
            if not from_hf and isinstance(opt, GefenOptimizersContainer):
                opt.expect_saved_entries(saved_entries(checkpoint_id, OPTIMIZER))
            super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)

    for cls in (GefenOptimizersContainer, GefenCheckpointManager):
        cls.__module__ = __name__
        assert issubclass(cls, Configurable) and cls.Config._owner is cls
    _classes.update(
        GefenOptimizersContainer=GefenOptimizersContainer,
        GefenCheckpointManager=GefenCheckpointManager,
    )


def saved_entries(checkpoint_id: str, prefix: str = "optimizer") -> set[str]:
    """The flat keys (``state.{fqn}.gefen.rank{r}``) of every Gefen per-rank entry that the DCP
    checkpoint at ``checkpoint_id`` holds under ``prefix``, read from its metadata alone."""
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata
    head = f"{prefix}."
    return {k[len(head) :] for k in keys if k.startswith(head) and _ENTRY.match(k[len(head) :])}


def _as_saved(optim: Gefen, flat: dict[str, Any], saved: set[str]) -> dict[str, Any]:
    """``flat`` as the template of a load from a checkpoint holding the entry keys ``saved``:
    for each of ``optim``'s parameters that the checkpoint holds entries of, this rank's own
    entry keys give way to the saved ones (empty placeholders, which DCP replaces with the
    saved bytes). A rank of a larger world than the saving one has a key the checkpoint lacks
    (``gefen.rank3`` of 4 where 2 saved), which DCP would refuse as missing."""
    from .fsdp import Entry

    mine = {fqn for g in optim.param_groups for fqn in g.get("param_names", ())}
    by_fqn: dict[str, list[str]] = {}
    for key in saved:
        m = _ENTRY.match(key)
        if m and m["fqn"] in mine:
            by_fqn.setdefault(m["fqn"], []).append(key)
    out = {}
    for key, value in flat.items():
        m = _ENTRY.match(key)
        if m is None or m["fqn"] not in by_fqn:
            out[key] = value
    for keys in by_fqn.values():
        out.update({k: Entry(b"") for k in keys})
    return out


def _unflatten(optim: Gefen, flat: dict[str, Any]) -> dict[str, Any]:
    """``optim``'s integer-keyed state dict from torchtitan's flat one: every key saved under a
    parameter's ``state.{fqn}.`` prefix, whatever the live state's names (the per-rank entries
    of ``integrations.fsdp``, or a single process's state tensors), and the param-group settings
    as torchtitan's ``_unflatten_optim_state_dict`` reads them. No parameter FQN is another's
    followed by a dot (a module cannot hold a parameter and a submodule of one name), so the
    prefixes do not overlap."""
    by_fqn: dict[str, dict[str, Any]] = {}
    fqns = [fqn for g in optim.param_groups for fqn in _names(g)]
    wanted = {f"state.{fqn}.": fqn for fqn in fqns}
    for key, value in flat.items():
        if not key.startswith("state."):
            continue
        for head, fqn in wanted.items():
            if key.startswith(head):
                by_fqn.setdefault(fqn, {})[key[len(head) :]] = value
                break
    state: dict[int, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    i = 0
    for g in optim.param_groups:
        names = _names(g)
        ids = list(range(i, i + len(names)))
        for pid, fqn in zip(ids, names, strict=True):
            saved = {k: v for k, v in by_fqn.get(fqn, {}).items() if not _empty_entry(v)}
            if saved:
                state[pid] = saved
        settings = {}
        for key in g:
            if key in ("params", "param_names"):
                continue
            flat_key = f"param_groups.{names[0]}.{key}"
            if flat_key not in flat:
                raise KeyError(
                    f"Gefen param group setting {key!r} is not in the checkpoint (looked up as "
                    f"{flat_key!r}): saved by another optimizer or param-group split?"
                )
            settings[key] = flat[flat_key]
        groups.append({**settings, "params": ids, "param_names": names})
        i += len(names)
    return {"state": state, "param_groups": groups}


def _names(group: dict[str, Any]) -> list[str]:
    names = group.get("param_names")
    if not names or len(names) != len(group["params"]):
        raise ValueError(
            "a Gefen param group without param_names: GefenOptimizersContainer builds its "
            "groups with them (torchtitan's _build_param_groups), which its flat, FQN-keyed "
            "state dict needs"
        )
    return list(names)


def _empty_entry(value: Any) -> bool:
    """A placeholder the checkpoint did not fill (``_as_saved``) is left out, so that the
    FSDP integration names the missing ranks rather than reading empty bytes."""
    return isinstance(value, bytes) and len(value) == 0
