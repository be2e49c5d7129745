"""Gefen under FSDP: what each rank's buffers hold, and checkpoints through FSDP's own paths.

One call after building the optimizer::

    model = FSDP(model, ...)            # or fully_shard(...) (FSDP2)
    opt = Gefen(model.parameters(), lr=...)
    gefen_dist.integrations.fsdp.configure(model, opt)

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
installs optimizer state-dict hooks that, for every parameter sharded over ranks, replace the
Gefen tensors by one ``bytes`` value keyed by the owning rank, ``"gefen.rank{r}"``, next to the
usual 0-dim ``"step"`` (and, for DTensor parameters, the codebook, which every rank shares):

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
- A resumed run must have the same world size and FSDP wrapping: a block cut by a shard boundary
  keeps one scale and one v per piece, which cannot be re-cut exactly for other boundaries. Any
  other world size or layout fails at load with an error naming the parameter (DCP, asked for
  a rank the checkpoint lacks, refuses first: "Missing key ... gefen.rank{r}"). An FSDP2 full
  state dict (DCP ``full_state_dict=True``) is not supported: DCP gathers only DTensors, so it
  holds the saving rank's Gefen state alone. FSDP1's ``rank0_only`` *load* calls ``.cpu()`` on
  every state value, so it cannot load non-tensor state: save with ``rank0_only`` if you like,
  but load the (small) full checkpoint on every rank.

With a sharded model, ``optimizer.state_dict()`` may be a collective (FULL_STATE_DICT with
``use_orig_params=False``): call it on every rank, as FSDP's own state-dict functions are.
"""

from __future__ import annotations

import io
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
from ..method.segments import Segment
from ..method.state import STATE_KEYS
from ..optimizer import Gefen

__all__ = ["configure", "RANK_KEY"]

RANK_KEY = "gefen.rank{}"
RUN_KEY = "gefen.run"
_FORMAT = "gefen-rank-state/1"
_HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)
_SHARDED = (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, *_HYBRID)
_SUPPORTED = (*_SHARDED, ShardingStrategy.NO_SHARD)


@dataclass
class _Integration:
    model: nn.Module | None
    sharded: dict[torch.Tensor, dist.ProcessGroup] = field(default_factory=dict)
    orig_pieces: set[torch.Tensor] = field(default_factory=set)
    flat_models: list[nn.Module] = field(default_factory=list)
    names: dict[torch.Tensor, str] = field(default_factory=dict)
    replicas: dist.ProcessGroup | None = None  # HSDP: the ranks holding copies of our pieces
    run: str = ""


def configure(model: nn.Module | None, optimizer: Gefen) -> None:
    """Tell ``optimizer`` how FSDP laid out ``model``'s parameters, and make its state dicts
    travel through FSDP's and DCP's checkpoint functions (module docstring).

    Call once, after wrapping the model and building the optimizer, before the first step.
    ``optimizer`` may be a wrapper that holds Gefen as ``.optimizer`` (Accelerate's
    ``AcceleratedOptimizer`` after ``accelerator.prepare``).
    Gefen calls ``configure(None, optimizer)`` itself when it is built on FSDP2 (DTensor)
    parameters, so FSDP2 users need not; calling it again with the model then only adds the
    parameters' FQNs to error messages.
    """
    wrapped = optimizer
    while not isinstance(optimizer, Gefen) and isinstance(
        getattr(optimizer, "optimizer", None), torch.optim.Optimizer
    ):
        optimizer = optimizer.optimizer  # Accelerate's AcceleratedOptimizer, and the like
    if not isinstance(optimizer, Gefen):
        raise TypeError(f"configure expects a gefen_dist.Gefen optimizer, got {type(wrapped)}")
    done = getattr(optimizer, "_gefen_fsdp", None)
    if done is not None and done.model is None and model is not None:
        fqn_of = {p: n for n, p in model.named_parameters()} if model is not None else {}
        done.model = model
        done.names.update({p: f"parameter {fqn_of[p]!r}" for p in done.sharded if p in fqn_of})
        return
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
        integ.names.setdefault(p, f"parameter {fqn_of[p]!r}" if p in fqn_of else optimizer._name(p))
    integ.run = _run_id(next(iter(integ.sharded.values())), integ.replicas)
    optimizer._gefen_fsdp = integ
    optimizer.register_state_dict_post_hook(_pack_state_dict)
    optimizer.register_load_state_dict_pre_hook(_unpack_state_dict, prepend=True)


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
    another world size reaches the check in ``_decode`` rather than a missing key."""
    integ: _Integration = opt._gefen_fsdp
    state = dict(state_dict["state"])
    mine: dict[int, tuple[str, bytes]] = {}
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
        # A DTensor parameter's codebook stays a tensor: the same on every rank, so DCP's
        # de-duplication is right for it, and DCP's full-state loader needs one tensor per entry.
        outside = ("codebook",) if st is not None and sharding.is_dtensor(p) else ()
        blob = _encode(st, opt._segments_for(p), rank, world, integ.run, outside)
        entry: dict[str, Any] = {RUN_KEY: integ.run, key: blob}
        if st is not None:
            entry = {"step": st["step"], **{k: st[k] for k in outside}, **entry}
        state[idx] = entry
        mine[idx] = (key, blob)
    if _gather_full(integ):
        gathered = _all_gather_flat(integ, opt, mine)
        for idx, entries in gathered.items():
            state[idx] = {**state[idx], **entries}
    return {**state_dict, "state": state}


def _gather_full(integ: _Integration) -> bool:
    """FSDP1 copies a flat parameter's non-tensor state from the saving rank only; a full state
    dict must then carry every rank's entry, which only this hook can collect."""
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


def _unpack_state_dict(opt: Gefen, state_dict: dict[str, Any]) -> dict[str, Any]:
    """Load pre-hook (runs before Gefen's own): this rank's entry back into Gefen tensors."""
    integ: _Integration = opt._gefen_fsdp
    saved_state = state_dict["state"]
    state = dict(saved_state)
    saved_ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
    params = [p for g in opt.param_groups for p in g["params"]]
    for pid, p in zip(saved_ids, params, strict=False):
        st = saved_state.get(pid)
        if st is None:
            continue
        ranks = sorted(k for k in st if isinstance(k, str) and k.startswith("gefen.rank"))
        if not ranks:
            continue
        name = integ.names.get(p) or opt._name(p)
        if p not in integ.sharded:
            raise ValueError(
                f"the checkpoint holds per-rank Gefen state ({', '.join(ranks)}) for {name}, "
                "which is not sharded in this run: load it into the same FSDP setup it was "
                "saved from"
            )
        group = integ.sharded[p]
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        key = RANK_KEY.format(rank)
        if key not in st:
            raise ValueError(
                f"the checkpoint holds Gefen state for {name} from {', '.join(ranks)} but not "
                f"from rank {rank}: it was saved by another world size, or as a full state dict "
                "that FSDP gathered without the other ranks' entries (gefen_dist.integrations.fsdp)"
            )
        loaded = _decode(st, key, opt._segments_for(p), rank, world, name)
        if loaded is None:
            del state[pid]
        else:
            state[pid] = loaded
    return {**state_dict, "state": state}


def _encode(
    st: dict[str, torch.Tensor] | None,
    segs: list[Segment],
    rank: int,
    world: int,
    run: str,
    outside: tuple[str, ...],
) -> bytes:
    payload = {
        "format": _FORMAT,
        "rank": rank,
        "world_size": world,
        "run": run,
        "step": None if st is None else float(st["step"]),
        "segments": [(s.offset, s.numel, s.start, list(s.shape), s.name) for s in segs],
        "tensors": {
            k: st[k].detach().cpu()
            for k in STATE_KEYS
            if st is not None and k != "step" and k not in outside
        },
    }
    buf = io.BytesIO()
    torch.save(payload, buf)
    return buf.getvalue()


def _decode(
    entry: dict[str, Any], key: str, segs: list[Segment], rank: int, world: int, name: str
) -> dict[str, torch.Tensor] | None:
    """This rank's Gefen state from its entry, or None where it saved none."""
    blob, step = entry[key], entry.get("step")
    if not isinstance(blob, bytes):
        raise ValueError(f"Gefen state for {name}: expected bytes, got {type(blob).__name__}")
    try:
        payload = torch.load(io.BytesIO(blob), weights_only=True)
    except Exception as e:  # a truncated or damaged entry: name it, not torch's reader
        raise ValueError(
            f"Gefen state for {name}: entry {key!r} is not a readable state "
            f"({type(e).__name__}: {e})"
        ) from None
    if not isinstance(payload, dict) or payload.get("format") != _FORMAT:
        raise ValueError(f"Gefen state for {name} is not a {_FORMAT} entry")
    if payload["world_size"] != world or payload["rank"] != rank:
        raise ValueError(
            f"Gefen state for {name} was saved by rank {payload['rank']} of "
            f"{payload['world_size']}, and is being loaded by rank {rank} of {world}: Gefen's "
            "per-rank state (packed codes, and one scale and v per block piece, cut at the "
            "saved shard boundaries) is not resharded; resume with the same world size and "
            "FSDP wrapping"
        )
    saved_step = payload["step"]
    if payload["run"] != entry.get(RUN_KEY) or (
        saved_step is not None and (step is None or saved_step != float(step))
    ):
        raise ValueError(
            f"Gefen state for {name}: rank {rank}'s entry is not the one saved with this "
            f"checkpoint (run {payload['run']} step {saved_step}, the checkpoint's: run "
            f"{entry.get(RUN_KEY)} step {None if step is None else float(step)}); the "
            "loader kept this rank's own value. A full state dict of DTensor (FSDP2) "
            "parameters carries only the saving rank's Gefen state, since DCP gathers "
            "DTensors only: save FSDP2 checkpoints sharded (full_state_dict=False)"
        )
    here = [(s.offset, s.numel, s.start, list(s.shape), s.name) for s in segs]
    saved = [tuple(x) for x in payload["segments"]]
    if saved != [tuple(x) for x in here]:
        raise ValueError(
            f"Gefen state for {name} was saved for the layout (offset, numel, start, shape, "
            f"tensor) {saved}, but this rank holds {here}: a different model or FSDP wrapping"
        )
    if saved_step is None:
        return None
    outside = {k: entry[k] for k in STATE_KEYS if k in entry and k != "step"}
    return {
        "step": torch.tensor(saved_step, dtype=torch.float32, device="cpu"),
        **payload["tensors"],
        **outside,
    }
