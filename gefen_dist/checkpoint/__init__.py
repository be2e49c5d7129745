"""Checkpoints at any layout: consolidate Gefen's per-rank state into one process's.

Gefen's sharded checkpoints keep each rank's state as saved, which resumes bit for bit at the
same layout (``integrations.fsdp``). To resume on another number of ranks, or in one process,
``consolidate`` puts every rank's pieces of each tensor together into the state a single
process keeps for the whole tensor (``method.portable``: what is exact, what is merged). That
state loads anywhere: into one process with ``opt.load_state_dict`` / ``set_optimizer_state_dict``,
and into FSDP2 at any world size, where each rank cuts its piece from it.

From the command line, for a DCP checkpoint directory (FSDP2's ``dcp.save``, or
``launch/train.py``'s)::

    python -m gefen_dist.checkpoint consolidate CKPT_DIR OUT.pt
    python -m gefen_dist.checkpoint inspect CKPT_DIR
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..integrations import dcp as dcp_fields
from ..integrations import (
    fsdp,  # noqa: F401  (its Entry and Text: safe globals for torch.load)
    rank_entries,
)
from ..method import portable
from ..method.segments import whole_tensor

__all__ = ["consolidate", "gefen_entries", "load_optimizer", "read_dcp"]

_RANK_PREFIX = "gefen.rank"
_MARKS = (_RANK_PREFIX, dcp_fields.FORMAT_KEY)


def _is_entry(tree: Mapping) -> bool:
    """A parameter's Gefen state in either format: per-rank entries, or global fields."""
    return any(isinstance(k, str) and k.startswith(_MARKS) for k in tree)


def read_dcp(path: str | Path, prefix: str = "") -> dict[str, Any]:
    """A DCP checkpoint directory (only its keys under ``prefix``, e.g. ``"optim."``) as one
    nested dict in this process: DTensors come back whole, Gefen's per-rank entries as the bytes
    they were. Run by every rank of a process group together (DCP coordinates the read), or
    by one process with none."""
    import warnings

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    path = Path(path)
    if not (path / ".metadata").exists():
        raise FileNotFoundError(f"{path} is not a DCP checkpoint directory (no .metadata)")
    keys = {k for k in FileSystemReader(path).read_metadata().state_dict_metadata}
    keys = {k for k in keys if k.startswith(prefix)}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        return _load_state_dict_from_keys(keys, checkpoint_id=str(path))


def _flat_groups(tree: Mapping) -> dict[str, dict[str, Any]]:
    """A flat dict's Gefen entries by parameter: torchtitan's optimizer container keeps each
    parameter's state under keys ``state.{fqn}.{name}`` of one dict
    (``state.fc.weight.gefen.rank0``), not as a nested dict per parameter. Keyed by
    ``state.{fqn}``, each with the names under it."""
    heads = {
        k[: k.index("." + mark)]
        for k in tree
        for mark in _MARKS
        if isinstance(k, str) and ("." + mark) in k
    }
    out: dict[str, dict[str, Any]] = {h: {} for h in heads}
    for k, v in tree.items():
        for h in heads:
            if isinstance(k, str) and k.startswith(h + "."):
                out[h][k[len(h) + 1 :]] = v
                break
    return out


def gefen_entries(tree: Any, where: str = "") -> list[tuple[str, dict]]:
    """Every parameter entry holding Gefen per-rank state in a nested checkpoint dict, with its
    path ('optim.state.fc.weight'), also in flat dicts (``_flat_groups``)."""
    out = []
    if isinstance(tree, Mapping):
        if _is_entry(tree):
            return [(where, tree)]
        for head, entry in _flat_groups(tree).items():
            out.append((f"{where}.{head}" if where else head, entry))
        for k, v in tree.items():
            if isinstance(v, Mapping):
                out += gefen_entries(v, f"{where}.{k}" if where else str(k))
    return out


def consolidate_entry(entry: Mapping[str, Any], where: str) -> dict[str, torch.Tensor] | None:
    """One parameter's per-rank entries as the single-process state of the whole tensor, or
    None where no rank had stepped it. Every rank of the saving world must be there."""
    if dcp_fields.FORMAT_KEY in entry:
        field = next((entry[k] for k in ("codes", "exp_avg") if k in entry), None)
        if field is None:
            return None
        return dcp_fields.whole_state(entry, tuple(field.shape), where)
    keys = sorted((k for k in entry if k.startswith(_RANK_PREFIX)), key=lambda k: int(k[10:]))
    payloads = [rank_entries.read_entry(entry[k], k, where) for k in keys]
    world = {p["world_size"] for p in payloads}
    runs = {p["run"] for p in payloads} | {entry.get(rank_entries.RUN_KEY)}
    if len(world) != 1 or len(runs) != 1:
        raise ValueError(f"{where}: its entries come from different runs or world sizes")
    (n,) = world
    ranks = sorted(p["rank"] for p in payloads)
    if ranks != list(range(n)):
        missing = sorted(set(range(n)) - set(ranks))
        raise ValueError(f"{where}: the checkpoint lacks the state of rank(s) {missing} of {n}")
    tensors = rank_entries.merge_entries(payloads, entry.get("codebook"), where)
    if not tensors:
        return None
    if len(tensors) > 1:
        # an FSDP1 flat parameter's entries, copied to each of its tensors' FQNs: this one's
        named = [n for n in tensors if where == n or where.endswith(f".{n}")]
        tensors = {named[0]: tensors[named[0]]} if len(named) == 1 else tensors
    if len(tensors) != 1:
        raise ValueError(
            f"{where}: holds pieces of {len(tensors)} tensors ({sorted(tensors)}); a "
            "single-process state is per tensor (an FSDP1 flat parameter's checkpoint "
            "consolidates where its entries are keyed by their tensors' FQNs)"
        )
    (ts,) = tensors.values()
    return portable.install(tensors, whole_tensor(ts.shape, ts.name), "cpu")


def consolidate(tree: Any) -> tuple[Any, list[str]]:
    """``tree`` with every Gefen per-rank entry replaced by the whole tensor's single-process
    state; returns it and the paths of the entries it consolidated."""
    done = []

    def walk(t: Any, where: str) -> Any:
        if not isinstance(t, Mapping):
            return t
        if _is_entry(t):
            done.append(where)
            return consolidate_entry(t, where) or {}
        flat = _flat_groups(t)
        out = {k: walk(v, f"{where}.{k}" if where else str(k)) for k, v in t.items()}
        for head, entry in flat.items():  # a flat dict's entries stay flat (torchtitan's)
            path = f"{where}.{head}" if where else head
            done.append(path)
            for name in entry:
                del out[f"{head}.{name}"]
            whole = consolidate_entry(entry, path) or {}
            out.update({f"{head}.{name}": value for name, value in whole.items()})
        return out

    return walk(tree, ""), done


def load_optimizer(opt: torch.optim.Optimizer, model: torch.nn.Module, osd: Mapping) -> None:
    """Load a consolidated optimizer state dict (keyed by parameter FQN, as DCP's
    ``get_state_dict`` writes it) into ``opt`` at this process's layout: one process, or each
    rank of an FSDP2 run of any world size, which cuts its piece of every tensor's state."""
    fqn = {p: n for n, p in model.named_parameters()}
    saved_groups = osd["param_groups"]
    if len(saved_groups) != len(opt.param_groups):
        raise ValueError(
            f"the checkpoint has {len(saved_groups)} param groups, the optimizer "
            f"{len(opt.param_groups)}"
        )
    state, groups, i = {}, [], 0
    for group, saved in zip(opt.param_groups, saved_groups, strict=True):
        names = [fqn.get(p) for p in group["params"]]
        if names != list(saved["params"]):
            raise ValueError(
                f"the checkpoint's param group holds {list(saved['params'])[:4]}..., the "
                f"optimizer's {names[:4]}...: another model, or another param-group order"
            )
        ids = []
        for name in names:
            if name in osd["state"] and osd["state"][name]:
                state[i] = osd["state"][name]
            ids.append(i)
            i += 1
        groups.append({**saved, "params": ids})
    opt.load_state_dict({"state": state, "param_groups": groups})
