"""The run config: ``DEFAULTS`` under a YAML file and ``--set`` overrides, checked whole before
any process group starts, so that a bad key stops the launch once, naming the key, rather than on
every rank after rendezvous.

The config stays the nested mapping the YAML file gives: it is saved as is in every checkpoint's
trainer file and in the results JSON, and a resume compares it key by key with the saved one, so
its keys are its schema (``DEFAULTS``). Everything else that crosses a function boundary in the
script is named data; nothing here is read by position.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import NamedTuple

import torch
import yaml

from gefen_dist.schedule import warmup_cosine

from .checkpoint_dir import DONE, TRAINER_FILE, find_checkpoint
from .optimizer import build_optimizer

DEFAULTS: dict = {
    "model": {"n_layer": 2, "n_head": 4, "n_embd": 128, "block_size": 64},
    "data": {"max_bytes": 2 * 2**20, "batch_size": 8, "val_batches": 8},
    "steps": 40,
    "eval_every": 10,
    "seed": 0,
    "optimizer": {
        "name": "gefen",
        "bits": 4,
        "lr": 1e-3,
        "betas": [0.9, 0.95],
        "weight_decay": 0.1,
        "warmup": 4,
        "min_lr_frac": 0.1,
        "grad_clip": 1.0,
    },
    "sharding": {"mode": "ddp", "zero_stage": 2, "mesh": [0, 0]},
    "device": "auto",
    "checkpoint": {"dir": "", "save_at": 0, "every": 0, "resume": ""},
}
CHOICES = {
    "device": ("auto", "cpu", "cuda"),
    "optimizer.name": ("gefen", "adamw"),
    "optimizer.bits": (4, 8),
    "sharding.mode": ("ddp", "fsdp1", "fsdp2", "hsdp", "deepspeed", "accelerate"),
    "sharding.zero_stage": (1, 2, 3),
}
POSITIVE = {"steps", "eval_every", "data.batch_size", "data.val_batches", "data.max_bytes",
            "model.n_layer", "model.n_head", "model.n_embd", "model.block_size"}  # fmt: skip


class ConfigError(ValueError):
    """A run config that names an unknown key, has a value of the wrong type or out of range."""


class MeshShape(NamedTuple):
    """An hsdp device mesh: ``replicate`` groups of ``shard`` ranks each."""

    replicate: int
    shard: int


def _merge(defaults: dict, given: dict, where: str, prefix: str = "") -> dict:
    if not isinstance(given, dict):
        raise ConfigError(f"{where}: {prefix.rstrip('.') or 'the config'} must be a mapping")
    out = copy.deepcopy(defaults)
    for key, value in given.items():
        name = f"{prefix}{key}"
        if key not in defaults:
            known = ", ".join(f"{prefix}{k}" for k in defaults)
            raise ConfigError(f"{where}: unknown key {name!r} (known here: {known})")
        default = defaults[key]
        if isinstance(default, dict):
            out[key] = _merge(default, value, where, name + ".")
            continue
        ok = (
            isinstance(value, list) and len(value) == len(default)
            if isinstance(default, list)
            else isinstance(value, float | int) and not isinstance(value, bool)
            if isinstance(default, float)
            else isinstance(value, type(default)) and not isinstance(value, bool)
        )
        if not ok:
            raise ConfigError(f"{where}: key {name!r} must be like {default!r}, got {value!r}")
        if name in CHOICES and value not in CHOICES[name]:
            raise ConfigError(
                f"{where}: key {name!r} must be one of {CHOICES[name]}, got {value!r}"
            )
        if name in POSITIVE and value <= 0:
            raise ConfigError(f"{where}: key {name!r} must be positive, got {value!r}")
        out[key] = float(value) if isinstance(default, float) else value
    return out


def load_config(source: str | Path | dict | None) -> dict:
    """The full run config: a YAML path (or a dict already parsed) over ``DEFAULTS``."""
    if source is None:
        return copy.deepcopy(DEFAULTS)
    if isinstance(source, dict):
        cfg = _merge(DEFAULTS, source, "config")
        check(cfg, "config")
        return cfg
    text = Path(source).read_text()
    cfg = _merge(DEFAULTS, yaml.safe_load(text) or {}, str(source))
    check(cfg, str(source))
    return cfg


def check(cfg: dict, where: str) -> None:
    """The checks that span keys or need the optimizer's own rules, so that a bad value stops
    the run here rather than on every rank after the process group started."""
    o = cfg["optimizer"]
    for key in ("lr", "betas", "weight_decay"):
        # one key at a time over valid defaults, so the error can name the key at fault
        trial = {**cfg, "optimizer": {**DEFAULTS["optimizer"], "name": o["name"], key: o[key]}}
        try:
            build_optimizer(trial, [torch.zeros(1, requires_grad=True)])
        except (TypeError, ValueError) as e:
            raise ConfigError(
                f"{where}: key 'optimizer.{key}' = {o[key]!r} is refused by {o['name']}: {e}"
            ) from None
    check_mesh(cfg, where)
    c = cfg["checkpoint"]
    if not 0 <= c["save_at"] <= cfg["steps"]:
        raise ConfigError(
            f"{where}: key 'checkpoint.save_at' must be in [0, steps={cfg['steps']}] "
            f"(0: the last step), got {c['save_at']}"
        )
    if c["every"] < 0:
        raise ConfigError(
            f"{where}: key 'checkpoint.every' must be >= 0 (0: off), got {c['every']}"
        )
    for key in ("save_at", "every"):
        if c[key] and not c["dir"]:
            raise ConfigError(f"{where}: key 'checkpoint.{key}' needs 'checkpoint.dir' set")
    if c["resume"] and find_checkpoint(c["resume"]) is None:
        raise ConfigError(
            f"{where}: key 'checkpoint.resume': {c['resume']!r} holds no complete checkpoint of "
            f"this script (no step_NNNNNN/ with a {DONE} marker, nor a "
            f"{TRAINER_FILE.format(0)})"
        )


def check_mesh(cfg: dict, where: str) -> None:
    """``sharding.mesh``: [replicate, shard], both positive, or [0, 0] (one shard group per
    node); only for hsdp; and, where the launcher has set WORLD_SIZE, a shape of that many ranks,
    so that a wrong shape stops here and not in every rank's mesh setup."""
    s = cfg["sharding"]
    mesh = s["mesh"]
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in mesh):
        raise ConfigError(
            f"{where}: key 'sharding.mesh' must be two integers >= 0 [replicate, shard], "
            f"got {mesh!r}"
        )
    if mesh != [0, 0] and 0 in mesh:
        raise ConfigError(
            f"{where}: key 'sharding.mesh' must be [replicate, shard] with both positive, or "
            f"[0, 0] (one shard group per node), got {mesh!r}"
        )
    if mesh != [0, 0] and s["mode"] != "hsdp":
        raise ConfigError(
            f"{where}: key 'sharding.mesh' applies to sharding.mode 'hsdp' only "
            f"(mode is {s['mode']!r}); leave it [0, 0]"
        )
    world = os.environ.get("WORLD_SIZE")
    if s["mode"] == "hsdp" and world is not None:
        shape = hsdp_shape(cfg, int(world), local_world_size())
        if shape.replicate * shape.shard != int(world):
            raise ConfigError(
                f"{where}: key 'sharding.mesh' = {mesh!r} is a mesh of "
                f"{shape.replicate * shape.shard} ranks, but the launcher started {world}"
            )


def local_world_size() -> int | None:
    """Ranks per node, as the launcher says: torchrun's LOCAL_WORLD_SIZE, DeepSpeed's LOCAL_SIZE."""
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        if name in os.environ:
            return int(os.environ[name])
    return None


def hsdp_shape(cfg: dict, world: int, local_world: int | None) -> MeshShape:
    """The hsdp mesh: the config's, or one shard group per node."""
    replicate, shard = cfg["sharding"]["mesh"]
    if (replicate, shard) != (0, 0):
        return MeshShape(replicate, shard)
    if local_world is None:
        raise ConfigError(
            "sharding.mesh [0, 0] shards within a node, but the launcher did not say how many "
            "ranks a node runs (LOCAL_WORLD_SIZE): set sharding.mesh to [replicate, shard]"
        )
    if world % local_world:
        raise ConfigError(
            f"sharding.mesh [0, 0] shards within a node, but {world} ranks do not divide into "
            f"nodes of {local_world}: set sharding.mesh to [replicate, shard]"
        )
    return MeshShape(world // local_world, local_world)


def set_key(cfg: dict, dotted: str) -> None:
    """Apply one ``--set optimizer.name=adamw`` override (the value parsed as YAML)."""
    if "=" not in dotted:
        raise ConfigError(f"--set {dotted!r}: expected KEY=VALUE")
    key, value = dotted.split("=", 1)
    *path, last = key.split(".")
    nested: dict = {last: yaml.safe_load(value)}
    for part in reversed(path):
        nested = {part: nested}
    merged = _merge(DEFAULTS, _deep_update(copy.deepcopy(cfg), nested), f"--set {key}")
    cfg.clear()
    cfg.update(merged)


def _deep_update(base: dict, new: dict) -> dict:
    for k, v in new.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _deep_update(base[k], v)
        else:
            base[k] = v
    return base


def flatten(cfg: dict, prefix: str = "") -> dict:
    """``{"optimizer.lr": ...}`` for ``{"optimizer": {"lr": ...}}``: the keys a resume compares."""
    out = {}
    for k, v in cfg.items():
        out.update(flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def lr_factor(cfg: dict, step: int) -> float:
    """Linear warmup over ``warmup`` steps, then cosine decay to ``min_lr_frac`` at the end."""
    o = cfg["optimizer"]
    return warmup_cosine(step, cfg["steps"], o["warmup"], o["min_lr_frac"])
