"""Gefen in a torchtitan job, through torchtitan's own extension points (no fork, no patch).

torchtitan (0.3) builds its optimizers from ``Trainer.Config.optimizer``, an
``OptimizersContainer.Config``, whose ``build(model_parts=...)`` constructs the class that
declares the config, and resolves each ``ParamGroupConfig.optimizer_name`` through
``OptimizersContainer._resolve_optimizer_factory`` (Adam, AdamW, DistMuon). A subclass with a
config of its own is therefore what a job names, and the trainer builds it unchanged::

    from gefen_dist.integrations.torchtitan import gefen_optimizers

    config = Trainer.Config(
        ...,
        optimizer=gefen_optimizers(lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95)),
        checkpoint=CheckpointManager.Config(enable=True, interval=500),
    )

``GefenOptimizersContainer`` knows the name ``"Gefen"`` besides torchtitan's own, so param
groups may mix them (``ParamGroupConfig(pattern=r"norm", optimizer_name="AdamW", ...)``), and it
carries Gefen's state through torchtitan's flat, FQN-keyed optimizer state dict. Why it has to:
torchtitan's ``load_flat_optim_state_dict`` asks the live optimizer which state names to look up
(``state.{fqn}.{name}`` for each name in ``optim.state[p]``). Under FSDP2 Gefen's state dict
holds, per parameter, names the live state does not have (``v.{start}.{numel}`` per saved range,
``integrations.dcp``; ``gefen.rank{r}`` entries for other layouts, ``integrations.fsdp``), so the
stock loader would find the step and codebook only, not the state itself. For Gefen's
optimizers this container reads back every key saved under a parameter's prefix; for the others
it is torchtitan's.

Checkpoints. torchtitan's ``CheckpointManager`` saves ``{"optimizer": container, ...}`` with
``dcp.save``. Gefen's state of FSDP2 and HSDP parameters is in their global coordinates
(``integrations.dcp``), and DCP's ``DefaultLoadPlanner``, which torchtitan's ``dcp.load`` uses,
fits Gefen's part of the template to the checkpoint before it reads (``dcp.fit_template``), in
torchtitan's flat dict as in a nested one: a resume at the same world size is bit for bit, and
one at another world size reads only each rank's new piece and the saved block values around
it. The stock ``CheckpointManager`` is all a job needs; ``GefenCheckpointManager`` is kept for
configs that name it, and is torchtitan's. Checkpoints in the older per-rank format
(``gefen.rank{r}`` entries) load too: the template then asks for every saved rank's entry.

Importing this module does not import torchtitan; its classes are made on first use
(``__getattr__``), so ``gefen_dist`` imports and documents without torchtitan installed.
"""

from __future__ import annotations

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
    "NAME",
]

NAME = "Gefen"
"""The ``optimizer_name`` of a ``ParamGroupConfig`` that ``GefenOptimizersContainer`` builds
with Gefen."""

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
    from torchtitan.components.checkpointer import CheckpointManager
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

        @staticmethod
        def _resolve_optimizer_factory(name: str) -> Any:
            if name == NAME:
                return Gefen
            return OptimizersContainer._resolve_optimizer_factory(name)

        def state_dict(self) -> dict[str, Any]:
            out: dict[str, Any] = {}
            for optim in self.optimizers:
                init_optim_state(optim)
                out.update(get_flat_optim_state_dict(optim))
            return out

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            for optim in self.optimizers:
                init_optim_state(optim)
                if isinstance(optim, Gefen):
                    optim.load_state_dict(_unflatten(optim, state_dict))
                else:
                    load_flat_optim_state_dict(optim, state_dict)

    class GefenCheckpointManager(CheckpointManager):
        """torchtitan's ``CheckpointManager``, kept for job configs that name it: DCP's default
        planner now fits Gefen's template itself (module docstring)."""

        @dataclass(kw_only=True, slots=True)
        class Config(CheckpointManager.Config):
            """``CheckpointManager.Config``; its ``build`` makes a ``GefenCheckpointManager``."""

    for cls in (GefenOptimizersContainer, GefenCheckpointManager):
        cls.__module__ = __name__
        assert issubclass(cls, Configurable) and cls.Config._owner is cls
    _classes.update(
        GefenOptimizersContainer=GefenOptimizersContainer,
        GefenCheckpointManager=GefenCheckpointManager,
    )


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
    """A placeholder the checkpoint did not fill (``dcp.fit_template``) is left out, so that the
    FSDP integration names the missing ranks rather than reading empty bytes."""
    return isinstance(value, bytes) and len(value) == 0
