"""Resume a ZeRO checkpoint of Gefen saved at another data-parallel degree or ZeRO stage.

DeepSpeed 0.19 cannot: ``_load_zero_checkpoint`` raises ZeRORuntimeException for optimizer
states at another degree; with ``load_optimizer_states=False`` ZeRO-1/2 would take the master
weights from the model file's low-precision copy and ZeRO-3 finds no
``zero_pp_rank_{r}_model_states.pt`` for a new rank r; the two layouts name their model files
differently, so a stage change finds none. So ``engine.load_checkpoint`` is wrapped
(``patches``): when the saved degree or ZeRO-3-ness differs from the engine's, every rank reads
all the saved ranks' files (``saved.SavedZero``), checks them and this model against them
before anything is changed, then writes its own fp32 master partition from the saved ones
(exact), republishes the low-precision copies, and cuts its Gefen state from every saved piece
with ``method.portable`` (exact where a block piece was saved as it is; its docstring says what
is merged or split). Buffers, the learning-rate scheduler, the step counters and the client
state come from the model file as DeepSpeed's own load takes them. Not covered (refused by
name): frozen parameters, BF16_Optimizer, checkpoints saved before the segments were recorded.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from deepspeed.checkpoint.constants import CLIP_GRAD
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.pipe.module import PipelineModule

from ...method import portable
from ...method.segments import Segment
from ...method.state import allocate
from ...optimizer import Gefen
from .binding import BINDINGS, Binding
from .layouts import Flat
from .meta import META_KEY
from .saved import SavedZero, model_file, read, tag_of

__all__ = ["Recut", "install_tensors", "recut_for"]

_ENGINE_KEYS = ["module", "skipped_steps", "global_steps", "dp_world_size", "mp_world_size"]
_ENGINE_KEYS += ["data_sampler", "random_ltd", "lr_scheduler", "optimizer"]
"""Model-file entries DeepSpeed's own load keeps to itself (the rest is the client state)."""


class Recut:
    """A checkpoint saved at another degree or ZeRO stage, read and checked whole, then put into
    this engine's partitions (the module's docstring says how)."""

    def __init__(self, engine: DeepSpeedEngine, b: Binding, saved: SavedZero) -> None:
        self.engine, self.b, self.saved = engine, b, saved
        self.model_path, self.model_sd = saved.model_path, saved.model_sd
        self.weights, self.shapes, self.tensors = saved.weights, saved.shapes, saved.tensors
        self.ranks = saved.ranks
        self._check_model()
        groups = saved.param_groups
        if len(groups) != len(b.gefen.param_groups):
            raise ValueError(
                f"the checkpoint's Gefen has {len(groups)} param groups, this one "
                f"{len(b.gefen.param_groups)}"
            )

    def _check_model(self) -> None:
        module = self.engine.module
        params = list(module.named_parameters())
        frozen = [n for n, p in params if not p.requires_grad]
        if frozen:
            raise ValueError(
                f"resuming at another data-parallel degree or ZeRO stage covers trainable "
                f"parameters only; this model has frozen ones ({frozen[:3]}...)"
            )
        here = {n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in params}
        missing = sorted(set(here) - set(self.shapes))
        extra = sorted(set(self.shapes) - set(here))
        shaped = [n for n in sorted(set(here) & set(self.shapes)) if here[n] != self.shapes[n]]
        if missing or extra or shaped:
            parts = []
            if shaped:
                n = shaped[0]
                parts.append(f"{n} is {self.shapes[n]} there and {here[n]} here")
            if missing:
                parts.append(f"it lacks {missing[:3]}")
            if extra:
                parts.append(f"this model lacks {extra[:3]}")
            raise ValueError(
                f"{os.path.dirname(self.model_path)} is a checkpoint of another model: "
                + "; ".join(parts)
            )

    # -- applying: nothing above changed the engine ---------------------------------------
    def apply(self, load_lr_scheduler_states: bool) -> tuple[str, dict[str, Any]]:
        eng = self.engine
        self._write_masters()
        if self.tensors is not None:
            self._install_gefen()
        self._load_buffers()
        zsd = self.ranks[0].wrapper_sd
        for key in ("loss_scaler", "dynamic_loss_scale", "overflow", CLIP_GRAD):
            if key in zsd and hasattr(self.b.wrapper, key):
                setattr(self.b.wrapper, key, zsd[key])
        sd = self.model_sd
        if load_lr_scheduler_states and eng.lr_scheduler is not None and sd.get("lr_scheduler"):
            eng.lr_scheduler.load_state_dict(sd["lr_scheduler"])
        eng.global_steps = sd["global_steps"]
        eng.global_samples = sd.get("global_samples", eng.global_steps * eng.train_batch_size())
        eng.skipped_steps = sd["skipped_steps"]
        eng.loaded_checkpoint_dp_world_size = sd["dp_world_size"]
        eng.loaded_checkpoint_mp_world_size = sd["mp_world_size"]
        return self.model_path, {k: v for k, v in sd.items() if k not in _ENGINE_KEYS}

    def _write_masters(self) -> None:
        b = self.b
        for f in b.flats:
            for s, label in zip(f.segments, f.labels, strict=True):
                if label:
                    piece = self.weights[label][s.start : s.start + s.numel]
                    f.tensor.data[s.offset : s.offset + s.numel].copy_(piece)
        if b.kind == "ZeRO-3":
            for j in range(len(b.flats)):
                b.republish(j)
        else:
            b.wrapper.update_lp_params()

    def _install_gefen(self) -> None:
        install_tensors(self.b, self.tensors, self.ranks[0].gefen_sd["param_groups"])

    def _load_buffers(self) -> None:
        module = self.engine.module
        names = {n for n, _ in module.named_buffers()}
        saved = self.model_sd.get("module") or {}
        buffers = {k: v for k, v in saved.items() if k in names}
        if buffers:
            module.load_state_dict(buffers, strict=False)


def install_tensors(
    b: Binding, tensors: dict[str, portable.TensorState], saved_groups: list[dict[str, Any]]
) -> None:
    """Cut every partition's Gefen state from whole-tensor states and load it, with the saved
    param groups' hyperparameters."""
    opt = b.gefen

    def cut(f: Flat) -> dict[str, torch.Tensor]:
        segs = [
            Segment(s.offset, s.numel, s.start, s.shape, label)
            for s, label in zip(f.segments, f.labels, strict=True)
        ]
        if any(s.name and s.numel for s in segs):
            return portable.install(tensors, segs, f.tensor.device)
        first = next(iter(tensors.values()))  # a partition of padding only
        st = allocate(segs, [1] * len(segs), first.codebook, f.tensor.device)
        st["step"] = torch.tensor(first.step, dtype=torch.float32)
        return st

    def load() -> None:
        order = [b.index[id(p)] for g in opt.param_groups for p in g["params"]]
        state = {k: cut(b.flats[i]) for k, i in enumerate(order)}
        groups, k = [], 0
        for g, saved in zip(opt.param_groups, saved_groups, strict=True):
            n = len(g["params"])
            groups.append({**saved, "params": list(range(k, k + n))})
            k += n
        opt.load_state_dict({"state": state, "param_groups": groups, META_KEY: b.meta()})

    if b.kind == "ZeRO-3":
        b.wrapper._set_fp32_optimizer_param_groups()
        try:
            load()
        finally:
            b.wrapper._clear_fp32_optimizer_param_groups()
    else:
        load()


def recut_for(engine: DeepSpeedEngine, load_dir: str, tag: Any) -> Recut | None:
    """The re-cut a load of ``load_dir`` needs, or None where DeepSpeed's own load fits (the
    same degree and ZeRO-3-ness, no Gefen under ZeRO here, a pipeline, no such tag)."""
    wrapper = engine.optimizer
    gefen = getattr(wrapper, "optimizer", None)
    b = BINDINGS.get(gefen) if isinstance(gefen, Gefen) else None
    if b is None or isinstance(engine.module, PipelineModule):
        return None
    if tag is None:
        tag = tag_of(load_dir)
        if tag is None:
            return None  # DeepSpeed's own load warns and returns (None, None)
    tag_dir = os.path.join(load_dir, str(tag))
    mp = engine.checkpoint_mp_rank
    found = model_file(tag_dir, mp)
    if not os.path.isfile(found.path):
        return None  # DeepSpeed's own load names what it looked for
    model_sd = read(found.path, "the model states")
    saved_world = int(model_sd["dp_world_size"])
    if saved_world == b.world_size and found.zero3 == (b.kind == "ZeRO-3"):
        return None
    if b.kind == "BF16_Optimizer":
        raise ValueError(
            f"Gefen under DeepSpeed: {tag_dir} was saved at another data-parallel degree "
            f"({saved_world}) or ZeRO stage; re-cutting it is not supported under "
            "BF16_Optimizer (bf16 with fp32 gradient accumulation under ZeRO-1): resume at "
            "its own layout"
        )
    return Recut(engine, b, SavedZero(found.path, model_sd, mp))
