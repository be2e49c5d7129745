"""DeepSpeed ZeRO checkpoints of Gefen as one process's state, for another framework or none.

``engine.load_checkpoint(dir)`` already resumes a Gefen ZeRO checkpoint at another
data-parallel degree or ZeRO stage (``integrations.deepspeed``). To leave DeepSpeed, e.g. to
resume in one process or under FSDP2, ``consolidate`` puts every saved rank's fp32 master
weights and Gefen pieces together into whole tensors, in the format of this package's DCP
consolidation (``{"model": ..., "optim": {"state": ..., "param_groups": ...}}``, keyed by
parameter name), which ``checkpoint.load_optimizer`` loads at any layout::

    python -m gefen_dist.checkpoint consolidate DS_CKPT_DIR OUT.pt
    python -m gefen_dist.checkpoint inspect DS_CKPT_DIR
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..method import portable
from ..method.segments import whole_tensor

__all__ = ["consolidate_zero", "describe_zero", "is_zero_checkpoint"]


def is_zero_checkpoint(path: str | Path) -> bool:
    """A directory ``engine.save_checkpoint`` wrote: a 'latest' tag or a tag's ZeRO files."""
    path = Path(path)
    return (path / "latest").is_file() or any(path.glob("*/*zero_pp_rank_*_optim_states.pt"))


def _read(path: str | Path, tag: str | None) -> Any:
    # importing the integration imports deepspeed, which only the CLI on such a directory needs
    from ..integrations.deepspeed import read_checkpoint

    return read_checkpoint(str(path), tag)


def consolidate_zero(path: str | Path, tag: str | None = None) -> tuple[dict, list[str]]:
    """The checkpoint as one process's model and Gefen state dicts, keyed by parameter name;
    returns it and the names whose Gefen state it holds (none before the first step)."""
    saved = _read(path, tag)
    model = {n: w.view(saved.shapes[n]).clone() for n, w in saved.weights.items()}
    buffers = set(saved.model_sd.get("buffer_names") or [])
    for name, t in (saved.model_sd.get("module") or {}).items():
        if name in buffers and isinstance(t, torch.Tensor):
            model[name] = t
    for alias, name in (saved.model_sd.get("shared_params") or {}).items():
        if name in model:  # a tied weight's second name (lm_head.weight for wte.weight)
            model[alias] = model[name]
    state = {}
    for name, ts in (saved.tensors or {}).items():
        whole = whole_tensor(ts.shape, name)
        state[name] = portable.install({name: ts}, whole, torch.device("cpu"))
    groups = [
        {**g, "params": names}
        for g, names in zip(saved.param_groups, saved.group_names(), strict=True)
    ]
    return {"model": model, "optim": {"state": state, "param_groups": groups}}, sorted(state)


def describe_zero(path: str | Path, tag: str | None = None) -> list[str]:
    """One line per tensor: its shape, block size and how many saved ranks hold a piece."""
    saved = _read(path, tag)
    lines = [f"{saved.kind} checkpoint saved on {saved.world_size} data-parallel ranks"]
    for name, ts in sorted((saved.tensors or {}).items()):
        n = len(ts.pieces)
        lines.append(f"{name}: {tuple(ts.shape)}, block size {ts.block_size}, {n} piece(s)")
    return lines
