"""What Gefen's state costs, per tensor and in all, next to what AdamW would keep.

Why a module: the report reads every state's layout (to attribute bytes, B = 1 elements and the
spread v_cross copies to tensors) and the backend choice, which the step never needs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .backends import dispatch, native_cpu
from .distributed import sharding
from .method import state

if TYPE_CHECKING:
    from .optimizer import Gefen


def memory_report(opt: Gefen) -> dict[str, Any]:
    """State bytes per parameter tensor and in total, next to what AdamW would keep.
    ``spread_v_cross``: v_cross entries this rank keeps for tensors spread over ranks, by
    tensor; each rank holding pieces of one keeps one copy (4 bytes an entry), the one state
    that sharding duplicates. ``backend``: which update ran; ``cpu_isa``: with native-cpu, the
    vector path its build compiled ('avx512vbmi', 'avx512', 'avx2' or 'scalar')."""
    rows = []
    spread: dict[str, int] = {}
    for p, st in opt.state.items():
        if st:
            layout = st["layout"].tolist()
            for seg, r in zip(opt._segments_for(p), layout, strict=True):
                if opt._spread_name(seg) and r[4] > 0:
                    spread[seg.name] = spread.get(seg.name, 0) + r[4]
            fallback = sum(r[1] for r in layout if r[3] == 1)
            rows.append(
                dict(
                    name=opt._name(p),
                    shape=tuple(p.shape),
                    numel=sharding.local(p).numel(),
                    block_sizes=sorted({r[3] for r in layout}),
                    fallback_numel=fallback,
                    state_bytes=state.state_bytes(st),
                    adamw_bytes=8 * sharding.local(p).numel(),
                )
            )
    total = sum(r["state_bytes"] for r in rows)
    params = sum(r["numel"] for r in rows)
    backend = backend_in_use(opt)
    return dict(
        tensors=rows,
        state_bytes=total,
        params=params,
        bytes_per_param=total / params if params else 0.0,
        adamw_bytes=8 * params,
        fallback_numel=sum(r["fallback_numel"] for r in rows),
        spread_v_cross=spread,
        bits=sorted(opt._codebooks),
        backend=backend,
        cpu_isa=native_cpu.isa() if "native-cpu" in backend else None,
    )


def backend_in_use(opt: Gefen) -> str:
    """The backends that update this optimizer's state, as ``memory_report`` names them."""
    used = set()
    for p, st in opt.state.items():
        if st:
            local = sharding.local(p)
            g = sharding.local(p.grad) if p.grad is not None else local
            used.add(dispatch.REPORT_NAMES[opt._impl(local, g)])
    return "+".join(sorted(used)) or opt._backend


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
