"""What ties one Gefen optimizer to one ZeRO wrapper: its partitions' segments, the held first
step, and the checkpoint entry that records them.

The first step is held back because ZeRO steps the inner optimizer one param group (stage 3: one
sub-group) at a time, while Gefen learns its codebook from the first gradient of the whole
model: a codebook learned from the first group alone would differ from the single-process one
(or, for a group of biases and norms that all keep B = 1, be learned from nothing). So on the
first step the earlier groups' calls are held back (their gradients kept, a transient of one
fp32 gradient partition) and the last call initialises and updates all groups at once, then
republishes the earlier groups' weights to the low-precision copies ZeRO has already refreshed
from them. After the first step every call passes straight through.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from deepspeed.runtime.engine import DeepSpeedEngine

from ...method.segments import encode
from ...method.state import layout_rows
from ...optimizer import Gefen
from .layouts import Flat, Layout, layout_of
from .meta import META_KEY, placement
from .support import refuse_unsupported

__all__ = ["BINDINGS", "Binding", "bind", "binding_of", "configure", "stepped"]

"""Columns of a Gefen state's ``layout`` (``method.state``): buffer offset, block size."""


class _Groups(NamedTuple):
    """Gefen's param groups as the wrapper set them, put aside while every partition is in."""

    groups: list[dict[str, Any]]
    params: list[list[torch.Tensor]]


class Binding:
    """One Gefen optimizer bound to one ZeRO wrapper's partitions on this rank."""

    def __init__(self, gefen: Gefen, wrapper: Any, layout: Layout) -> None:
        self.gefen = gefen
        self.wrapper = wrapper
        self.kind = layout.kind
        self.flats: list[Flat] = layout.flats
        self.group: dist.ProcessGroup | None = layout.group
        self.rank = dist.get_rank(self.group) if self.group is not None else 0
        self.world_size = dist.get_world_size(self.group) if self.group is not None else 1
        self.republish = layout.republish
        self.index = {id(f.tensor): i for i, f in enumerate(self.flats)}
        """Partition index by ``id`` of its flat tensor."""
        self._group_dicts = list(gefen.param_groups)
        self._held: dict[int, torch.Tensor] = {}
        self._found: dict[int, torch.Tensor | None] = {}
        self._hidden: list[int] = []
        self._restore: _Groups | None = None
        self._ready = False
        for f in self.flats:
            gefen.set_segments(f.tensor, f.segments, self.group)
        gefen.register_step_pre_hook(self._pre_step)
        gefen.register_step_post_hook(self._post_step)
        gefen.register_state_dict_post_hook(self._add_meta)
        gefen.register_load_state_dict_pre_hook(self._check_meta, prepend=True)
        gefen.register_load_state_dict_post_hook(self._loaded)

    # -- every partition in Gefen's param groups ------------------------------------------------
    def _all_in(self, opt: Gefen) -> _Groups:
        """Put every partition into its param group (ZeRO lists only those it steps now, and
        ZeRO-3 none between steps); return what to put back."""
        saved = _Groups(opt.param_groups, [g["params"] for g in self._group_dicts])
        for gi, g in enumerate(self._group_dicts):
            g["params"] = [f.tensor for f in self.flats if f.group == gi]
        opt.param_groups = list(self._group_dicts)
        return saved

    def _put_back(self, opt: Gefen, saved: _Groups) -> None:
        opt.param_groups = saved.groups
        for g, ps in zip(self._group_dicts, saved.params, strict=True):
            g["params"] = ps

    # -- first step: hold earlier groups until every partition has its first gradient -----------
    def _pre_step(self, opt: Gefen, args: Any, kwargs: Any) -> None:
        if self._ready:
            return
        todo = {i for i, f in enumerate(self.flats) if not opt.state.get(f.tensor)}
        if not todo:
            self._ready = True
            return
        now = [
            self.index[id(p)]
            for g in opt.param_groups
            for p in g["params"]
            if p.grad is not None and id(p) in self.index
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
        self._restore = self._all_in(opt)

    def _post_step(self, opt: Gefen, args: Any, kwargs: Any) -> None:
        """Leave every gradient as the wrapper handed it over, and the param groups as it set
        them; after the joint first update, refresh the earlier groups' low-precision copies."""
        for i in self._hidden:
            self.flats[i].tensor.grad = self._held[i]
        self._hidden = []
        if self._restore is None:
            return
        self._put_back(opt, self._restore)
        self._restore = None
        for i, g in self._found.items():
            self.flats[i].tensor.grad = g
        for i in sorted(self._held):
            self.republish(i)
        self._held, self._found = {}, {}
        self._ready = True

    # -- checkpoints --------------------------------------------------------------------------
    def meta(self) -> dict[str, Any]:
        return placement(self.kind, self.rank, self.world_size)

    def _add_meta(self, opt: Gefen, state_dict: dict[str, Any]) -> dict[str, Any]:
        """The rank's segments, by tensor name, in state-dict order: what a resume at another
        layout needs to take this rank's state and master weights apart (``recut.Recut``)."""
        flats = []
        for p in (p for g in opt.param_groups for p in g["params"]):
            i = self.index.get(id(p))
            if i is None:
                continue
            f = self.flats[i]
            segs = encode(f.segments, f.labels)
            flats.append({"buffer": i, "group": f.group, "segments": segs})
        return {**state_dict, META_KEY: {**self.meta(), "flats": flats}}

    def _check_meta(self, opt: Gefen, state_dict: dict[str, Any]) -> dict[str, Any]:
        """ZeRO-1, ZeRO-2 and BF16_Optimizer lay partitions out alike, so a state may move
        between them (Gefen's own check then compares the segments); ZeRO-3 partitions every
        tensor, so its states fit nothing else; and no state fits another rank's partition."""
        saved = state_dict.get(META_KEY)
        here = self.meta()
        if saved is None:
            raise ValueError(
                f"this Gefen state dict was not saved under DeepSpeed (no {META_KEY!r} entry), "
                f"so it cannot fit the partitions of {here['wrapper']} rank {here['rank']} of "
                f"{here['world_size']}; load it into a plain Gefen, or resume from a DeepSpeed "
                "checkpoint"
            )

        def fits(m: dict[str, Any]) -> tuple[bool, int, int]:
            return (m["wrapper"] == "ZeRO-3", m["rank"], m["world_size"])

        if fits(saved) != fits(here):
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
        saved = self._all_in(opt)
        try:
            return fn()
        finally:
            self._put_back(opt, saved)

    def block_sizes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for f in self.flats:
            st = self.gefen.state.get(f.tensor)
            if not st:
                continue
            by_offset = {r.offset: r.block for r in layout_rows(st)}
            for seg, label in zip(f.segments, f.labels, strict=True):
                if label:
                    out[label] = by_offset[seg.offset]
        return out


BINDINGS: weakref.WeakKeyDictionary[Gefen, Binding] = weakref.WeakKeyDictionary()
"""The binding of every Gefen optimizer under a ZeRO wrapper in this process."""


def bind(engine: DeepSpeedEngine | None, wrapper: Any) -> None:
    """Bind the Gefen inside ``wrapper`` to its partitions, once; refuse what is unsupported."""
    if isinstance(wrapper, Gefen):
        return  # no ZeRO: Gefen is handed the model's own parameters
    gefen = getattr(wrapper, "optimizer", None)
    if not isinstance(gefen, Gefen):
        raise ValueError(f"no Gefen optimizer inside {type(wrapper).__name__}")
    bound = BINDINGS.get(gefen)
    if bound is not None:
        if bound.wrapper is not wrapper:
            raise ValueError("this Gefen optimizer is already bound to another DeepSpeed engine")
        return
    refuse_unsupported(engine, wrapper)
    BINDINGS[gefen] = Binding(gefen, wrapper, layout_of(wrapper))


def configure(target: Any) -> None:
    """Bind the Gefen optimizer inside a DeepSpeed engine (or ZeRO wrapper) to its partitions.

    Called automatically for engines built once the integration is installed
    (``gefen_dist.register()``, or a Gefen built with deepspeed imported); calling it again is
    a no-op. Raises ValueError naming the problem for configurations Gefen does not support."""
    engine = target if isinstance(target, DeepSpeedEngine) else None
    bind(engine, engine.optimizer if engine is not None else target)


class Stepped(NamedTuple):
    """The Gefen optimizer an engine steps, and its binding (None without a ZeRO wrapper)."""

    gefen: Gefen
    binding: Binding | None


def stepped(engine: Any) -> Stepped:
    """The Gefen optimizer an engine (or ZeRO wrapper) steps, and its binding; no binding under
    ZeRO-0 in fp32, where DeepSpeed steps Gefen itself on the model's own parameters."""
    wrapper = engine.optimizer if isinstance(engine, DeepSpeedEngine) else engine
    if isinstance(wrapper, Gefen):
        return Stepped(wrapper, None)
    inner = getattr(wrapper, "optimizer", None)
    if not isinstance(inner, Gefen):
        what = "no optimizer" if wrapper is None else type(wrapper).__name__
        raise ValueError(f"this engine steps {what}, not a Gefen optimizer")
    b = BINDINGS.get(inner)
    if b is None:
        raise ValueError(
            f"the Gefen optimizer inside {type(wrapper).__name__} is not bound to its ZeRO "
            "partitions (see configure)"
        )
    return Stepped(inner, b)


def binding_of(engine: Any) -> Binding:
    b = stepped(engine).binding
    if b is None:
        raise ValueError("this Gefen optimizer is not under ZeRO: it steps whole parameters")
    return b
