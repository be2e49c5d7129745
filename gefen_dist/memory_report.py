"""What Gefen's state costs, per tensor and in all, next to what AdamW would keep.

Why a module: the report reads every state's layout (to attribute bytes, B = 1 elements and the
spread v_cross copies to tensors) and the backend choice, which the step never needs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .backends import native_cpu
from .method import state


@dataclass
class Tensor:
    """One parameter's state as the report reads it (``Gefen.memory_report`` gathers them)."""

    name: str
    shape: tuple[int, ...]
    numel: int
    """Elements of this rank's piece."""
    state: Mapping[str, torch.Tensor]
    spread: list[str | None]
    """Per segment, the name of the tensor spread over ranks it is a piece of, or None."""
    backend: str
    """The update that steps it, as ``dispatch.REPORT_NAMES`` names it."""


def memory_report(tensors: list[Tensor], bits: list[int], backend: str) -> dict[str, Any]:
    """State bytes per parameter tensor and in total, next to what AdamW would keep.
    ``spread_v_cross``: v_cross entries this rank keeps for tensors spread over ranks, by
    tensor; each rank holding pieces of one keeps one copy (4 bytes an entry), the one state
    that sharding duplicates. ``backend``: which update ran (``backend``, the optimizer's
    setting, where no state exists yet); ``cpu_isa``: with native-cpu, the vector path its
    build compiled ('avx512vbmi', 'avx512', 'avx2' or 'scalar')."""
    rows = []
    spread: dict[str, int] = {}
    for t in tensors:
        layout = state.layout_rows(t.state)
        for name, r in zip(t.spread, layout, strict=True):
            if name and r.cross > 0:
                spread[name] = spread.get(name, 0) + r.cross
        rows.append(
            dict(
                name=t.name,
                shape=t.shape,
                numel=t.numel,
                block_sizes=sorted({r.block for r in layout}),
                fallback_numel=sum(r.numel for r in layout if r.block == 1),
                state_bytes=state.state_bytes(t.state),
                adamw_bytes=8 * t.numel,
            )
        )
    total = sum(r["state_bytes"] for r in rows)
    params = sum(r["numel"] for r in rows)
    used = "+".join(sorted({t.backend for t in tensors})) or backend
    return dict(
        tensors=rows,
        state_bytes=total,
        params=params,
        bytes_per_param=total / params if params else 0.0,
        adamw_bytes=8 * params,
        fallback_numel=sum(r["fallback_numel"] for r in rows),
        spread_v_cross=spread,
        bits=sorted(bits),
        backend=used,
        cpu_isa=native_cpu.isa() if "native-cpu" in used else None,
    )


def format_memory_report(report: dict[str, Any]) -> str:
    lines = [f"{'tensor':<44} {'numel':>10} {'B':>10} {'state B':>11} {'AdamW B':>11}"]
    for r in report["tensors"]:
        bs = ",".join(f"col{-b}" if b < 0 else str(b) for b in r["block_sizes"])
        lines.append(
            f"{r['name'][:44]:<44} {r['numel']:>10} {bs:>10} "
            f"{r['state_bytes']:>11} {r['adamw_bytes']:>11}"
        )
    lines.append(
        f"total: {report['state_bytes']} bytes = {report['bytes_per_param']:.3f} bytes/param "
        f"(AdamW {report['adamw_bytes']} = 8.000); B = 1 fallback on "
        f"{report['fallback_numel']} of {report['params']} parameters; update: "
        f"{report['backend']}" + (f" ({report['cpu_isa']})" if report.get("cpu_isa") else "")
    )
    return "\n".join(lines)
