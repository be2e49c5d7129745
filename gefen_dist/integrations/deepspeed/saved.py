"""A ZeRO checkpoint of Gefen read whole in one process, without an engine (``SavedZero``).

What a resume at another data-parallel degree or ZeRO stage (``recut``) and ``python -m
gefen_dist.checkpoint consolidate`` (``checkpoint.zero``) start from: every saved rank's file
read and checked (there, readable, of this checkpoint, every Gefen entry fitting the segments
its rank recorded, ``meta``), the fp32 master weights and Gefen's state put together per tensor.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from deepspeed.checkpoint.constants import (
    BASE_OPTIMIZER_STATE,
    FP32_FLAT_GROUPS,
    OPTIMIZER_STATE_DICT,
    SINGLE_PARTITION_OF_FP32_GROUPS,
    ZERO_STAGE,
)

from ...method import portable
from ...method.segments import Segment, decode
from ...method.state import bits_of, check_loaded
from .meta import META_KEY

__all__ = ["ModelFile", "SavedZero", "model_file", "read", "read_checkpoint", "tag_of"]

_ZERO3_MODEL = "zero_pp_rank_0_mp_rank_{mp:02d}_model_states.pt"
_MODEL = "mp_rank_{mp:02d}_model_states.pt"
_ZERO_FILE = "{prefix}zero_pp_rank_{rank}_mp_rank_{mp:02d}_optim_states.pt"


class ModelFile(NamedTuple):
    """A tag's model-states file, and whether ZeRO-3 wrote it (the two name it differently)."""

    path: str
    zero3: bool


def model_file(tag_dir: str, mp: int) -> ModelFile:
    """The tag's model-states file of model-parallel rank ``mp`` (ZeRO-3's if it is there)."""
    zero3_path = os.path.join(tag_dir, _ZERO3_MODEL.format(mp=mp))
    if os.path.isfile(zero3_path):
        return ModelFile(zero3_path, True)
    return ModelFile(os.path.join(tag_dir, _MODEL.format(mp=mp)), False)


def tag_of(load_dir: str) -> str | None:
    """The tag the checkpoint directory's 'latest' file names; None without one."""
    latest = os.path.join(load_dir, "latest")
    if not os.path.isfile(latest):
        return None
    with open(latest) as fd:
        return fd.read().strip()


def read(path: str, what: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"the checkpoint lacks {what}: {path} does not exist")
    try:
        # DeepSpeed's checkpoints hold its own objects (loss scaler, config), not only tensors
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:
        msg = f"{path} ({what}) is not a readable checkpoint file ({type(e).__name__}: {e})"
        raise ValueError(msg) from None


@dataclass
class SavedRank:
    """One saved rank's zero file: its Gefen state dict and fp32 master partitions."""

    path: str
    wrapper_sd: dict[str, Any]
    gefen_sd: dict[str, Any]
    meta: dict[str, Any]
    masters: list[torch.Tensor]


def _saved_rank(path: str, rank: int, world: int) -> SavedRank:
    sd = read(path, f"the ZeRO state of data-parallel rank {rank} of {world}")
    wrapper_sd = sd.get(OPTIMIZER_STATE_DICT)
    if not isinstance(wrapper_sd, dict):
        raise ValueError(f"{path}: no {OPTIMIZER_STATE_DICT!r} (not a ZeRO optimizer state file)")
    zero3 = int(wrapper_sd.get(ZERO_STAGE, 0)) == 3
    inner, flat_key = (
        (OPTIMIZER_STATE_DICT, FP32_FLAT_GROUPS)
        if zero3
        else (BASE_OPTIMIZER_STATE, SINGLE_PARTITION_OF_FP32_GROUPS)
    )
    gefen_sd = wrapper_sd.get(inner)
    meta = gefen_sd.get(META_KEY) if isinstance(gefen_sd, dict) else None
    if meta is None:
        raise ValueError(
            f"{path}: its optimizer state is not Gefen's under DeepSpeed (no {META_KEY!r} "
            "entry): a checkpoint of another optimizer"
        )
    if "flats" not in meta:
        raise ValueError(
            f"{path}: saved by a gefen_dist that did not record the ranks' segments; resume it "
            f"at its own layout ({meta['wrapper']} on {meta['world_size']} ranks)"
        )
    if (meta["rank"], meta["world_size"]) != (rank, world):
        raise ValueError(
            f"{path}: holds rank {meta['rank']} of {meta['world_size']}, expected {rank} of "
            f"{world} (files of two checkpoints mixed?)"
        )
    return SavedRank(path, wrapper_sd, gefen_sd, meta, list(wrapper_sd[flat_key]))


class _First(NamedTuple):
    """Where a tensor's first element was saved; tensors sort in their flat buffers' order."""

    group: int
    buffer: int
    rank: int
    offset: int
    name: str


def _segments(entry: dict[str, Any]) -> list[Segment]:
    """A saved flat's segments, each named by its tensor ("" for padding)."""
    return decode(entry["segments"])


class SavedZero:
    """A ZeRO checkpoint of Gefen read whole in this process, without an engine: every
    tensor's fp32 master weights (``weights``, flat, and ``shapes``), Gefen's state of every
    tensor put together from all saved ranks (``tensors``, ``method.portable``; None where it
    was saved before the first step) and Gefen's saved param groups. Reading checks that every
    rank's file is there and readable and every Gefen entry fits its recorded segments."""

    def __init__(self, model_path: str, model_sd: dict[str, Any], mp: int = 0) -> None:
        self.model_path, self.model_sd = model_path, model_sd
        tag_dir = os.path.dirname(model_path)
        world = int(model_sd["dp_world_size"])
        self.ranks = [_saved_rank(self._zero_file(tag_dir, r, mp), r, world) for r in range(world)]
        self.kind = self.ranks[0].meta["wrapper"]
        self.world_size = world
        self.weights = self._masters()
        self.tensors = self._gefen_pieces()
        self.param_groups = self.ranks[0].gefen_sd.get("param_groups", [])

    def group_names(self) -> list[list[str]]:
        """The tensors of each saved param group in their flat buffers' order: by where each
        tensor's first element was saved (group, buffer, rank, offset)."""
        out: list[list[str]] = [[] for _ in self.param_groups]
        firsts = sorted(
            _First(e.get("group", e["buffer"]), e["buffer"], rank, s.offset, s.name)
            for rank, r in enumerate(self.ranks)
            for e in r.meta["flats"]
            for s in _segments(e)
            if s.name and s.start == 0
        )
        for first in firsts:
            if first.group >= len(out):
                raise ValueError(
                    f"{self.model_path}: {first.name} is recorded in param group {first.group} "
                    f"of {len(out)} (saved before the groups were recorded): resume it with "
                    "engine.load_checkpoint instead"
                )
            out[first.group].append(first.name)
        return out

    @staticmethod
    def _zero_file(tag_dir: str, rank: int, mp: int) -> str:
        names = [_ZERO_FILE.format(prefix=p, rank=rank, mp=mp) for p in ("", "bf16_")]
        found = [n for n in names if os.path.isfile(os.path.join(tag_dir, n))]
        return os.path.join(tag_dir, found[0] if found else names[0])

    def _masters(self) -> dict[str, torch.Tensor]:
        """Every tensor's fp32 master weights, put together from the saved partitions."""
        out: dict[str, torch.Tensor] = {}
        filled: dict[str, torch.Tensor] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for r in self.ranks:
            for entry in r.meta["flats"]:
                buf = r.masters[entry["buffer"]].reshape(-1)
                for s in _segments(entry):
                    if not s.name:
                        continue
                    if s.offset + s.numel > buf.numel():
                        raise ValueError(
                            f"{r.path}: its fp32 partition {entry['buffer']} has {buf.numel()} "
                            f"elements, {s.name}'s piece ends at {s.offset + s.numel} (truncated)"
                        )
                    n = s.tensor_numel
                    t = out.setdefault(s.name, torch.zeros(n, dtype=torch.float32))
                    seen = filled.setdefault(s.name, torch.zeros(n, dtype=torch.bool))
                    t[s.start : s.start + s.numel] = buf[s.offset : s.offset + s.numel].float()
                    seen[s.start : s.start + s.numel] = True
                    self.shapes[s.name] = s.shape
        for name, seen in filled.items():
            if not bool(seen.all()):
                first = int((~seen).nonzero()[0])
                raise ValueError(f"{name}: no saved rank holds its weights from element {first}")
        return out

    def _gefen_pieces(self) -> dict[str, portable.TensorState] | None:
        parts, stepped = [], []
        for r in self.ranks:
            state = r.gefen_sd.get("state", {})
            for k, entry in enumerate(r.meta["flats"]):
                st = state.get(k)
                stepped.append(bool(st))
                if not st:
                    continue
                segs = _segments(entry)
                try:
                    check_loaded(st, segs, bits_of(st["codebook"]), f"entry {k}")
                    parts += portable.export(st, segs)
                except (KeyError, TypeError, ValueError) as e:
                    msg = f"{r.path}: Gefen entry {k} does not fit its recorded segments: {e}"
                    raise ValueError(msg) from None
        if not any(stepped):
            return None  # saved before the first step: Gefen starts afresh, as it would have
        if not all(stepped):
            raise ValueError(
                f"{os.path.dirname(self.model_path)}: some ranks' Gefen entries are empty and "
                "others not (files of two checkpoints mixed?)"
            )
        tensors = portable.merge(parts)
        for ts in tensors.values():
            gaps = ts.missing()
            if gaps:
                raise ValueError(f"{ts.name}: no saved rank holds Gefen state of elements {gaps}")
        return tensors


def read_checkpoint(load_dir: str, tag: str | None = None, mp_rank: int = 0) -> SavedZero:
    """A ZeRO-1/2/3 checkpoint of Gefen (``engine.save_checkpoint(load_dir)``) read whole in
    this process, for conversion (``python -m gefen_dist.checkpoint consolidate``)."""
    if tag is None:
        tag = tag_of(load_dir)
        if tag is None:
            raise FileNotFoundError(f"{load_dir} has no 'latest' file: name the tag")
    path = model_file(os.path.join(load_dir, str(tag)), mp_rank).path
    return SavedZero(path, read(path, "the model states"), mp_rank)
