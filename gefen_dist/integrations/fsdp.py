"""Gefen under FSDP: what each rank's buffers hold, and checkpoints through FSDP's own paths.

Nothing to call::

    model = FSDP(model, ...)            # or fully_shard(...) (FSDP2)
    opt = Gefen(model.parameters(), lr=...)

Gefen configures itself through the optimizer's hooks (``register.py``): on DTensor (FSDP2)
parameters, and on FSDP1's flat parameters or pieces of original ones, whose units it finds
among the live objects (``configure_found``), also where the model is wrapped after Gefen was
built on it, or the parameters swapped in (the HF Trainer, Accelerate): at the first step or
load. ``configure(model, opt)`` is what it calls, and a later call changes nothing.

Training. FSDP1 with ``use_orig_params=False`` hands the optimizer one flat shard per FSDP unit:
pieces of several original tensors, each rank a different cut. ``configure`` reads FSDP's flat
parameter metadata and declares, per shard, which tensor's elements lie where (named by the
tensor's FQN, the same on every rank) and that the pieces are spread over the unit's process
group; alignment and shard padding become unnamed segments of their own. With
``use_orig_params=True`` the optimizer sees the original parameters, each holding this rank's
1-D piece (possibly empty): each gets one segment with the tensor's real shape and the piece's
start. The optimizer then chooses the single-process block sizes and codebook on every rank.
FSDP2 (DTensor parameters) needs nothing for training; the core reads DTensor layouts itself.
Hybrid sharding (FSDP2 on a (replicate, shard) mesh, FSDP1 ``HYBRID_SHARD`` and
``_HYBRID_SHARD_ZERO2``) spreads each tensor over the shard group only (FSDP1's
``unit.process_group``, the mesh's Shard dimension); the replica groups see the same averaged
gradient and each keeps its own, identical, copy of the state.

Checkpoints. Gefen's state is not shaped like the parameter (packed codes, one scale and one v
per block, bf16 moments only where B = 1) and it differs per rank. Both frameworks assume the
opposite: FSDP1 treats every positive-dim state tensor as flat-shard shaped and all-gathers and
unflattens it, and ``torch.distributed.checkpoint`` (DCP) treats a plain tensor that appears under
the same key on every rank as replicated and keeps one rank's copy. ``configure`` therefore
installs optimizer state-dict hooks. A DTensor parameter (FSDP2, HSDP, tensor and expert
parallelism) is written in its global coordinates, which DCP reshards (``integrations.dcp``).
An FSDP1 piece has its Gefen tensors replaced by one ``bytes`` value keyed by the owning rank,
``"gefen.rank{r}"``, next to the usual 0-dim ``"step"`` (checkpoints that earlier versions
wrote for DTensor parameters in this format, with the codebook beside it, still load):

- FSDP1 passes non-tensor state through (``use_orig_params=False``) or all-gathers and merges it
  by name (``use_orig_params=True``), and DCP writes each key once, so no rank's state is lost
  or taken for another's. FSDP1 copies a flat parameter's non-tensor state from the saving rank
  only, so for a FULL_STATE_DICT with ``use_orig_params=False`` the hook gathers every rank's
  entry itself; FSDP1 also copies it to each original parameter of the unit, which torch.save
  stores once but DCP once per parameter (prefer ``use_orig_params=True`` or FSDP2 with DCP).
  torch.save's default pickle protocol writes ``bytes`` as latin-1 text, ~1.4x their size.
- ``bytes`` rather than tensors because DCP loads into a template that it builds on a fresh
  optimizer with a zero-gradient step: tensor sizes would follow that step's partition (all
  B = 1), not the saved one, while a ``bytes`` value is replaced whole.
- Every rank writes an entry for every sharded parameter, empty where it keeps no state, and
  each entry carries an id of the run and its step, also stored once per parameter: an entry
  that did not come from the checkpoint being loaded (a loader that kept the rank's own value)
  is refused.
- Under hybrid sharding the rank in an entry's key is the rank in the shard group, so every
  replica group writes the same keys with the same contents, and DCP keeps one copy of each,
  not necessarily all from one replica: the run id is therefore agreed over the replicate
  group too (``_run_id``), and a rank may load its replica's entry.
- At the same world size and FSDP wrapping each rank loads its own entry: bit for bit. Where
  an entry was saved by another world size, the rank cuts its pieces from every saving rank's
  entries (``rank_entries.recut``, ``method.portable``: a block cut by a shard boundary keeps
  one scale and one v per piece, which are merged or split, within the measured drift of
  ``tests/test_fsdp_elastic.py``), so all of them must be there: FSDP1's full state dicts carry
  them (the hook gathers a flat parameter's), as does a sharded DCP checkpoint read whole
  (``gefen_dist.checkpoint.read_dcp``); a sharded one loaded as it is lacks the others' entries
  and is refused naming the missing ranks (DCP, asked for a rank the checkpoint lacks, refuses
  first: "Missing key ... gefen.rank{r}"). FSDP1's ``rank0_only`` *load* (Accelerate's
  FULL_STATE_DICT load) broadcasts rank 0's dict and then calls ``.cpu()`` on each of its
  values: the entries are therefore ``Entry`` (``bytes`` with a ``cpu()``) and the run id a
  ``Text``, both safe globals for ``torch.load(weights_only=True)``.
- A full state dict through DCP's functions (``get_optimizer_state_dict(full_state_dict=True)``)
  holds, for each DTensor parameter, the whole tensor's single-process state, gathered from
  every rank's piece (DCP gathers DTensors only, and Gefen's state is none); it loads at any
  world size (``set_optimizer_state_dict(full_state_dict=True)``, also with
  ``broadcast_from_rank0``), where ``portable.fit`` cuts each rank's piece, and into one process.
  The post-hook learns DCP's options from its calling frames (``_dcp_request``).

With a sharded model, ``optimizer.state_dict()`` may be a collective (FULL_STATE_DICT with
``use_orig_params=False``): call it on every rank, as FSDP's own state-dict functions are.
"""

from __future__ import annotations

import gc
import inspect
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy, StateDictType
from torch.distributed.fsdp._common_utils import _get_param_to_fqns
from torch.distributed.fsdp._flat_param import FlatParameter

from ..distributed import sharding
from ..method import portable
from ..method.segments import Segment, whole_tensor
from ..optimizer import Gefen
from . import dcp as dcp_fields
from .rank_entries import (
    RANK_KEY,
    RUN_KEY,
    decode_own,
    encode_entry,
    merge_entries,
    read_entry,
    recut,
    saved_by,
)

__all__ = ["configure", "configure_found"]
_HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)
_SHARDED = (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, *_HYBRID)
_SUPPORTED = (*_SHARDED, ShardingStrategy.NO_SHARD)


class Entry(bytes):
    """A rank's entry as it is written: ``bytes`` with a ``cpu()`` that returns them, since
    FSDP1's ``rank0_only`` load (``optim_state_dict_to_load``) calls ``.cpu()`` on every state
    value of rank 0's dict after sharding it. Loadable with ``weights_only=True`` once
    ``gefen_dist`` is imported (a safe global); plain ``bytes`` entries read the same."""

    def cpu(self) -> Entry:
        return self


class Text(str):
    """The run id beside the entries, with ``cpu()`` for the same reason (``Entry``)."""

    def cpu(self) -> Text:
        return self


torch.serialization.add_safe_globals([Entry, Text])


@dataclass
class _Integration:
    model: nn.Module | None
    sharded: dict[torch.Tensor, dist.ProcessGroup] = field(default_factory=dict)
    orig_pieces: set[torch.Tensor] = field(default_factory=set)
    flat_models: list[nn.Module] = field(default_factory=list)
    names: dict[torch.Tensor, str] = field(default_factory=dict)
    replicas: dist.ProcessGroup | None = None  # HSDP: the ranks holding copies of our pieces
    run: str = ""
    found: bool = False  # configured by Gefen itself (``configure_found``), not by a user call


def configure(model: nn.Module | None, optimizer: Gefen) -> None:
    """Tell ``optimizer`` how FSDP laid out ``model``'s parameters, and make its state dicts
    travel through FSDP's and DCP's checkpoint functions (module docstring).

    Call once, after wrapping the model and building the optimizer, before the first step.
    ``optimizer`` may be a wrapper that holds Gefen as ``.optimizer`` (Accelerate's
    ``AcceleratedOptimizer`` after ``accelerator.prepare``).
    Gefen calls ``configure(None, optimizer)`` itself when it is built on FSDP2 (DTensor)
    parameters, so FSDP2 users need not; calling it again with the model then only adds the
    parameters' FQNs to error messages. For FSDP1 it calls ``configure_found``, after which
    this call changes nothing (and refuses a model that does not hold the parameters).
    """
    wrapped = optimizer
    while not isinstance(optimizer, Gefen) and isinstance(
        getattr(optimizer, "optimizer", None), torch.optim.Optimizer
    ):
        optimizer = optimizer.optimizer  # Accelerate's AcceleratedOptimizer, and the like
    if not isinstance(optimizer, Gefen):
        raise TypeError(f"configure expects a gefen_dist.Gefen optimizer, got {type(wrapped)}")
    done = optimizer.attached("fsdp")
    if done is not None and done.model is None and model is not None:
        fqn_of = {p: n for n, p in model.named_parameters()} if model is not None else {}
        done.model = model
        done.names.update({p: f"parameter {fqn_of[p]!r}" for p in done.sharded if p in fqn_of})
        return
    if done is not None and done.found:
        _check_holds(model, optimizer)
        return  # Gefen found its model's FSDP units itself: the call changes nothing
    if done is not None:
        raise RuntimeError("configure(model, optimizer) was already called for this optimizer")
    if any(optimizer.state.get(p) for g in optimizer.param_groups for p in g["params"]):
        raise RuntimeError(
            "configure(model, optimizer) must come before the optimizer's first step: "
            "Gefen chooses its blocks at the first step from the layout configure declares"
        )
    integ = _Integration(model)
    in_optimizer = {p for g in optimizer.param_groups for p in g["params"]}
    param_to_fqns = _get_param_to_fqns(model) if model is not None else {}
    mapped: set[torch.Tensor] = set()
    for unit in FSDP.fsdp_modules(model) if model is not None else []:
        handle = unit._handle
        if handle is None:
            continue
        if unit.sharding_strategy not in _SUPPORTED:
            raise NotImplementedError(
                f"FSDP unit {_unit_name(handle.flat_param)} uses {unit.sharding_strategy}; "
                "gefen_dist.integrations.fsdp supports FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD, "
                "_HYBRID_SHARD_ZERO2 and NO_SHARD"
            )
        fp = handle.flat_param
        # under hybrid sharding, process_group is the intra-node shard group
        group = unit.process_group
        if unit.sharding_strategy in _HYBRID:
            integ.replicas = unit._inter_node_pg
        # NO_SHARD (FSDP's choice on one rank) keeps whole tensors on every rank: nothing to
        # merge over ranks, but the flat layout and FSDP1's handling of state are the same.
        spread = group if unit.sharding_strategy in _SHARDED else None
        if fp in in_optimizer:
            segs = _flat_segments(fp, param_to_fqns[fp])
            optimizer.set_segments(fp, segs, spread)
            integ.sharded[fp] = group
            integ.names[fp] = f"FSDP flat parameter holding {', '.join(param_to_fqns[fp])}"
            if unit not in integ.flat_models:
                integ.flat_models.append(unit)
            mapped.add(fp)
        if fp._params is None:  # use_orig_params=False
            continue
        for i, p in enumerate(fp._params):
            if p not in in_optimizer or p in mapped:
                continue
            fqn = param_to_fqns[p][0]
            optimizer.set_segments(p, [_piece_segment(fp, i, fqn)], spread)
            integ.sharded[p] = group
            integ.orig_pieces.add(p)
            integ.names[p] = f"parameter {fqn!r}"
            mapped.add(p)
    for p in in_optimizer - mapped:
        if isinstance(p, FlatParameter):
            raise ValueError(
                f"the optimizer holds the FSDP flat parameter {_unit_name(p)}, which is not "
                "part of this model's FSDP units: pass the FSDP-wrapped model the optimizer "
                "was built from"
            )
        if sharding.is_dtensor(p) and sharding.group_of(p) is not None:
            integ.sharded[p] = sharding.group_of(p)
            integ.replicas = integ.replicas or sharding.replica_group_of(p)
    if not integ.sharded:
        raise ValueError(
            "configure found no FSDP-sharded parameter in the optimizer: wrap the model with "
            "FSDP or fully_shard first and build the optimizer from the wrapped model's "
            "parameters (plain and DDP models need no configure)"
        )
    fqn_of = {p: n for n, p in model.named_parameters()} if model is not None else {}
    for p in integ.sharded:
        integ.names.setdefault(
            p, f"parameter {fqn_of[p]!r}" if p in fqn_of else optimizer.name_of(p)
        )
    # over the optimizer's group: parameters spread over parts of it (norms on the dp mesh of
    # a (dp, tp) model) write entries that other parts write too, with the same run id
    group = optimizer.process_group or next(iter(integ.sharded.values()))
    integ.run = _run_id(group, integ.replicas)
    optimizer.attach("fsdp", integ)
    dcp_fields.extend_default_planner()
    optimizer.register_state_dict_post_hook(_pack_state_dict)
    optimizer.register_load_state_dict_pre_hook(_unpack_state_dict, prepend=True)


def _check_holds(model: nn.Module | None, optimizer: Gefen) -> None:
    """A ``configure`` after Gefen configured itself changes nothing, but a model that does
    not hold the optimizer's FSDP parameters is still named: it was not the one meant."""
    integ: _Integration = optimizer.attached("fsdp")
    if model is None or model is integ.model:
        return
    ours = set()
    for unit in FSDP.fsdp_modules(model):
        if unit._handle is not None:
            fp = unit._handle.flat_param
            ours |= {id(fp), *(id(q) for q in fp._params or [])}
    for p in integ.sharded:
        if id(p) not in ours:
            what = _unit_name(p) if isinstance(p, FlatParameter) else integ.names[p]
            raise ValueError(
                f"the optimizer holds the FSDP parameter {what}, which is not part of this "
                "model's FSDP units: pass the FSDP-wrapped model the optimizer was built from"
            )


def configure_found(optimizer: Gefen) -> None:
    """``configure`` without the model, for an FSDP1 model: Gefen calls this itself (the
    ``extension.Integration.unconfigured``) when it finds FSDP1 flat parameters or pieces of
    original ones (``use_orig_params=True``) among its parameters, at construction, when a
    wrapper swaps its parameters, or at the first step or load.

    Why search: a flat parameter records its tensors' names, shapes and cuts, but not its
    process group, sharding strategy or the FQNs of the model around it (FlatParamHandle holds
    the first two and links back to nothing), and the state-dict hooks need the units (their
    state_dict_type). The FSDP units are found among the live objects (one pass of ``gc``),
    and the root that holds this optimizer's parameters configures it. A later
    ``configure(model, optimizer)`` with that model changes nothing."""
    if optimizer.attached("fsdp") is not None:
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    held = {id(p) for p in params}
    units = [o for o in gc.get_objects() if isinstance(o, FSDP)]
    nested = {id(m) for u in units for m in u.modules() if m is not u and isinstance(m, FSDP)}
    roots = []
    for root in (u for u in units if id(u) not in nested):
        for unit in FSDP.fsdp_modules(root):
            fp = unit._handle.flat_param if unit._handle is not None else None
            if fp is not None and (id(fp) in held or any(id(q) in held for q in fp._params or [])):
                roots.append(root)
                break
    if not roots:
        raise ValueError(
            f"{optimizer.name_of(params[0])} and the other parameters of this Gefen are FSDP1 "
            "parameters of no live FSDP model's units: with use_orig_params=False FSDP replaces "
            "a model's parameters by flat ones, so build Gefen from the wrapped model's "
            "parameters (or wrap with use_orig_params=True)"
        )
    if len(roots) > 1:
        raise ValueError(
            f"this Gefen holds parameters of {len(roots)} FSDP models: one optimizer per model, "
            "or call gefen_dist.integrations.fsdp.configure(model, optimizer) with their parent"
        )
    configure(roots[0], optimizer)
    optimizer.attached("fsdp").found = True


# -- what torch.distributed.checkpoint asks for ---------------------------------------------------
@dataclass(frozen=True)
class _Request:
    """What the caller of ``optimizer.state_dict()`` will do with it, where DCP's
    ``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` is that caller."""

    dcp: bool = False  # called by DCP's state_dict functions
    full: bool = False  # full_state_dict=True: DCP gathers DTensors and keeps other values
    rank0_only: bool = False  # cpu_offload too: only global rank 0 keeps the gathered dict
    load_template: bool = False  # the local template of a full-state load


def _dcp_request() -> _Request:
    """Read DCP's options off the calling frames.

    Why frames: a state-dict post-hook gets the optimizer and its dict only, while what it must
    write depends on DCP's options: a sharded save needs one bytes entry per rank (module
    docstring), a full one the whole tensor's single-process state (DCP gathers only DTensors,
    and Gefen's state is none: it would keep the saving rank's piece alone), and the template
    of a full-state load Gefen's tensors as they are (DCP replaces each with the full dict's
    value of that key; with broadcast_from_rank0, a key the template lacks is not sent to the
    other ranks at all). ``_get_optim_state_dict`` holds those options as its ``info``; a
    ``_load_optim_state_dict`` below it calls it only for a full-state load's template. Where a
    torch version renames them, nothing is found and the sharded entries are written as before.
    """
    mod = sys.modules.get("torch.distributed.checkpoint.state_dict")
    if mod is None:
        return _Request()
    get = getattr(mod, "_get_optim_state_dict", None)
    load = getattr(mod, "_load_optim_state_dict", None)
    if get is None or load is None:
        return _Request()
    get_code, load_code = inspect.unwrap(get).__code__, inspect.unwrap(load).__code__
    info, frame = None, sys._getframe(1)
    while frame is not None:
        if frame.f_code is load_code:
            return _Request(dcp=True, load_template=True)
        if frame.f_code is get_code and info is None:
            info = frame.f_locals.get("info")
        frame = frame.f_back
    if info is None:
        return _Request()
    full = bool(getattr(info, "full_state_dict", False))
    rank0 = full and bool(getattr(info, "cpu_offload", False)) and dist.is_initialized()
    return _Request(dcp=True, full=full, rank0_only=rank0)


# -- layout --------------------------------------------------------------------------------------
def _flat_segments(fp: FlatParameter, fqns: list[str]) -> list[Segment]:
    """This rank's shard of a flat parameter as segments; padding is unnamed, so it stays local."""
    numel = fp._sharded_size.numel()
    if fp.numel() != numel:
        raise RuntimeError(
            f"FSDP flat parameter for {fqns} is unsharded ({fp.numel()} elements, shard "
            f"{numel}): call configure outside forward/backward"
        )
    segs = []
    for i, info in enumerate(fp._shard_param_infos):
        if info.in_shard:
            shape = tuple(fp._shapes[i])
            segs.append(
                Segment(
                    info.offset_in_shard,
                    info.numel_in_shard,
                    info.intra_param_start_idx,
                    shape,
                    fqns[i],
                )
            )
    segs.sort(key=lambda s: s.offset)
    out, pos = [], 0
    for s in segs + [Segment(numel, 0, 0, (0,))]:
        if s.offset > pos:
            out.append(Segment(pos, s.offset - pos, 0, (s.offset - pos,)))
        if s.numel:
            out.append(s)
        pos = s.offset + s.numel
    return out


def _piece_segment(fp: FlatParameter, i: int, fqn: str) -> Segment:
    info = fp._shard_param_infos[i]
    shape = tuple(fp._shapes[i])
    if not info.in_shard:
        return Segment(0, 0, 0, shape, fqn)
    return Segment(0, info.numel_in_shard, info.intra_param_start_idx, shape, fqn)


def _run_id(group: dist.ProcessGroup, replicas: dist.ProcessGroup | None = None) -> str:
    """One id per configured optimizer, the same on every rank. Each rank's entry and the
    checkpoint-wide ``RUN_KEY`` carry it, so an entry that did not come from the checkpoint
    being loaded (a framework left this rank's own template value in place) is caught.

    Under HSDP every replica group writes the same keys and DCP keeps one copy of each, perhaps
    the entry from one replica and ``RUN_KEY`` from another: so the replicas agree on one id too.
    Each replicate group holds one rank of every replica, so the least of their ids is the same
    in every replicate group, whatever the order of the mesh."""
    box = [uuid.uuid4().hex]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    if replicas is not None and dist.get_world_size(replicas) > 1:
        every: list[Any] = [None] * dist.get_world_size(replicas)
        dist.all_gather_object(every, box[0], group=replicas)
        box[0] = min(every)
    return box[0]


def _unit_name(fp: FlatParameter) -> str:
    return f"[{', '.join(fp._fqns)}]"


# -- state dict hooks ----------------------------------------------------------------------------
def _indexed_params(opt: Gefen) -> Iterator[tuple[int, torch.Tensor]]:
    """Parameters by the index ``Optimizer.state_dict`` gives them."""
    i = 0
    for g in opt.param_groups:
        for p in g["params"]:
            yield i, p
            i += 1


def _pack_state_dict(opt: Gefen, state_dict: dict[str, Any]) -> dict[str, Any]:
    """State-dict post-hook: each sharded parameter's Gefen tensors become this rank's entry.

    Every rank writes an entry for every sharded parameter, an empty one where it keeps no
    state, so that a checkpoint's keys do not depend on which rank stepped what, and a load on
    another world size reaches the check in ``rank_entries.decode_own``, not a missing key."""
    integ: _Integration = opt.attached("fsdp")
    state = dict(state_dict["state"])
    mine: dict[int, tuple[str, bytes]] = {}
    request = _dcp_request()
    for idx, p in _indexed_params(opt):
        if p not in integ.sharded:
            continue
        st = state.get(idx) or None
        if p in integ.orig_pieces and sharding.local(p).numel() == 0:
            # FSDP never steps an empty piece, but the zero-gradient step with which DCP builds
            # a fresh optimizer's template does: the template must match the checkpoint.
            st = None
        group = integ.sharded[p]
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        key = RANK_KEY.format(rank)
        if sharding.is_dtensor(p) and request.load_template:
            continue  # Gefen's own tensors, each replaced by the full dict's (_dcp_request)
        if sharding.is_dtensor(p) and request.full:
            keep = not request.rank0_only or dist.get_rank() == 0
            whole = _gather_whole(opt, p, st, integ, keep)
            if whole is None:
                state.pop(idx, None)
            else:
                state[idx] = whole
            continue
        if dcp_fields.global_fields(p):
            state[idx] = dcp_fields.fields(p, st, opt.segments_of(p), integ.run)
            continue
        # A DTensor parameter's codebook stays a tensor: the same on every rank, so DCP's
        # de-duplication is right for it, and DCP's full-state loader needs one tensor per entry.
        outside = ("codebook",) if st is not None and sharding.is_dtensor(p) else ()
        blob = encode_entry(
            st, opt.segments_of(p), rank, world, integ.run, outside, sharding.is_copy(p)
        )
        entry: dict[str, Any] = {RUN_KEY: Text(integ.run), key: Entry(blob)}
        if st is not None:
            entry = {"step": st["step"], **{k: st[k] for k in outside}, **entry}
        state[idx] = entry
        mine[idx] = (key, Entry(blob))
    if _gather_full(integ, request):
        gathered = _all_gather_flat(integ, opt, mine)
        for idx, entries in gathered.items():
            state[idx] = {**state[idx], **entries}
    return {**state_dict, "state": state}


def _gather_full(integ: _Integration, request: _Request) -> bool:
    """FSDP1 copies a flat parameter's non-tensor state from the saving rank only; a full state
    dict must then carry every rank's entry, which only this hook can collect. Under DCP's
    functions the units' state_dict_type is set only after this hook ran: DCP's option counts."""
    if not integ.flat_models:
        return False
    if request.dcp:
        return request.full
    for unit in integ.flat_models:
        if FSDP.get_state_dict_type(unit).state_dict_type == StateDictType.FULL_STATE_DICT:
            return True
    return False


def _all_gather_flat(
    integ: _Integration, opt: Gefen, mine: dict[int, tuple[str, bytes]]
) -> dict[int, dict[str, bytes]]:
    flat = {i for i, p in _indexed_params(opt) if isinstance(p, FlatParameter)}
    local = {i: kv for i, kv in mine.items() if i in flat}
    group = integ.sharded[next(p for p in integ.sharded if isinstance(p, FlatParameter))]
    every: list[dict] = [{} for _ in range(dist.get_world_size(group))]
    dist.all_gather_object(every, local, group=group)
    out: dict[int, dict[str, bytes]] = {}
    for other in every:
        for i, (key, blob) in other.items():
            if i in local:
                out.setdefault(i, {})[key] = blob
    return out


def _gather_whole(
    opt: Gefen, p: torch.Tensor, st: dict | None, integ: _Integration, keep: bool
) -> dict[str, torch.Tensor] | None:
    """The whole tensor's single-process state, from every rank's piece (one all-gather per
    parameter, so no rank holds more than one tensor's pieces at a time): what a full state
    dict of a DTensor parameter holds, and what loads at any world size (``portable.fit``).
    None where no rank has stepped it, or on a rank that does not keep the full dict."""
    group = integ.sharded[p]
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    blob = encode_entry(st, opt.segments_of(p), rank, world, integ.run, (), sharding.is_copy(p))
    every: list[Any] = [None] * world
    dist.all_gather_object(every, blob, group=group)
    if not keep:
        return None
    name = integ.names.get(p) or opt.name_of(p)
    payloads = [read_entry(b, RANK_KEY.format(r), name) for r, b in enumerate(every)]
    tensors = merge_entries(payloads, None, name)
    if not tensors:
        return None
    (ts,) = tensors.values()
    return portable.install(tensors, whole_tensor(ts.shape, ts.name), "cpu")


def _unpack_state_dict(opt: Gefen, state_dict: dict[str, Any]) -> dict[str, Any]:
    """Load pre-hook (runs before Gefen's own): this rank's entry back into Gefen tensors."""
    integ: _Integration = opt.attached("fsdp")
    saved_state = state_dict["state"]
    state = dict(saved_state)
    saved_ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
    params = [p for g in opt.param_groups for p in g["params"]]
    for pid, p in zip(saved_ids, params, strict=False):
        st = saved_state.get(pid)
        if st is None:
            continue
        if "layout" in st:
            # a single-process state (a full state dict, a consolidated checkpoint), perhaps
            # beside the entries of the template DCP merged it into: it wins, and Gefen's own
            # pre-hook cuts this rank's piece from it (portable.fit)
            state[pid] = {k: v for k, v in st.items() if not str(k).startswith("gefen.")}
            continue
        name = integ.names.get(p) or opt.name_of(p)
        if dcp_fields.FORMAT_KEY in st:
            loaded = _from_fields(opt, p, st, name)
            if loaded is None:
                del state[pid]
            else:
                state[pid] = loaded
            continue
        ranks = sorted(k for k in st if isinstance(k, str) and k.startswith("gefen.rank"))
        if not ranks:
            continue
        if p not in integ.sharded:
            raise ValueError(
                f"the checkpoint holds per-rank Gefen state ({', '.join(ranks)}) for {name}, "
                "which is not sharded in this run: consolidate it first "
                "(gefen_dist.checkpoint.consolidate)"
            )
        group = integ.sharded[p]
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        key = RANK_KEY.format(rank)
        segs = opt.segments_of(p)
        if key in st and saved_by(st[key], key, name) == (rank, world):
            loaded = decode_own(st, key, segs, rank, world, name)
        else:
            loaded = recut(st, ranks, segs, rank, world, name)
        if loaded is None:
            del state[pid]
        else:
            state[pid] = loaded
    return {**state_dict, "state": state}


def _from_fields(
    opt: Gefen, p: torch.Tensor, st: dict[str, Any], name: str
) -> dict[str, torch.Tensor] | None:
    """A parameter's state from global fields (``integrations.dcp``), at this rank's layout."""
    if not dcp_fields.global_fields(p):
        raise ValueError(
            f"the checkpoint holds Gefen state in global coordinates for {name}, which this run "
            "holds as an FSDP1 piece: only DTensor parameters (FSDP2, HSDP, tensor and expert "
            "parallelism) read it; consolidate it first (gefen_dist.checkpoint.consolidate)"
        )
    return dcp_fields.restore(st, opt.segments_of(p), tuple(p.shape), name)
