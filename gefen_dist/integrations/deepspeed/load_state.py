"""Load a single-process Gefen state into a ZeRO engine: ``load_optimizer_state(engine, sd)``.

The other way from ``consolidate``: one process's ``opt.state_dict()``, or the name-keyed state
that ``python -m gefen_dist.checkpoint consolidate`` or DCP writes, cut into this engine's
partitions as a resume at another degree cuts a ZeRO checkpoint's (``recut.install_tensors``).
"""

from __future__ import annotations

from typing import Any

import torch
from deepspeed.runtime.engine import DeepSpeedEngine

from ...method import portable
from ...method.segments import whole_tensor
from ...method.state import bits_of, check_loaded
from .binding import Binding, stepped
from .layouts import param_names
from .meta import META_KEY
from .recut import install_tensors

__all__ = ["load_optimizer_state"]


def _group_names(b: Binding) -> list[list[str]]:
    """The trainable parameters' names of each of the client optimizer's param groups, in the
    order the client listed them: what a single-process state dict's indices count."""
    w = b.wrapper
    by_id = param_names(w)
    if b.kind == "ZeRO-3":
        groups = [g["params"] for g in w.trainable_param_groups]
    elif b.kind == "BF16_Optimizer":
        groups = w.bf16_groups
    else:
        groups = w.bit16_groups
    return [[by_id.get(id(p), "") for p in ps] for ps in groups]


def load_optimizer_state(engine: DeepSpeedEngine, state_dict: dict[str, Any]) -> None:
    """Load a single-process Gefen state into this ZeRO engine: each rank cuts its partitions'
    state from the whole tensors' (exact where a block lies whole in a partition, otherwise
    split as ``method.portable`` says).

    ``state_dict`` is what one process's ``opt.state_dict()`` gives (keyed by index, counted
    over the param groups as the client optimizer lists them; the engine's model must be built
    with the same groups) or a state keyed by parameter name (``python -m
    gefen_dist.checkpoint consolidate``'s ``["optim"]``, DCP's ``get_optimizer_state_dict``).
    Only the optimizer state: load the weights into the model before ``deepspeed.initialize``,
    where ZeRO copies them into its fp32 master partitions. Every entry is checked against this
    model's tensors before anything is changed; a mismatch raises ValueError naming it."""
    gefen, b = stepped(engine)
    if b is None:
        gefen.load_state_dict(state_dict)  # no ZeRO: Gefen holds whole parameters
        return
    if b.kind == "BF16_Optimizer":
        raise ValueError(
            "load_optimizer_state: not supported under BF16_Optimizer (bf16 with fp32 gradient "
            "accumulation under ZeRO-1); use ZeRO stage 1, 2 or 3"
        )
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
        raise ValueError(
            "load_optimizer_state: state_dict must be an optimizer state dict with 'state' and "
            f"'param_groups', got {type(state_dict).__name__}"
            + (
                f" with keys {sorted(map(str, state_dict))[:5]}"
                if isinstance(state_dict, dict)
                else ""
            )
        )
    if META_KEY in state_dict:
        raise ValueError(
            "load_optimizer_state: this state was saved by one rank of a DeepSpeed run (it has "
            f"a {META_KEY!r} entry), so it holds that rank's partitions, not whole tensors; "
            "resume with engine.load_checkpoint(dir), or consolidate the checkpoint first"
        )
    groups = list(state_dict["param_groups"])
    here = _group_names(b)
    if len(groups) != len(here):
        raise ValueError(
            f"load_optimizer_state: the state has {len(groups)} param groups, this engine's "
            f"Gefen {len(here)}"
        )
    module = engine.module
    frozen = [n for n, p in module.named_parameters() if not p.requires_grad]
    if frozen:
        raise ValueError(
            "load_optimizer_state covers trainable parameters only; this model has frozen ones "
            f"({frozen[:3]}...)"
        )
    shapes = {n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in module.named_parameters()}
    entries: dict[str, dict[str, torch.Tensor]] = {}
    for gi, (saved, names) in enumerate(zip(groups, here, strict=True)):
        ids = list(saved["params"])
        if len(ids) != len(names):
            raise ValueError(
                f"load_optimizer_state: param group {gi} of the state holds {len(ids)} "
                f"parameters, this engine's {len(names)}: another model, or another param-group "
                "order"
            )
        for key, name in zip(ids, names, strict=True):
            if isinstance(key, str) and key != name:
                raise ValueError(
                    f"load_optimizer_state: param group {gi} holds {key!r} where this engine "
                    f"has {name!r}: another model, or another param-group order"
                )
            st = state_dict["state"].get(key)
            if st:
                entries[name] = st
    if not entries:
        return  # saved before the first step: Gefen starts afresh, as it would have
    missing = sorted(n for names in here for n in names if n not in entries)
    if missing:
        raise ValueError(
            f"load_optimizer_state: the state holds no Gefen state of {missing[:3]} (saved "
            "with some parameters not yet stepped?)"
        )
    parts = []
    for name, st in entries.items():
        shape = shapes[name]
        segs = portable.saved_whole(st, shape, name) or whole_tensor(shape, name)
        try:
            check_loaded(st, segs, bits_of(st["codebook"]), name)
            parts += portable.export(st, segs)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(
                f"load_optimizer_state: {name} ({shape}) does not fit its state: {e}"
            ) from None
    saved_groups = [{k: v for k, v in g.items() if k != "param_names"} for g in groups]
    if engine._optimizer_has_ckpt_event_prologue():
        engine.optimizer.checkpoint_event_prologue()
    install_tensors(b, portable.merge(parts), saved_groups)
    if engine._optimizer_has_ckpt_event_epilogue():
        engine.optimizer.checkpoint_event_epilogue()
