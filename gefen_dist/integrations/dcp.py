"""Gefen's state in each parameter's global coordinates, which DCP reshards by itself.

Every DTensor parameter (FSDP2 and HSDP, tensor parallelism, expert parallelism, and their
meshes together) is saved under keys that name no rank:

- ``gefen.format``: ``[2, run id]``, the same on every rank;
- ``step``, ``codebook``, ``block`` (the block size), ``v_cross`` (where the tensor keeps
  one): plain tensors every rank holds alike, so DCP keeps one copy;
- per element, DTensors with the parameter's shape and placements: ``codes`` (one code per
  byte, so that any boundary cuts no byte), or ``exp_avg`` and ``exp_avg_sq`` where B = 1;
  DCP reads any saved layout into any new one, exactly;
- per block piece, under the global element range ``{start}.{numel}`` from the first to the
  last element the saving rank holds: ``v.{range}`` and ``absmax.{range}`` (the pieces' values,
  in element order) and ``pieces.{range}``, one ``(start, numel, run, source)`` row per piece.
  A rank's piece is one run of the flattened tensor where only dim 0 is cut, and a run per
  local row where an inner dim is (a ``RowwiseParallel`` weight); rows of such a piece that
  share one v and absmax per column (``state.block_owners``) name the first row as their
  ``source`` and store no values of their own. A block that a saving boundary cut is saved as
  its two pieces; the loader merges or splits them by ``method.portable``'s rules
  (element-weighted mean of v, max of absmax, codes requantised), so a resume at the saving
  layout is bit for bit and one at another layout has the drift of ``docs/checkpoints.md``.
  Tables of three columns (no ``source``: every row its own) load as before.

The template problem. DCP loads the keys of a template, which ``get_state_dict`` builds on a fresh
optimizer with a zero-gradient step, and the saved structure (block size, which keys exist, the
saving layout's ranges) is chosen from the first real gradients, so no template built without the
checkpoint names the right keys. ``fit_template`` rewrites each Gefen parameter's part of a template
from the checkpoint's metadata, before DCP plans its reads: a rank asks for the per-element fields
at its own layout and for the per-block ranges that meet its elements, nothing else: its new shard
of the per-element fields, plus the block values of the saved ranges its elements meet (under FSDP2
the pieces at its two ends; under tensor parallelism a saved range spans every tp rank's columns of
its rows, so up to all block values of a rowwise weight, at 8 bytes per block against the codes' one
per element). ``LoadPlanner`` does that for ``dcp.load(..., planner=LoadPlanner())``; and because
loaders that build their own ``DefaultLoadPlanner`` (Accelerate's FSDP2 load, torchtitan's
``CheckpointManager``, ``dcp.load`` without a planner) cannot be handed one,
``extend_default_planner`` makes ``DefaultLoadPlanner.set_up_planner`` call ``fit_template`` first,
where a template holds Gefen's ``gefen.format`` key and nowhere else.

Checkpoints in the per-rank format (``gefen.rank{r}`` entries) are fitted too: the template
asks for every saved rank's entry, which ``integrations.fsdp`` re-cuts.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ..distributed import sharding
from ..method import portable
from ..method.segments import Segment, num_blocks, whole_tensor
from ..method.state import bits_of, block_owners, layout_rows

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch build without distributed
    DTensor = None

__all__ = [
    "FORMAT",
    "FORMAT_KEY",
    "LoadPlanner",
    "extend_default_planner",
    "fields",
    "fit_template",
    "global_fields",
    "restore",
    "whole_state",
]

FORMAT = 2
FORMAT_KEY = "gefen.format"
_PER_ELEMENT = ("codes", "exp_avg", "exp_avg_sq")
_PER_RANGE = ("pieces", "v", "absmax")
_SHARED = ("step", "codebook", "block", "v_cross")


def global_fields(p: torch.Tensor) -> bool:
    """Whether ``p``'s state is saved in global coordinates: every DTensor parameter (FSDP2,
    HSDP, tensor parallelism, expert parallelism; its placements are ``Shard``,
    ``_StridedShard`` or ``Replicate``, ``sharding.check_layout``). FSDP1's flat and
    ``use_orig_params`` pieces keep the per-rank format (``integrations.fsdp``). Decided by the
    parameter's type, so every rank decides alike."""
    return sharding.is_dtensor(p) and p.dim() > 0


@dataclass(frozen=True)
class Held:
    """The elements of a tensor that this rank holds: runs of the flattened tensor, each a
    ``Segment`` (offset in the local tensor, numel, start in the tensor), in local order. One
    run where only dim 0 is cut (FSDP2, HSDP, expert parallelism), one per local row where an
    inner dim is (a ``RowwiseParallel`` weight: some columns of every row)."""

    runs: tuple[Segment, ...]

    @classmethod
    def of(cls, segs: list[Segment]) -> Held:
        """The runs of ``segs`` that hold elements; they must tile the local tensor from offset
        0 in order, as a DTensor's local piece and ``take`` lay them out."""
        runs = tuple(sorted((s for s in segs if s.numel), key=lambda s: s.offset))
        at = 0
        for s in runs:
            if s.offset != at:
                raise RuntimeError(f"{s.name}: segments do not tile the local tensor at {at}")
            at += s.numel
        return cls(runs)

    @functools.cached_property
    def by_start(self) -> tuple[Segment, ...]:
        """The runs sorted by their first element (what ``portable.Piece.codes_held`` reads)."""
        return tuple(sorted(self.runs, key=lambda s: s.start))

    @property
    def key(self) -> str:
        """The range from the first element held to the last: the name of this rank's block
        values in a checkpoint (``{start}.{numel}``)."""
        if not self.runs:
            return "0.0"
        lo = self.by_start[0].start
        return f"{lo}.{max(s.start + s.numel for s in self.runs) - lo}"

    def meets(self, start: int, numel: int) -> bool:
        """Whether any run holds an element of [start, start + numel)."""
        runs = self.by_start
        k = bisect.bisect_left(runs, start + numel, key=lambda s: s.start)
        return k > 0 and runs[k - 1].start + runs[k - 1].numel > start

    def take(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's elements of a whole flattened tensor, in local order."""
        return torch.cat([flat[s.start : s.start + s.numel] for s in self.runs] or [flat[:0]])


def held_of(p: torch.Tensor) -> Held:
    """The runs a DTensor's local piece holds (``sharding.piece_segments``)."""
    return Held.of(sharding.piece_segments(p, ""))


def _as_param(p: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """This rank's per-element values (in local order) as a DTensor shaped and placed as ``p``."""
    local = sharding.local(p)
    return DTensor.from_local(
        flat.reshape(local.shape), p.device_mesh, p.placements, run_check=False,
        shape=p.shape, stride=p.stride(),
    )  # fmt: skip


def run_number(run: str) -> int:
    """The run id (hex) as a number a tensor holds: its first 60 bits."""
    return int(run[:15], 16) if run else 0


# -- save ----------------------------------------------------------------------------------------
def fields(
    p: torch.Tensor, st: dict[str, torch.Tensor] | None, segs: list[Segment], run: str
) -> dict[str, Any]:
    """``p``'s state as this rank writes it (module docstring). A rank that keeps no state for
    ``p`` (an empty piece, or a parameter not stepped yet) writes the format key alone."""
    number = run_number(run)
    mark = torch.tensor([FORMAT, number], dtype=torch.int64)
    named = [s for s in segs if s.name and s.numel]
    if st is None or not named:
        return {FORMAT_KEY: mark}
    held = Held.of(named)
    parts = portable.export(st, segs)
    pieces = [ts.pieces[0] for ts in parts]  # one per named segment, in local order
    if [(pc.start, pc.numel) for pc in pieces] != [(s.start, s.numel) for s in held.runs]:
        raise RuntimeError(f"{named[0].name}: the state's segments are not this rank's runs")
    block = parts[0].block_size
    out: dict[str, Any] = {
        FORMAT_KEY: mark,
        "step": st["step"],
        "codebook": st["codebook"],
        "block": torch.tensor(block, dtype=torch.int64),
    }
    if block == 1:
        out["exp_avg"] = _as_param(p, torch.cat([pc.exp_avg for pc in pieces]))
        out["exp_avg_sq"] = _as_param(p, torch.cat([pc.exp_avg_sq for pc in pieces]))
        return out
    if parts[0].v_cross.numel():
        out["v_cross"] = parts[0].v_cross
    out["codes"] = _as_param(p, torch.cat([pc.codes for pc in pieces]))
    source = _value_sources(st, segs)
    table = [[pc.start, pc.numel, number, src] for pc, src in zip(pieces, source, strict=True)]
    own = [pc for k, pc in enumerate(pieces) if source[k] == k]
    out[f"pieces.{held.key}"] = torch.tensor(table, dtype=torch.int64)
    out[f"v.{held.key}"] = torch.cat([pc.v for pc in own])
    out[f"absmax.{held.key}"] = torch.cat([pc.absmax for pc in own])
    return out


def _value_sources(st: dict[str, torch.Tensor], segs: list[Segment]) -> list[int]:
    """Per named segment, the index of the one whose block values it uses: its own, or the first
    row of a run of rows that share column blocks (``state.block_owners``: a tensor-parallel
    piece's rows share one v and absmax per column, which are saved once, not once per row)."""
    owners = block_owners(layout_rows(st), bits_of(st["codebook"]))
    index = {k: i for i, k in enumerate(k for k, s in enumerate(segs) if s.name and s.numel)}
    return [index[owners[k]] for k in index]


# -- load ----------------------------------------------------------------------------------------
def _range_keys(saved: Mapping[str, Any]) -> list[str]:
    return sorted(
        k[len("pieces.") :] for k in saved if isinstance(k, str) and k.startswith("pieces.")
    )


def _mine(value: Any, held: Held, what: str, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """This rank's elements of a per-element field, in local order: a DTensor read at this
    layout, or the whole tensor (a checkpoint read into one process)."""
    if sharding.is_dtensor(value):
        if tuple(value.shape) != shape:
            raise ValueError(
                f"Gefen state for {name}: {what} has shape {tuple(value.shape)}, "
                f"the parameter {shape}"
            )
        return value.to_local().reshape(-1)
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(
            f"Gefen state for {name}: {what} is {got}, the parameter's shape is {shape}"
        )
    return held.take(value.reshape(-1))


@dataclass(frozen=True)
class _Row:
    """One saved block piece: elements [start, start + numel), its block values at ``at`` in
    its range's ``v`` and ``absmax``."""

    start: int
    numel: int
    at: int
    blocks: int


def _table_rows(
    table: Any, key: str, block: int, run: int, count: tuple[int, int], name: str
) -> list[_Row]:
    """A range's ``pieces`` table read and checked: ``(start, numel, run)`` rows, or
    ``(start, numel, run, source)`` where a row uses an earlier row's block values (the rows of
    a tensor-parallel piece that share column blocks); ``count``: the range's v and absmax
    lengths, which its own rows' blocks must fill."""
    if not isinstance(table, torch.Tensor) or table.dim() != 2 or table.shape[1] not in (3, 4):
        raise ValueError(
            f"Gefen state for {name}: pieces.{key} is not a (start, numel, run[, source]) table"
        )
    rows: list[_Row] = []
    own: set[int] = set()
    off = 0
    for i, (start, numel, piece_run, *src) in enumerate(table.tolist()):
        if piece_run != run:
            raise ValueError(
                f"Gefen state for {name}: the pieces of elements {key} are from another run "
                f"({piece_run:x}) than the checkpoint's ({run:x}); the loader kept this "
                "rank's own value (gefen_dist.integrations.dcp)"
            )
        j = src[0] if src else i
        if j == i:
            nb = num_blocks(start, numel, block)
            rows.append(_Row(start, numel, off, nb))
            own.add(i)
            off += nb
            continue
        if j not in own or block >= 0 or rows[j].numel != numel or (rows[j].start - start) % block:
            raise ValueError(
                f"Gefen state for {name}: pieces.{key} row {i} takes the block values of row "
                f"{j}, which is not an earlier piece of the same columns"
            )
        rows.append(_Row(start, numel, rows[j].at, rows[j].blocks))
    if (off, off) != count:
        raise ValueError(
            f"Gefen state for {name}: elements {key} hold {count[0]} v and {count[1]} absmax "
            f"values, their pieces' blocks are {off}"
        )
    return rows


def _saved_pieces(
    saved: Mapping[str, Any], held: Held, block: int, codes: torch.Tensor, run: int, name: str
) -> list[portable.Piece]:
    """The saved block pieces that meet this rank's elements, each reading its codes from
    ``codes`` (this rank's elements, which DCP already brought to this layout)."""
    out = []
    for key in _range_keys(saved):
        v, absmax = saved.get(f"v.{key}"), saved.get(f"absmax.{key}")
        if not isinstance(v, torch.Tensor) or not isinstance(absmax, torch.Tensor):
            raise ValueError(
                f"Gefen state for {name}: the block values of elements {key} are missing"
            )
        count = (v.numel(), absmax.numel())
        for row in _table_rows(saved[f"pieces.{key}"], key, block, run, count, name):
            if held.meets(row.start, row.numel):
                out.append(
                    portable.Piece(
                        row.start, row.numel, codes=codes, codes_held=held.by_start,
                        v=v[row.at : row.at + row.blocks].float(),
                        absmax=absmax[row.at : row.at + row.blocks].float(),
                    )
                )  # fmt: skip
    return sorted(out, key=lambda pc: pc.start)


def restore(
    saved: Mapping[str, Any], segs: list[Segment], shape: tuple[int, ...], name: str
) -> dict[str, torch.Tensor] | None:
    """The state of this rank's ``segs`` (its piece of a tensor of ``shape``) from a
    parameter's fields as DCP read them at this layout (``fit_template``), or read whole; None
    where the checkpoint holds no state for the parameter or this rank holds none of it."""
    mark = saved.get(FORMAT_KEY)
    if not isinstance(mark, torch.Tensor) or mark.numel() != 2 or int(mark[0]) != FORMAT:
        raise ValueError(f"Gefen state for {name}: not a gefen.format {FORMAT} entry ({mark!r})")
    named = [s for s in segs if s.name and s.numel]
    if "block" not in saved or not named:
        return None
    for key in ("step", "codebook"):
        if not isinstance(saved.get(key), torch.Tensor):
            raise ValueError(f"Gefen state for {name}: its {key} is missing")
        if not torch.isfinite(saved[key]).all():  # before pieces are compared by these values
            raise ValueError(f"Gefen state for {name}: {key!r} holds NaN or inf")
    block = int(saved["block"])
    tensor = named[0].name
    held = Held.of(named)
    if block == 1:
        m = _mine(saved["exp_avg"], held, "exp_avg", name, shape)
        v = _mine(saved["exp_avg_sq"], held, "exp_avg_sq", name, shape)
        pieces = sorted(
            (
                portable.Piece(
                    s.start, s.numel, exp_avg=m[s.offset : s.offset + s.numel],
                    exp_avg_sq=v[s.offset : s.offset + s.numel],
                )
                for s in held.runs
            ),
            key=lambda pc: pc.start,
        )  # fmt: skip
    else:
        codes = _mine(saved["codes"], held, "codes", name, shape)
        pieces = _saved_pieces(saved, held, block, codes, int(mark[1]), name)
    v_cross = saved.get("v_cross")
    ts = portable.TensorState(
        tensor, tuple(shape), block, float(saved["step"]), saved["codebook"].float(),
        v_cross.float() if isinstance(v_cross, torch.Tensor) else torch.zeros(0), pieces,
    )  # fmt: skip
    try:
        return portable.install({tensor: ts}, segs, torch.device("cpu"))
    except ValueError as e:  # portable names the tensor by its segments' name
        if name in str(e):
            raise
        raise ValueError(f"Gefen state for {name}: {e}") from None


def whole_state(saved: Mapping[str, Any], shape: tuple[int, ...], name: str) -> dict | None:
    """A parameter's fields read whole (one process) as the single-process state of the whole
    tensor: what ``gefen_dist.checkpoint.consolidate`` writes."""
    return restore(saved, whole_tensor(tuple(shape), name), tuple(shape), name)


# -- the template --------------------------------------------------------------------------------
def _element(tree: Any, path: tuple) -> Any:
    for k in path:
        tree = tree[k]
    return tree


def _fit_new(sub: dict, head: str, prefix: str, md: Mapping[str, Any], where: str) -> None:
    """One parameter's template, from the checkpoint's keys under ``prefix``: the per-element
    fields as DTensors at this layout, the per-range fields that meet this rank's rows. Its
    keys are those of ``sub`` that start with ``head`` (all of them in a nested dict, one
    parameter's ``state.{fqn}.`` in torchtitan's flat one)."""
    mine = {k: v for k, v in sub.items() if isinstance(k, str) and k.startswith(head)}
    source = next((v for v in mine.values() if sharding.is_dtensor(v)), None)
    if source is None:
        return  # a template of whole tensors (one process reads everything), or no state here
    held = held_of(source)
    new: dict[str, Any] = {}
    for key, meta in md.items():
        if not key.startswith(prefix + ".") or not isinstance(meta, TensorStorageMetadata):
            continue
        name = key[len(prefix) + 1 :]
        dtype = meta.properties.dtype
        if name in _PER_ELEMENT:
            if tuple(meta.size) != tuple(source.shape):
                raise ValueError(
                    f"Gefen state for {where}: the checkpoint's {name} has shape "
                    f"{tuple(meta.size)}, this parameter {tuple(source.shape)}: another model"
                )
            local = sharding.local(source)
            new[name] = DTensor.from_local(
                torch.empty(local.shape, dtype=dtype, device=local.device),
                source.device_mesh, source.placements, run_check=False,
                shape=source.shape, stride=source.stride(),
            )  # fmt: skip
        elif name.split(".", 1)[0] in _PER_RANGE and name.count(".") == 2:
            start, numel = (int(x) for x in name.split(".")[1:])
            if held.meets(start, numel):
                new[name] = torch.empty(meta.size, dtype=dtype)
        elif name in _SHARED or name == FORMAT_KEY:
            new[name] = torch.empty(meta.size, dtype=dtype)
    _replace(sub, mine, head, new)


def _fit_old(sub: dict, head: str, prefix: str, md: Mapping[str, Any]) -> None:
    """A per-rank checkpoint (``gefen.rank{r}``): every saved rank's entry, which the FSDP
    load hook re-cuts (``integrations.rank_entries.recut``)."""
    mine = {k: v for k, v in sub.items() if isinstance(k, str) and k.startswith(head)}
    new: dict[str, Any] = {}
    for key, meta in md.items():
        if not key.startswith(prefix + "."):
            continue
        name = key[len(prefix) + 1 :]
        if isinstance(meta, TensorStorageMetadata):
            if name in ("step", "codebook"):
                new[name] = torch.empty(meta.size, dtype=meta.properties.dtype)
        elif name.startswith("gefen."):
            new[name] = b""  # a bytes value: DCP replaces it whole
    _replace(sub, mine, head, new)


def _replace(sub: dict, mine: Mapping[str, Any], head: str, new: Mapping[str, Any]) -> None:
    for k in mine:
        del sub[k]
    sub.update({head + k: v for k, v in new.items()})


def fit_template(state_dict: dict[str, Any], metadata: Metadata) -> None:
    """Rewrite, in place, each Gefen parameter's part of a DCP load template (the keys beside
    a ``gefen.format``) to the checkpoint's structure (module docstring)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    md = metadata.state_dict_metadata
    flat, mappings = flatten_state_dict(state_dict)
    for key in flat:
        path = mappings[key]
        last = path[-1]
        if not (isinstance(last, str) and last.endswith(FORMAT_KEY)):
            continue
        head = last[: -len(FORMAT_KEY)]
        if head and not head.endswith("."):
            continue
        prefix = key[: -len(FORMAT_KEY) - 1]
        sub = _element(state_dict, path[:-1])
        if not isinstance(sub, dict):
            continue
        if f"{prefix}.{FORMAT_KEY}" in md:
            _fit_new(sub, head, prefix, md, prefix)
        elif any(k.startswith(prefix + ".gefen.rank") for k in md):
            _fit_old(sub, head, prefix, md)


class LoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that first fits Gefen's template to the checkpoint
    (``fit_template``): ``dcp.load(state_dict, checkpoint_id=..., planner=LoadPlanner())``."""

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        if metadata is not None:
            fit_template(state_dict, metadata)
        super().set_up_planner(state_dict, metadata, is_coordinator)


def extend_default_planner() -> None:
    """Make ``DefaultLoadPlanner`` fit Gefen's template too, for loaders that build their own
    (module docstring). Idempotent; templates without Gefen's key are left as they are."""
    original = DefaultLoadPlanner.set_up_planner
    if getattr(original, "_gefen", False):
        return

    @functools.wraps(original)
    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):  # type: ignore[no-untyped-def]
        if metadata is not None and not isinstance(self, LoadPlanner):
            fit_template(state_dict, metadata)
        return original(self, state_dict, metadata, is_coordinator)

    set_up_planner._gefen = True  # type: ignore[attr-defined]
    DefaultLoadPlanner.set_up_planner = set_up_planner  # type: ignore[method-assign]
