"""The cross factor: which factor each segment gets this step, and who computes it.

The statement (``reference`` spells the per-segment functions out): a tensor of at least
``state.MIN_CROSS_BLOCKS`` blocks keeps ``v_cross``, one EMA of mean g^2 per position across its
blocks (per tensor row for column blocks). Element (block b, position j) divides by

    sqrt(v_b * c_j) / sqrt(1 - b2^t) + eps,   c_j = max(v_cross_j / mean(v_cross), CROSS_FLOOR)

(the mean over each matrix's rows for a batch of matrices with column blocks,
``state.cross_groups``), with c read from v_cross as the steps before this one left it (from this
step's fold where those left it all zero), and this step's mean g^2 folded in after
(``reference.cross_factor``). The factor belongs to the tensor, not to a piece: a tensor spread over
ranks (FSDP, ZeRO, tensor parallelism) adds its pieces' sums of g^2 (``reference.cross_sums``) over
the process group in one all-reduce per step, so that every rank keeps the single-process v_cross
and takes the single-process step.

Why one module: a step's factors come from up to four places, and which one serves a segment is
one decision, taken here for every backend:

- a segment holding its tensor whole on the C++ kernel, whose v_cross its own elements fill
  (``native_cpu.fuses``): the kernel's update takes the sums in its own read of g (one pass over g
  fewer); here it gets ``factor=None``, which ``SegmentWork`` defines as "from your own g";
- the other C++ segments: one ``native_cpu.cross_table`` call for all (sums; the factor too for
  a tensor held whole);
- Triton segments: one ``triton_backend.cross_table`` per device, a spread tensor's only piece
  writing its sums straight into its slot of the all-reduce's buffer;
- the reference: ``reference.cross_sums`` and ``cross_factor``.

Then the sums of spread tensors (and of pieces of one tensor that share one v_cross in one
buffer, ``state.cross_column``) are added up, all-reduced, and each such tensor's factor is
computed once, by the first of its pieces (``_fold``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..distributed import collectives
from ..method.hyper import Hyper
from ..method.segments import Segment
from ..method.state import SegmentState, layout_rows
from . import native_cpu, triton_backend
from .reference import cross_factor, cross_mean, cross_sums
from .work import CrossDest, CrossWork, FactorWork, StepItem


class Slot(NamedTuple):
    """Where a spread tensor puts its v_cross sums in the per-step all-reduce's buffer (its
    counts at ``total + at``)."""

    at: int
    entries: int


class StepFactors(NamedTuple):
    """This step's factors, and what the kept C++ plan needs to redo the factor pass."""

    factors: list[torch.Tensor | None]
    """Per item: its factor, or None (none, or the C++ update takes it itself)."""
    v_done: set[int]
    """Items whose block v the C++ factor pass has already stepped (contiguous blocks)."""
    table: native_cpu.CrossTable
    """The C++ factor pass that ran."""
    table_items: list[int]
    """The item behind each of ``table``'s rows."""


def agree_slots(
    group: dist.ProcessGroup | None,
    states: Iterable[tuple[list[Segment], Mapping[str, torch.Tensor]]],
    spread_name: Callable[[Segment], str | None],
) -> dict[str, Slot]:
    """Each spread tensor's ``Slot``, the same on every rank (``collectives.agree_cross_slots``):
    agreed once after each initialisation or load. ``states``: each parameter's segments and
    state; a segment that uses an earlier one's v_cross copy has no slot of its own."""
    if group is None:
        return {}
    local: dict[str, int] = {}
    for segments, st in states:
        for seg, row in zip(segments, layout_rows(st), strict=True):
            if spread_name(seg) and row.cross > 0:
                local[seg.name] = row.cross
    return {n: Slot(*s) for n, s in collectives.agree_cross_slots(group, local).items()}


def step_factors(
    items: list[StepItem], slots: dict[str, Slot], group: dist.ProcessGroup | None
) -> StepFactors:
    """Every item's factor this step (module docstring). Every rank reduces the whole buffer,
    zeros for tensors it does not step in this call: ZeRO steps one group at a time, all ranks
    the same group."""
    out: list[torch.Tensor | None] = [None] * len(items)
    v_done: set[int] = set()
    total = sum(s.entries for s in slots.values())
    buf = None
    if total:
        buf = torch.zeros(2 * total, dtype=torch.float64, device=collectives.comm_device(group))
    factored = []
    for i, it in enumerate(items):
        if it.seg.v_cross is None or it.seg.v_cross.numel() == 0:
            continue
        if it.spread is not None and (buf is None or it.spread not in slots):
            raise RuntimeError(f"tensor {it.spread!r} is spread over ranks but has no cross slot")
        factored.append(i)
    # pieces of one tensor in one buffer share one v_cross (state.cross_column): it is folded
    # once, by the first of them, from all their sums
    holder: dict[tuple, int] = {}
    owner = {
        i: holder.setdefault((items[i].seg.v_cross.device, items[i].seg.v_cross.data_ptr()), i)
        for i in factored
    }
    sharing = Counter(owner.values())
    alone = {
        i
        for i in factored
        if items[i].spread is None and sharing[owner[i]] == 1 and items[i].seg.cross_groups == 1
    }
    on_cpu = [
        i
        for i in factored
        if items[i].impl == "cpu"
        and not (i in alone and native_cpu.fuses(items[i].seg, items[i].g))
    ]
    table = native_cpu.cross_table([_cross_work(items[i], i in alone) for i in on_cpu])
    cpu_sums = dict(zip(on_cpu, table.results, strict=True))
    gpu_sums, direct = {}, set()
    pieces = Counter(items[i].spread for i in factored)
    for device in {items[i].g.device for i in factored if items[i].impl == "triton"}:
        on = [i for i in factored if items[i].impl == "triton" and items[i].g.device == device]
        dest: list[CrossDest | None] = [None] * len(on)
        for k, i in enumerate(on):
            name = items[i].spread
            if name is not None and buf.device == device and pieces[name] == 1:
                at, n = slots[name]
                dest[k] = CrossDest(buf[at : at + n], buf[total + at : total + at + n])
                direct.add(i)
        work = [_cross_work(items[i], i in alone) for i in on]
        gpu_sums.update(zip(on, triton_backend.cross_table(work, dest).views, strict=True))
    spread: dict[int, Slot] = {}  # owner -> its tensor's slot
    local: dict[int, list[torch.Tensor]] = {}  # owner -> sums, counts of pieces held only here
    for i in factored:
        it = items[i]
        if it.impl == "cpu" and i not in cpu_sums:
            continue  # the C++ update takes it
        if it.impl == "cpu":
            sums, counts, f = cpu_sums[i]
            if it.seg.block_size > 1:
                v_done.add(i)
        elif it.impl == "triton":
            sums, counts, f = gpu_sums[i]
        else:
            sums, counts = cross_sums(it.g, it.seg.start, it.seg.block_size, it.seg.v_cross.numel())
            f = _factor(it.impl, it.seg, it.hyper, sums, counts) if i in alone else None
        if i in alone:
            out[i] = f
            continue
        if it.spread is None:
            acc = local.get(owner[i])
            if acc is None:
                local[owner[i]] = [sums.double().clone(), counts.double().clone()]
            else:
                acc[0] += sums.to(acc[0].device)
                acc[1] += counts.to(acc[1].device)
            continue
        at, n = slots[it.spread]
        if i not in direct:
            buf[at : at + n] += sums.to(buf.device)
            buf[total + at : total + at + n] += counts.to(buf.device)
        spread.setdefault(owner[i], slots[it.spread])
    ready = list(local.items())
    if buf is not None:
        dist.all_reduce(buf, group=group)
        for o, (at, n) in spread.items():
            ready.append((o, [buf[at : at + n], buf[total + at : total + at + n]]))
    made = _fold(items, ready)
    for i in factored:
        if owner[i] in made:
            out[i] = made[owner[i]]
    return StepFactors(out, v_done, table, on_cpu)


def _cross_work(it: StepItem, whole: bool) -> CrossWork:
    return CrossWork(it.g, it.seg, it.hyper, whole)


def _fold(
    items: list[StepItem], ready: list[tuple[int, list[torch.Tensor]]]
) -> dict[int, torch.Tensor]:
    """The factor of each tensor whose sums are complete (its owner item -> factor), folding
    them into its v_cross: one Triton launch per device for those on a GPU."""
    made: dict[int, torch.Tensor] = {}
    on_gpu: dict[torch.device, list[tuple[int, FactorWork]]] = {}
    for o, (sums, counts) in ready:
        it = items[o]
        sums, counts = (x.to(it.seg.v_cross.device).contiguous() for x in (sums, counts))
        if it.impl == "triton":
            for sub, s, c in _slices(it.seg, sums, counts):
                work = FactorWork(sub, it.hyper, s, c)
                on_gpu.setdefault(it.seg.v_cross.device, []).append((o, work))
        else:
            made[o] = _factor(it.impl, it.seg, it.hyper, sums, counts)
    for pairs in on_gpu.values():
        got = triton_backend.factors([w for _, w in pairs])
        parts: dict[int, list[torch.Tensor]] = {}
        for (o, _), f in zip(pairs, got, strict=True):
            parts.setdefault(o, []).append(f)
        for o, fs in parts.items():
            made[o] = fs[0] if len(fs) == 1 else torch.cat(fs)
    return made


def _slices(
    seg: SegmentState, sums: torch.Tensor, counts: torch.Tensor
) -> list[tuple[SegmentState, torch.Tensor, torch.Tensor]]:
    """The parts of a factor normalised apart (``state.cross_groups``), each as a segment of its
    own slice of v_cross: every backend normalises what it is given as one."""
    k = seg.cross_groups
    if k == 1:
        return [(seg, sums, counts)]
    n = seg.v_cross.numel() // k
    return [
        (
            replace(seg, v_cross=seg.v_cross[j * n : (j + 1) * n], cross_groups=1),
            sums[j * n : (j + 1) * n],
            counts[j * n : (j + 1) * n],
        )
        for j in range(k)
    ]


def _factor(
    impl: str, seg: SegmentState, h: Hyper, sums: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """A segment's factor from its tensor's sums: the C++ kernel's own pass where it updates the
    segment, the reference's elsewhere."""
    parts = [
        native_cpu.cross_factor(sub, h, s, c)
        if impl == "cpu"
        else cross_factor(sub, h, cross_mean(s, c))
        for sub, s, c in _slices(seg, sums, counts)
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts)
