"""Gefen under DeepSpeed ZeRO: stages 1, 2 and 3, and DeepSpeed's bf16 stage-1 optimizer.

Why this module exists: ZeRO hands the inner optimizer one flat fp32 partition per param group
(stages 1 and 2, ``BF16_Optimizer``) or per sub-group (stage 3), each made of pieces of many
tensors and of alignment padding. Gefen chooses a block size per original tensor and learns one
codebook from the first gradient of the whole model, so it must be told where each tensor's pieces
lie in every partition and over which process group the other pieces are (``Gefen.set_segments``).
And it must see the first gradient of every partition before it updates any: ZeRO steps the
inner optimizer one group (stage 3: one sub-group) at a time, and a codebook learned from the
first group alone would differ from the single-process one (or, for a group of biases and norms
that all keep B = 1, be learned from nothing). So on the first step the earlier groups' calls are
held back (their gradients kept, a transient of one fp32 gradient partition) and the last call
initialises and updates all groups at once, then republishes the earlier groups' weights to the
low-precision copies ZeRO has already refreshed from them.

Under pipeline parallelism (``PipelineEngine``, which allows ZeRO stages 0 and 1) each stage's
Gefen steps that stage's partitions over the stage's data-parallel group, so its block sizes are
those of a single process, and its codebook is learned from that stage's layers alone; a weight
tied across stages (``TiedLayerSpec``) is refused, as its copies would drift apart.

Importing this module registers Gefen as a ZeRO-supported optimizer (no
``zero_allow_untested_optimizer``) and makes ``deepspeed.initialize`` configure every engine built
on a Gefen optimizer as soon as its ZeRO wrapper exists, before any step or checkpoint load.
``configure(engine)`` does the same by hand (for a wrapper built some other way) and is idempotent.

ZeRO-Offload (``offload_optimizer: {"device": "cpu"}``, stages 2 and 3) hands Gefen the fp32
partitions on the host, which Gefen steps with its C++ kernel (``backends.native_cpu``, chosen
for CPU tensors). DeepSpeed refuses a client optimizer under offload unless
``zero_force_ds_cpu_optimizer`` is false, lest a torch optimizer step the host slowly; for a
Gefen instance passed as ``optimizer=`` the check is lifted (a Gefen built by a callable
``optimizer=`` is still checked: set the key false, or name Gefen in the config).

It also lets a DeepSpeed JSON config name Gefen itself, ``"optimizer": {"type": "Gefen", "params":
{...}}`` (the type in any case), so that launchers which build the optimizer from the config
(``deepspeed.initialize`` without ``optimizer=``, Accelerate's ``DummyOptim``, the Hugging Face
Trainer's ``--deepspeed``) get Gefen. DeepSpeed resolves a type it does not know with
``getattr(torch.optim, name)``; the hook adds ``"gefen"`` to DeepSpeed's own optimizer names (which
makes its config lower-case the type and its sanity check accept it) and builds Gefen in
``DeepSpeedEngine._configure_basic_optimizer``. ``params`` are Gefen's keyword arguments; any other
key is refused with the list of valid ones (DeepSpeed would pass it on as a TypeError), and so is a
value of the wrong JSON type, by its key (an "auto" only Accelerate or the Trainer resolve).

Checkpoints: ZeRO's rigid checkpoints (the default) carry each rank's ``Gefen.state_dict()``
unchanged, with the rank's segments (by tensor name) in its ``META_KEY`` entry, and load it
through Gefen's own hooks, so a resume at the same data-parallel degree is exact; between ZeRO-1,
ZeRO-2 and BF16_Optimizer Gefen's own check compares the segments.

At another data-parallel degree, or between ZeRO-3 and ZeRO-1/2, DeepSpeed 0.19.8 cannot resume
on its own: ``_load_zero_checkpoint`` raises ZeRORuntimeException for optimizer states at another
degree; with ``load_optimizer_states=False`` ZeRO-1/2 would take the master weights from the
model file's low-precision copy and ZeRO-3 finds no ``zero_pp_rank_{r}_model_states.pt`` for a
new rank r; the two layouts name their model files differently, so a stage change finds none.
So ``engine.load_checkpoint`` is wrapped: when the saved degree or ZeRO-3-ness differs from the
engine's, every rank reads all the saved ranks' files, checks them (every rank's file there and
readable, the same tensor names and shapes as this model, every Gefen entry whole) before
anything is changed, then writes its own fp32 master partition from the saved ones (exact),
republishes the low-precision copies, and cuts its Gefen state from every saved piece with
``method.portable`` (exact where a block piece was saved as it is; its docstring says what is
merged or split). Buffers, the learning-rate scheduler, the step counters and the client state
come from the model file as DeepSpeed's own load takes them. Not covered there (refused by
name): frozen parameters, BF16_Optimizer, checkpoints saved before the segments were recorded.
``read_checkpoint(dir)`` reads such a checkpoint whole without an engine (``SavedZero``), for
``python -m gefen_dist.checkpoint consolidate`` (``checkpoint.zero``).
``load_optimizer_state(engine, sd)`` goes the other way: a single-process Gefen state (one
process's ``opt.state_dict()``, or the name-keyed state ``consolidate`` writes) cut into this
engine's partitions the same way.
``elastic_checkpoint`` is refused: it cuts every state tensor by the partition padding and merges
state element by element, which would corrupt block state; so is universal-checkpoint loading,
which restores only element-wise state keys and would silently drop Gefen's.
"""

from __future__ import annotations

import functools
import inspect
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.checkpoint.constants import (
    BASE_OPTIMIZER_STATE,
    CLIP_GRAD,
    FP32_FLAT_GROUPS,
    OPTIMIZER_STATE_DICT,
    SINGLE_PARTITION_OF_FP32_GROUPS,
    ZERO_STAGE,
)
from deepspeed.runtime import config as ds_config
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.pipe.module import PipelineModule
from deepspeed.runtime.zero import utils as zero_utils
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from ..method import portable
from ..method.segments import Segment
from ..method.state import allocate, bits_of, check_loaded
from ..optimizer import Gefen
from ..validation import is_real

__all__ = [
    "configure",
    "memory_report",
    "block_sizes",
    "from_config",
    "read_checkpoint",
    "load_optimizer_state",
    "SavedZero",
    "META_KEY",
    "OPTIMIZER_TYPE",
]

OPTIMIZER_TYPE = "gefen"
"""``optimizer.type`` of a DeepSpeed config that selects Gefen (matched in any case)."""

META_KEY = "gefen_deepspeed"
"""Key of the entry ``Gefen.state_dict()`` gains under DeepSpeed: wrapper, rank and world size."""


@dataclass
class _Flat:
    """One buffer Gefen steps: a rank's partition of a param group or sub-group."""

    tensor: torch.Tensor
    group: int
    segments: list[Segment]
    labels: list[str]
    """Original tensor name per segment; "" for padding."""


class _Binding:
    """What ties one Gefen optimizer to one ZeRO wrapper: layouts, first-step hold, hooks."""

    def __init__(
        self,
        gefen: Gefen,
        wrapper: Any,
        kind: str,
        flats: list[_Flat],
        group: dist.ProcessGroup | None,
        republish: Callable[[int], None],
    ) -> None:
        self.gefen = gefen
        self.wrapper = wrapper
        self.kind = kind
        self.flats = flats
        self.group = group
        self.rank = dist.get_rank(group) if group is not None else 0
        self.world_size = dist.get_world_size(group) if group is not None else 1
        self._republish = republish
        self._group_dicts = list(gefen.param_groups)
        self._index = {id(f.tensor): i for i, f in enumerate(flats)}
        self._held: dict[int, torch.Tensor] = {}
        self._found: dict[int, torch.Tensor | None] = {}
        self._hidden: list[int] = []
        self._restore: tuple[list, list] | None = None
        self._ready = False
        for f in flats:
            gefen.set_segments(f.tensor, f.segments, group)
        gefen.register_step_pre_hook(self._pre_step)
        gefen.register_step_post_hook(self._post_step)
        gefen.register_state_dict_post_hook(self._add_meta)
        gefen.register_load_state_dict_pre_hook(self._check_meta, prepend=True)
        gefen.register_load_state_dict_post_hook(self._loaded)

    # -- first step: hold earlier groups until every partition has its first gradient -----------
    def _pre_step(self, opt: Gefen, args: Any, kwargs: Any) -> None:
        if self._ready:
            return
        todo = {i for i, f in enumerate(self.flats) if not opt.state.get(f.tensor)}
        if not todo:
            self._ready = True
            return
        now = [
            self._index[id(p)]
            for g in opt.param_groups
            for p in g["params"]
            if p.grad is not None and id(p) in self._index
        ]
        if not todo <= set(now) | set(self._held):
            # Gefen.step skips parameters without a gradient: this call updates nothing.
            for i in now:
                t = self.flats[i].tensor
                self._held[i] = t.grad
                self._hidden.append(i)
                t.grad = None
            return
        self._found = {i: self.flats[i].tensor.grad for i in self._held}
        for i, g in self._held.items():
            self.flats[i].tensor.grad = g
        self._restore = (opt.param_groups, [g["params"] for g in self._group_dicts])
        for gi, g in enumerate(self._group_dicts):
            g["params"] = [f.tensor for f in self.flats if f.group == gi]
        opt.param_groups = list(self._group_dicts)

    def _post_step(self, opt: Gefen, args: Any, kwargs: Any) -> None:
        """Leave every gradient as the wrapper handed it over, and the param groups as it set
        them; after the joint first update, refresh the earlier groups' low-precision copies."""
        for i in self._hidden:
            self.flats[i].tensor.grad = self._held[i]
        self._hidden = []
        if self._restore is None:
            return
        groups, params = self._restore
        opt.param_groups = groups
        for g, ps in zip(self._group_dicts, params, strict=True):
            g["params"] = ps
        self._restore = None
        for i, g in self._found.items():
            self.flats[i].tensor.grad = g
        for i in sorted(self._held):
            self._republish(i)
        self._held, self._found = {}, {}
        self._ready = True

    # -- checkpoints --------------------------------------------------------------------------
    def _meta(self) -> dict[str, Any]:
        return {"wrapper": self.kind, "rank": self.rank, "world_size": self.world_size}

    def _add_meta(self, opt: Gefen, state_dict: dict[str, Any]) -> dict[str, Any]:
        """The rank's segments, by tensor name, in state-dict order: what a resume at another
        layout needs to take this rank's state and master weights apart (``_Recut``)."""
        flats = []
        for p in (p for g in opt.param_groups for p in g["params"]):
            i = self._index.get(id(p))
            if i is None:
                continue
            f = self.flats[i]
            segs = [
                [s.offset, s.numel, s.start, list(s.shape), label]
                for s, label in zip(f.segments, f.labels, strict=True)
            ]
            flats.append({"buffer": i, "group": f.group, "segments": segs})
        return {**state_dict, META_KEY: {**self._meta(), "flats": flats}}

    def _check_meta(self, opt: Gefen, state_dict: dict[str, Any]) -> dict[str, Any]:
        """ZeRO-1, ZeRO-2 and BF16_Optimizer lay partitions out alike, so a state may move
        between them (Gefen's own check then compares the segments); ZeRO-3 partitions every
        tensor, so its states fit nothing else; and no state fits another rank's partition."""
        saved = state_dict.get(META_KEY)
        here = self._meta()
        if saved is None:
            raise ValueError(
                f"this Gefen state dict was not saved under DeepSpeed (no {META_KEY!r} entry), "
                f"so it cannot fit the partitions of {here['wrapper']} rank {here['rank']} of "
                f"{here['world_size']}; load it into a plain Gefen, or resume from a DeepSpeed "
                "checkpoint"
            )

        def key(m: dict[str, Any]) -> tuple:
            return (m["wrapper"] == "ZeRO-3", m["rank"], m["world_size"])

        if key(saved) != key(here):
            raise ValueError(
                f"this Gefen state was saved by {saved['wrapper']} on rank {saved['rank']} of "
                f"{saved['world_size']} and is being loaded into {here['wrapper']} on rank "
                f"{here['rank']} of {here['world_size']}. Gefen's state is laid out in blocks over "
                "each rank's partition (blocks cut at partition ends keep their own second moment "
                "and scale): engine.load_checkpoint(dir) re-cuts it for another world size or "
                "ZeRO stage; a state dict loaded by hand must fit the same partitions"
            )
        return {k: v for k, v in state_dict.items() if k != META_KEY}

    def _loaded(self, opt: Gefen) -> None:
        """torch's loader replaces the param group dicts; the wrapper steps the new ones."""
        self._group_dicts = list(opt.param_groups)

    # -- reporting ----------------------------------------------------------------------------
    def with_all_params(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` with every partition in the Gefen param groups (ZeRO-3 empties them
        between steps)."""
        opt = self.gefen
        saved = (opt.param_groups, [g["params"] for g in self._group_dicts])
        try:
            for gi, g in enumerate(self._group_dicts):
                g["params"] = [f.tensor for f in self.flats if f.group == gi]
            opt.param_groups = list(self._group_dicts)
            return fn()
        finally:
            opt.param_groups = saved[0]
            for g, ps in zip(self._group_dicts, saved[1], strict=True):
                g["params"] = ps

    def block_sizes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for f in self.flats:
            st = self.gefen.state.get(f.tensor)
            if not st:
                continue
            by_offset = {int(r[0]): int(r[3]) for r in st["layout"].tolist()}
            for seg, label in zip(f.segments, f.labels, strict=True):
                if label:
                    out[label] = by_offset[seg.offset]
        return out


_BINDINGS: weakref.WeakKeyDictionary[Gefen, _Binding] = weakref.WeakKeyDictionary()


# -- layouts ---------------------------------------------------------------------------------
def _pad(offset: int, numel: int) -> Segment:
    return Segment(offset=offset, numel=numel, start=0, shape=(numel,))


def _cut(
    pieces: list[tuple[int, tuple[int, ...], str]], lo: int, hi: int
) -> tuple[list[Segment], list[str]]:
    """Segments of the window [lo, hi) of a flat buffer in which tensor k (shape, name) starts at
    ``pieces[k][0]``; what no tensor covers is padding. A tensor wholly in the window gets no
    segment name: only pieces of tensors spread over ranks need their statistics merged."""
    segs: list[Segment] = []
    labels: list[str] = []
    pos = lo
    for at, shape, name in sorted(pieces):
        n = _numel(shape)
        a, b = max(at, lo), min(at + n, hi)
        if a >= b:
            continue
        if a > pos:
            segs.append(_pad(pos - lo, a - pos))
            labels.append("")
        segs.append(Segment(a - lo, b - a, a - at, shape, name if b - a < n else ""))
        labels.append(name)
        pos = b
    if pos < hi:
        segs.append(_pad(pos - lo, hi - pos))
        labels.append("")
    return segs, labels


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _names(wrapper: Any) -> dict[int, str]:
    return {id(p): n for p, n in (getattr(wrapper, "param_names", None) or {}).items()}


def _one_group(groups: list[dist.ProcessGroup], what: str) -> dist.ProcessGroup:
    first = groups[0]
    if any(g is not first for g in groups):
        raise ValueError(
            f"Gefen under DeepSpeed needs every {what} partitioned over one process group; this "
            "engine uses several (MoE expert groups or ZeRO-3 parameter groups): one Gefen "
            "optimizer spans one process group"
        )
    return first


def _stage12(zo: DeepSpeedZeroOptimizer) -> tuple[list[_Flat], dist.ProcessGroup, Callable]:
    names = _names(zo)
    pg = _one_group(list(zo.real_dp_process_group), "param group")
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    flats = []
    for i, params in enumerate(zo.round_robin_bit16_groups):
        flat = zo.single_partition_of_fp32_groups[i]
        size = int(zo.partition_size[i])
        total = zo.bit16_groups_flat[i].numel()
        if size * world != total or flat.numel() != size:
            raise RuntimeError(
                f"ZeRO param group {i}: partition of {flat.numel()} elements, expected {size} of "
                f"a {total}-element flat buffer over {world} ranks; this DeepSpeed version "
                "partitions differently from what gefen_dist.integrations.deepspeed knows"
            )
        # Older DeepSpeed has no parameter alignment padding (nor these lists).
        metas = zo.round_robin_bit16_meta[i] if hasattr(zo, "round_robin_bit16_meta") else params
        pads = getattr(zo, "round_robin_bit16_padding", None)
        pieces, at = [], 0
        for k, (p, meta) in enumerate(zip(params, metas, strict=True)):
            pieces.append((at, tuple(meta.shape), names.get(id(p), f"group {i} param {k}")))
            at += meta.numel() + (pads[i][k] if pads is not None else 0)
        segs, labels = _cut(pieces, rank * size, (rank + 1) * size)
        flats.append(_Flat(flat, i, segs, labels))

    def republish(i: int) -> None:
        part = zo.parallel_partitioned_bit16_groups[i][rank]
        part.data.copy_(zo.single_partition_of_fp32_groups[i].data)

    return flats, pg, republish


def _bf16(bo: BF16_Optimizer) -> tuple[list[_Flat], dist.ProcessGroup, Callable]:
    names = _names(bo)
    pg = _one_group(list(bo.real_dp_process_group), "param group")
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    flats = []
    for i, params in enumerate(bo.bf16_groups):
        flat = bo.fp32_groups_flat_partition[i]
        size = bo.bf16_groups_flat[i].numel() // world
        pieces, at = [], 0
        for k, p in enumerate(params):
            pieces.append((at, tuple(p.shape), names.get(id(p), f"group {i} param {k}")))
            at += p.numel()
        segs, labels = _cut(pieces, rank * size, (rank + 1) * size)
        flats.append(_Flat(flat, i, segs, labels))
    return flats, pg, lambda i: None


def _stage3(zo: DeepSpeedZeroOptimizer_Stage3) -> tuple[list[_Flat], dist.ProcessGroup, Callable]:
    names = _names(zo)
    n = len(zo.fp16_groups)
    pgs = [zo._get_sub_group_process_group(j) for j in range(n)]
    pg = _one_group(pgs, "sub-group")
    rank = dist.get_rank(pg)
    flats = []
    for j, params in enumerate(zo.fp16_groups):
        flat = zo.fp32_partitioned_groups_flat[j]
        segs, labels = [], []
        at = 0
        for p in params:
            pn = p.partition_numel()
            shape = tuple(p.ds_shape)
            start = rank * pn
            real = max(0, min(pn, p.ds_numel - start))
            name = names.get(id(p), f"param {p.ds_id}")
            if real:
                segs.append(Segment(at, real, start, shape, name if real < p.ds_numel else ""))
                labels.append(name)
            if pn > real:
                segs.append(_pad(at + real, pn - real))
                labels.append("")
            at += pn
        if at != flat.numel():
            raise RuntimeError(
                f"ZeRO-3 sub-group {j}: flat partition has {flat.numel()} elements, its "
                f"parameters' partitions {at}; this DeepSpeed version lays out sub-groups "
                "differently from what gefen_dist.integrations.deepspeed knows"
            )
        flats.append(_Flat(flat, int(zo.sub_group_to_group_id[j]), segs, labels))
    return flats, pg, zo._reassign_or_swap_out_partitioned_parameters


# -- configuration ---------------------------------------------------------------------------
def _refuse_unsupported(engine: DeepSpeedEngine | None, wrapper: Any) -> None:
    def no(problem: str) -> None:
        raise ValueError(f"Gefen under DeepSpeed: {problem}")

    if engine is not None and engine.load_universal_checkpoint():
        no(
            "load_universal_checkpoint is not supported: a universal checkpoint restores only "
            "optimizer state kept element by element (AdamW's exp_avg), so Gefen's block state "
            "would be silently dropped; resume from the rigid ZeRO checkpoint instead"
        )
    if getattr(wrapper, "elastic_checkpoint", False):
        no(
            "zero_optimization.elastic_checkpoint is not supported: it strips partition padding "
            "from every optimizer-state tensor and merges them element by element, which would "
            "corrupt Gefen's per-block state; leave it false (the default)"
        )
    if engine is not None:
        _refuse_tied_stages(engine)
    if getattr(wrapper, "has_moe_layers", False):
        no("MoE layers are not supported (experts are partitioned over other process groups)")
    if getattr(wrapper, "zenflow", False):
        no("ZenFlow is not supported (it steps its own CPU optimizer)")
    if isinstance(wrapper, DeepSpeedZeroOptimizer_Stage3):
        if wrapper.swap_optimizer or wrapper.params_in_nvme_and_cpu:
            no("NVMe offload is not supported (the swapper assumes element-wise optimizer state)")
        if wrapper.offload_optimizer and wrapper.partial_offload != 1.0:
            no(
                "partial optimizer offload (offload_optimizer.ratio < 1) is not supported: part "
                "of the sub-groups would be stepped by a separate backup optimizer"
            )


def _refuse_tied_stages(engine: DeepSpeedEngine) -> None:
    """A pipeline weight tied over stages (``TiedLayerSpec``) has one copy per stage, each stepped
    by that stage's Gefen from the same all-reduced gradient. Each stage learns its codebook from
    its own layers' first gradient, so the copies get different updates and drift apart (3e-3
    in 6 steps at lr 3e-3 on the tiny GPT; AdamW keeps them equal)."""
    tied = getattr(engine.module, "tied_comms", None) or {}
    spread = {k: d["ranks"] for k, d in tied.items() if len(d["ranks"]) > 1}
    if spread:
        key, ranks = next(iter(spread.items()))
        raise ValueError(
            f"Gefen under DeepSpeed: pipeline weights tied across stages are not supported "
            f"(TiedLayerSpec {key!r} has copies on global ranks {ranks}): each stage's Gefen "
            "learns its own codebook, so the copies would get different updates and drift "
            "apart; untie the weight, or keep every layer that shares it on one stage"
        )


def configure(target: Any) -> None:
    """Bind the Gefen optimizer inside a DeepSpeed engine (or ZeRO wrapper) to its partitions.

    Called automatically for engines built after this module was imported; calling it again is a
    no-op. Raises ValueError naming the problem for configurations Gefen does not support."""
    engine = target if isinstance(target, DeepSpeedEngine) else None
    _bind(engine, engine.optimizer if engine is not None else target)


def _bind(engine: DeepSpeedEngine | None, wrapper: Any) -> None:
    if isinstance(wrapper, Gefen):
        return  # no ZeRO: Gefen is handed the model's own parameters
    gefen = getattr(wrapper, "optimizer", None)
    if not isinstance(gefen, Gefen):
        raise ValueError(f"no Gefen optimizer inside {type(wrapper).__name__}")
    bound = _BINDINGS.get(gefen)
    if bound is not None:
        if bound.wrapper is not wrapper:
            raise ValueError("this Gefen optimizer is already bound to another DeepSpeed engine")
        return
    _refuse_unsupported(engine, wrapper)
    kind = type(wrapper)
    if kind is DeepSpeedZeroOptimizer:
        flats, pg, republish = _stage12(wrapper)
        name = "ZeRO-2" if wrapper.partition_gradients else "ZeRO-1"
    elif kind is DeepSpeedZeroOptimizer_Stage3:
        flats, pg, republish = _stage3(wrapper)
        name = "ZeRO-3"
    elif kind is BF16_Optimizer:
        flats, pg, republish = _bf16(wrapper)
        name = "BF16_Optimizer"
    else:
        raise ValueError(
            f"Gefen under DeepSpeed: the {kind.__name__} wrapper is not supported; use ZeRO "
            "stage 1, 2 or 3 (zero_optimization.stage), or fp32 training without ZeRO"
        )
    _BINDINGS[gefen] = _Binding(gefen, wrapper, name, flats, pg, republish)


def _stepped(engine: Any) -> tuple[Gefen, _Binding | None]:
    """The Gefen optimizer an engine (or ZeRO wrapper) steps, and its binding; no binding under
    ZeRO-0 in fp32, where DeepSpeed steps Gefen itself on the model's own parameters."""
    wrapper = engine.optimizer if isinstance(engine, DeepSpeedEngine) else engine
    if isinstance(wrapper, Gefen):
        return wrapper, None
    inner = getattr(wrapper, "optimizer", None)
    if not isinstance(inner, Gefen):
        what = "no optimizer" if wrapper is None else type(wrapper).__name__
        raise ValueError(f"this engine steps {what}, not a Gefen optimizer")
    b = _BINDINGS.get(inner)
    if b is None:
        raise ValueError(
            f"the Gefen optimizer inside {type(wrapper).__name__} is not bound to its ZeRO "
            "partitions (see configure)"
        )
    return inner, b


def _binding(engine: Any) -> _Binding:
    gefen, b = _stepped(engine)
    if b is None:
        raise ValueError("this Gefen optimizer is not under ZeRO: it steps whole parameters")
    return b


def _unsharded_meta(engine: Any) -> dict[str, Any]:
    """Every data-parallel rank keeps the whole state; the world size says over how many."""
    if not dist.is_initialized():
        return {"wrapper": "ZeRO-0", "rank": 0, "world_size": 1}
    group = engine.seq_data_parallel_group if isinstance(engine, DeepSpeedEngine) else None
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    return {"wrapper": "ZeRO-0", "rank": rank, "world_size": world}


def memory_report(engine: Any) -> dict[str, Any]:
    """``Gefen.memory_report()`` of this rank's partitions, with the wrapper, rank and world size.

    ``adamw_bytes`` is what AdamW keeps for the same partitions under the same ZeRO stage; under
    ZeRO-0 (``wrapper`` "ZeRO-0") every rank holds the whole model's state."""
    gefen, b = _stepped(engine)
    if b is None:
        return {**gefen.memory_report(), **_unsharded_meta(engine)}
    return {**b.with_all_params(b.gefen.memory_report), **b._meta()}


def block_sizes(engine: Any) -> dict[str, int]:
    """Block size chosen for each original tensor with a piece on this rank, by parameter name."""
    gefen, b = _stepped(engine)
    if b is not None:
        return b.block_sizes()
    module = engine.module if isinstance(engine, DeepSpeedEngine) else None
    names = {id(p): n for n, p in module.named_parameters()} if module is not None else {}
    return {
        names.get(id(p)) or gefen._name(p): int(st["layout"][0, 3])
        for p, st in gefen.state.items()
        if st
    }


# -- optimizer from a config ---------------------------------------------------------------
def _config_keys() -> list[str]:
    sig = inspect.signature(Gefen.__init__)
    return [n for n in sig.parameters if n not in ("self", "params")]


_NUMBERS = ("lr", "eps", "weight_decay")
_FLAGS = ("amsgrad", "maximize", "capturable", "differentiable", "foreach", "fused")
_AUTO_FILLED_BY = {
    "lr": "Accelerate (from DummyOptim) and the Hugging Face Trainer",
    "weight_decay": "Accelerate (from DummyOptim) and the Hugging Face Trainer",
    "betas": "the Hugging Face Trainer",
    "eps": "the Hugging Face Trainer",
}


def _is_number(v: Any) -> bool:
    return isinstance(v, torch.Tensor) or is_real(v)


def _check_types(kwargs: dict[str, Any]) -> None:
    """Name the key of a value of the wrong JSON type: Gefen would fail on it with no word of
    the config (or, for a truthy string such as "auto" in a flag, not fail at all)."""
    for key, v in kwargs.items():
        if key in _NUMBERS:
            ok, want = _is_number(v), "a number"
        elif key == "betas":
            pair = isinstance(v, (list, tuple)) and len(v) == 2
            ok, want = pair and all(_is_number(b) for b in v), "a pair of numbers [beta1, beta2]"
        elif key == "bits":
            ok, want = isinstance(v, int) and not isinstance(v, bool), "the integer 4 or 8"
        elif key in _FLAGS:
            ok = isinstance(v, bool) or (v is None and key in ("foreach", "fused"))
            want = "true or false"
        else:
            continue
        if ok:
            continue
        msg = f"DeepSpeed config optimizer {{'type': 'Gefen'}}: {key!r} must be {want}, got {v!r}"
        values = v if isinstance(v, (list, tuple)) else [v]
        if any(isinstance(x, str) and x == "auto" for x in values):
            who = _AUTO_FILLED_BY.get(key)
            msg += (
                f' ("auto" is filled in by {who}; the plain deepspeed launcher and '
                "deepspeed.initialize take the value as written)"
                if who
                else f' (no launcher fills in "auto" for {key!r})'
            )
        raise ValueError(msg)


def from_config(params: Any, config_params: dict[str, Any] | None) -> Gefen:
    """Build Gefen from a DeepSpeed config's ``optimizer.params`` (lists become tuples: JSON has
    no tuples and ``betas`` is one). Unknown keys, and values of the wrong JSON type (an "auto"
    no launcher resolved, ``null``), raise ValueError naming the key."""
    kwargs = dict(config_params or {})
    valid = _config_keys()
    unknown = sorted(k for k in kwargs if k not in valid)
    if unknown:
        raise ValueError(
            f"DeepSpeed config optimizer {{'type': 'Gefen'}}: unknown params {unknown}; Gefen "
            f"takes {valid} (AdamW's arguments plus bits); gradient clipping is DeepSpeed's "
            "top-level 'gradient_clipping'"
        )
    _check_types(kwargs)
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in kwargs.items()}
    return Gefen(params, **kwargs)


# -- resuming at another data-parallel degree or ZeRO stage ---------------------------------
_ZERO3_MODEL = "zero_pp_rank_0_mp_rank_{mp:02d}_model_states.pt"
_MODEL = "mp_rank_{mp:02d}_model_states.pt"
_ZERO_FILE = "{prefix}zero_pp_rank_{rank}_mp_rank_{mp:02d}_optim_states.pt"
_ENGINE_KEYS = ["module", "skipped_steps", "global_steps", "dp_world_size", "mp_world_size"]
_ENGINE_KEYS += ["data_sampler", "random_ltd", "lr_scheduler", "optimizer"]
"""Model-file entries DeepSpeed's own load keeps to itself (the rest is the client state)."""


def _read(path: str, what: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"the checkpoint lacks {what}: {path} does not exist")
    try:
        # DeepSpeed's checkpoints hold its own objects (loss scaler, config), not only tensors
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:
        msg = f"{path} ({what}) is not a readable checkpoint file ({type(e).__name__}: {e})"
        raise ValueError(msg) from None


@dataclass
class _SavedRank:
    """One saved rank's zero file: its Gefen state dict and fp32 master partitions."""

    path: str
    wrapper_sd: dict[str, Any]
    gefen_sd: dict[str, Any]
    meta: dict[str, Any]
    masters: list[torch.Tensor]


def _saved_rank(path: str, rank: int, world: int) -> _SavedRank:
    sd = _read(path, f"the ZeRO state of data-parallel rank {rank} of {world}")
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
    return _SavedRank(path, wrapper_sd, gefen_sd, meta, list(wrapper_sd[flat_key]))


def _segments(entry: dict[str, Any]) -> list[Segment]:
    """A saved flat's segments, each named by its tensor ("" for padding)."""
    return [Segment(o, n, s, tuple(sh), label) for o, n, s, sh, label in entry["segments"]]


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
            (e.get("group", e["buffer"]), e["buffer"], rank, s.offset, s.name)
            for rank, r in enumerate(self.ranks)
            for e in r.meta["flats"]
            for s in _segments(e)
            if s.name and s.start == 0
        )
        for group, *_, name in firsts:
            if group >= len(out):
                raise ValueError(
                    f"{self.model_path}: {name} is recorded in param group {group} of "
                    f"{len(out)} (saved before the groups were recorded): resume it with "
                    "engine.load_checkpoint instead"
                )
            out[group].append(name)
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


class _Recut:
    """A checkpoint saved at another degree or ZeRO stage, read and checked whole, then put into
    this engine's partitions (module docstring)."""

    def __init__(self, engine: DeepSpeedEngine, b: _Binding, saved: SavedZero) -> None:
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
                b._republish(j)
        else:
            b.wrapper.update_lp_params()

    def _install_gefen(self) -> None:
        _install_tensors(self.b, self.tensors, self.ranks[0].gefen_sd["param_groups"])

    def _load_buffers(self) -> None:
        module = self.engine.module
        names = {n for n, _ in module.named_buffers()}
        saved = self.model_sd.get("module") or {}
        buffers = {k: v for k, v in saved.items() if k in names}
        if buffers:
            module.load_state_dict(buffers, strict=False)


def _install_tensors(
    b: _Binding, tensors: dict[str, portable.TensorState], saved_groups: list[dict[str, Any]]
) -> None:
    """Cut every partition's Gefen state from whole-tensor states and load it, with the saved
    param groups' hyperparameters."""
    opt = b.gefen

    def cut(f: _Flat) -> dict[str, torch.Tensor]:
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
        order = [b._index[id(p)] for g in opt.param_groups for p in g["params"]]
        state = {k: cut(b.flats[i]) for k, i in enumerate(order)}
        groups, k = [], 0
        for g, saved in zip(opt.param_groups, saved_groups, strict=True):
            n = len(g["params"])
            groups.append({**saved, "params": list(range(k, k + n))})
            k += n
        opt.load_state_dict({"state": state, "param_groups": groups, META_KEY: b._meta()})

    if b.kind == "ZeRO-3":
        b.wrapper._set_fp32_optimizer_param_groups()
        try:
            load()
        finally:
            b.wrapper._clear_fp32_optimizer_param_groups()
    else:
        load()


def _group_names(b: _Binding) -> list[list[str]]:
    """The trainable parameters' names of each of the client optimizer's param groups, in the
    order the client listed them: what a single-process state dict's indices count."""
    w = b.wrapper
    names = _names(w)
    if b.kind == "ZeRO-3":
        groups = [g["params"] for g in w.trainable_param_groups]
    elif b.kind == "BF16_Optimizer":
        groups = w.bf16_groups
    else:
        groups = w.bit16_groups
    return [[names.get(id(p), "") for p in ps] for ps in groups]


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
    gefen, b = _stepped(engine)
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
        seg = Segment(0, _numel(shape), 0, shape, name)
        try:
            check_loaded(st, [seg], bits_of(st["codebook"]), name)
            parts += portable.export(st, [seg])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(
                f"load_optimizer_state: {name} ({shape}) does not fit its state: {e}"
            ) from None
    saved_groups = [{k: v for k, v in g.items() if k != "param_names"} for g in groups]
    if engine._optimizer_has_ckpt_event_prologue():
        engine.optimizer.checkpoint_event_prologue()
    _install_tensors(b, portable.merge(parts), saved_groups)
    if engine._optimizer_has_ckpt_event_epilogue():
        engine.optimizer.checkpoint_event_epilogue()


def _recut_for(engine: DeepSpeedEngine, load_dir: str, tag: Any) -> _Recut | None:
    """The re-cut a load of ``load_dir`` needs, or None where DeepSpeed's own load fits (the
    same degree and ZeRO-3-ness, no Gefen under ZeRO here, a pipeline, no such tag)."""
    wrapper = engine.optimizer
    gefen = getattr(wrapper, "optimizer", None)
    b = _BINDINGS.get(gefen) if isinstance(gefen, Gefen) else None
    if b is None or isinstance(engine.module, PipelineModule):
        return None
    if tag is None:
        latest = os.path.join(load_dir, "latest")
        if not os.path.isfile(latest):
            return None  # DeepSpeed's own load warns and returns (None, None)
        with open(latest) as fd:
            tag = fd.read().strip()
    tag_dir = os.path.join(load_dir, str(tag))
    mp = engine.checkpoint_mp_rank
    zero3_path = os.path.join(tag_dir, _ZERO3_MODEL.format(mp=mp))
    path = zero3_path if os.path.isfile(zero3_path) else os.path.join(tag_dir, _MODEL.format(mp=mp))
    if not os.path.isfile(path):
        return None  # DeepSpeed's own load names what it looked for
    model_sd = _read(path, "the model states")
    saved_world = int(model_sd["dp_world_size"])
    if (saved_world, path == zero3_path) == (b.world_size, b.kind == "ZeRO-3"):
        return None
    if b.kind == "BF16_Optimizer":
        raise ValueError(
            f"Gefen under DeepSpeed: {tag_dir} was saved at another data-parallel degree "
            f"({saved_world}) or ZeRO stage; re-cutting it is not supported under "
            "BF16_Optimizer (bf16 with fp32 gradient accumulation under ZeRO-1): resume at "
            "its own layout"
        )
    return _Recut(engine, b, SavedZero(path, model_sd, mp))


def read_checkpoint(load_dir: str, tag: str | None = None, mp_rank: int = 0) -> SavedZero:
    """A ZeRO-1/2/3 checkpoint of Gefen (``engine.save_checkpoint(load_dir)``) read whole in
    this process, for conversion (``python -m gefen_dist.checkpoint consolidate``)."""
    if tag is None:
        latest = os.path.join(load_dir, "latest")
        if not os.path.isfile(latest):
            raise FileNotFoundError(f"{load_dir} has no 'latest' file: name the tag")
        with open(latest) as fd:
            tag = fd.read().strip()
    tag_dir = os.path.join(load_dir, str(tag))
    path = os.path.join(tag_dir, _ZERO3_MODEL.format(mp=mp_rank))
    if not os.path.isfile(path):
        path = os.path.join(tag_dir, _MODEL.format(mp=mp_rank))
    return SavedZero(path, _read(path, "the model states"), mp_rank)


def _recut_on_load() -> None:
    original = DeepSpeedEngine.load_checkpoint
    if getattr(original, "_gefen", False):
        return

    @functools.wraps(original)
    def load_checkpoint(
        self: DeepSpeedEngine,
        load_dir: str,
        tag: Any = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Callable | None = None,
    ) -> Any:
        recut = None
        whole = load_optimizer_states and not load_module_only and custom_load_fn is None
        if whole and not self.load_universal_checkpoint():
            recut = _recut_for(self, load_dir, tag)
        if recut is None:
            return original(
                self,
                load_dir,
                tag,
                load_module_strict=load_module_strict,
                load_optimizer_states=load_optimizer_states,
                load_lr_scheduler_states=load_lr_scheduler_states,
                load_module_only=load_module_only,
                custom_load_fn=custom_load_fn,
            )
        if self._optimizer_has_ckpt_event_prologue():
            self.optimizer.checkpoint_event_prologue()
        out = recut.apply(load_lr_scheduler_states)
        if self._optimizer_has_ckpt_event_epilogue():
            self.optimizer.checkpoint_event_epilogue()
        return out

    load_checkpoint._gefen = True  # type: ignore[attr-defined]
    DeepSpeedEngine.load_checkpoint = load_checkpoint


# -- installation ----------------------------------------------------------------------------
def _install_config_type() -> None:
    if OPTIMIZER_TYPE not in ds_config.DEEPSPEED_OPTIMIZERS:
        ds_config.DEEPSPEED_OPTIMIZERS.append(OPTIMIZER_TYPE)
    original = DeepSpeedEngine._configure_basic_optimizer
    if getattr(original, "_gefen", False):
        return

    @functools.wraps(original)
    def _configure_basic_optimizer(self: DeepSpeedEngine, model_parameters: Any) -> Any:
        if str(self.optimizer_name()).lower() == OPTIMIZER_TYPE:
            return from_config(model_parameters, self.optimizer_params())
        return original(self, model_parameters)

    _configure_basic_optimizer._gefen = True  # type: ignore[attr-defined]
    DeepSpeedEngine._configure_basic_optimizer = _configure_basic_optimizer


def _install() -> None:
    if Gefen not in zero_utils.ZERO_SUPPORTED_OPTIMIZERS:
        zero_utils.ZERO_SUPPORTED_OPTIMIZERS.append(Gefen)
    _install_config_type()
    _refuse_on_configure()
    _recut_on_load()
    for name in (
        "_configure_zero_optimizer",
        "_configure_bf16_optimizer",
        "_configure_fp16_optimizer",
    ):
        _bind_on_return(name)


def _bind_on_return(name: str) -> None:
    """Bind Gefen where DeepSpeed builds the wrapper around it, not after
    ``_configure_optimizer`` returns: Gefen's constructor imports this module when deepspeed is
    loaded, so a Gefen built by a callable (``deepspeed.initialize(optimizer=lambda ps:
    Gefen(ps))``) with gefen_dist imported first installs it from inside that very call, whose
    own patch would come too late; the builders are looked up after. Without ZeRO (fp32) there is
    no wrapper and nothing to bind."""
    original = getattr(DeepSpeedEngine, name)
    if getattr(original, "_gefen", False):
        return

    @functools.wraps(original)
    def build(self: DeepSpeedEngine, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        wrapper = original(self, optimizer, *args, **kwargs)
        if isinstance(optimizer, Gefen):
            _bind(self, wrapper)
        return wrapper

    build._gefen = True  # type: ignore[attr-defined]
    setattr(DeepSpeedEngine, name, build)


def _refuse_on_configure() -> None:
    """Without ZeRO (fp32) Gefen is no wrapper's inner optimizer and ``_bind`` never runs; the
    checks that need no partitions run once the engine's optimizer is in place."""
    original = DeepSpeedEngine._configure_optimizer
    if getattr(original, "_gefen", False):
        return

    @functools.wraps(original)
    def _configure_optimizer(self: DeepSpeedEngine, *args: Any, **kwargs: Any) -> Any:
        client = args[0] if args else kwargs.get("client_optimizer")
        config = self._config
        forced = None
        if isinstance(client, Gefen) and self.zero_use_cpu_optimizer():
            # ZeRO-Offload refuses client optimizers (zero_force_ds_cpu_optimizer) because a
            # torch optimizer steps the host partitions slowly; Gefen steps them with its C++
            # host kernel, as a config-built Gefen (never checked) does.
            forced = config.zero_force_ds_cpu_optimizer
            config.zero_force_ds_cpu_optimizer = False
        try:
            out = original(self, *args, **kwargs)
        finally:
            if forced is not None:
                config.zero_force_ds_cpu_optimizer = forced
        if isinstance(self.optimizer, Gefen):
            _refuse_tied_stages(self)
        return out

    _configure_optimizer._gefen = True  # type: ignore[attr-defined]
    DeepSpeedEngine._configure_optimizer = _configure_optimizer


_install()
