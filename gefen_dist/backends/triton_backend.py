"""The Triton backend (``triton_kernels.py``): Gefen's update on CUDA tensors, and on CPU tensors
under Triton's interpreter (``TRITON_INTERPRET=1``, set before triton is first imported), so CI
runs the GPU kernels themselves on a machine without a GPU. It replaced a CUDA C++ backend
(removed: docs/history.md) and kept its API: ``supports``, ``available``,
``build_error``, ``step`` (returning the plan it ran) and ``launch_step``, ``cross_table``
(``cross_plan``, ``launch_cross``), ``factors``, ``histogram``, ``agree``, ``DTYPES``; a plan
kept from one step to the next can rewrite ``StepPlan.ints`` / ``floats`` at ``rows`` (the
columns of ``segment_table``) and ``CrossPlan.meta`` / ``hyps`` and launch them again.

Why a segment table: a step touches hundreds of tensors, and FSDP/ZeRO hand each rank pieces of
many tensors in one flat buffer. One row per segment (``segment_table.row``: addresses as
integers, offsets, block size, dtypes, the step key; ``hyper_row``: the step's hyperparameters
in fp32) lets a few launches cover every segment of a step, whatever the model, and an lr
schedule changes only numbers in rows, never a compiled kernel: only tile shapes are constexpr
(``SIGNATURES`` records every one launched).

Launches per step, at most: one for the B = 1 segments (``dense_kernel``); for blocked and
column segments, one reduction per block-width class (``WIDTHS``: contiguous blocks of at most
16, 64, 256 elements share a program 64, 16, 4 to a (R, W) tile; longer ones get a program each
that loops over tiles of 1024) plus two for the column segments (partial sums per chunk of rows,
then their fixed-order reduction), one element pass for all of them (``apply_kernel``: m
recomputed, the parameter moved, codes rewritten; whole bytes per program, so the 4-bit bytes two
blocks share have a single writer and need no atomics) and one that writes the new absmax over
the old (``commit_kernel``): at most 9. The factor's pass (``cross_table``): at most 4. The
tables reach the device in two host-to-device copies per pass.

What equals what: every operation is the reference's, in the fp32 order the CUDA C++ kernels
had (lerp as torch's, p * (1 - lr wd) + (-step) * (m / denom), denom = sqrt(v) / bc2 + eps or
sqrt(v) * factor + eps; correctly rounded division and square root, no contraction), sums of
g^2 in fp64 in a fixed order, so results are deterministic and a resumed run continues bit for
bit. Against ``reference.py`` run by torch they agree within ``agree``'s bounds, not bit for bit:
torch's CPU kernels contract lerp and add-with-alpha into FMAs, compute addcdiv as
(value * a) / b, and this torch's vectorised fp32 sqrt is not correctly rounded, so an fp32
result sits an ulp away now and then and a code on a rounding threshold flips
(tests/test_triton_backend.py pins the kernels bit for bit to an IEEE emulation of their own
order instead).
"""

from __future__ import annotations

import itertools
import os
from array import array
from dataclasses import dataclass
from typing import Any

import torch

from ..method.codes import unpack4
from ..method.hyper import Hyper
from ..method.segments import num_blocks
from ..method.state import SegmentState
from . import segment_table as table
from .reference import cross_factor, cross_mean

DTYPES = table.DTYPES
TILE = 1024
"""Elements per program of the element passes (dense, apply), blocks per program of commit."""
WIDTHS = ((16, 64), (64, 16), (256, 4), (1024, 1))
"""(W, R) of the contiguous blocks' reduction: blocks of at most W elements, R per program; a
longer block takes the last class and loops over tiles of W."""
COL_TILE = (8, 128)  # (rows, columns) of col_reduce_kernel's tile
COL_FINISH = 1024  # columns per program of col_finish_kernel
CROSS_TILE = (8, 128)  # (tensor rows, positions) of cross_rows_kernel's tile
CROSS_FINISH = 1024  # positions per program of cross_finish_kernel
CROSS_COLS = (8, 128)  # (tensor rows, elements) of cross_cols_kernel's tile
FACTOR_TILE = 1024
LAUNCH = {"enable_fp_fusion": False}
"""Launch options on CUDA (the interpreter ignores them): no multiply-add contraction."""
META_COLS, HYP_COLS, AUX_COLS = table.META_COLS, table.HYP_COLS, 5
CROSS_META_COLS = 12
CROSS_ROWS = 32
"""Tensor rows per chunk in the factor's pass over contiguous blocks (at most 256 chunks per
segment): enough programs to fill the device on a tall tensor."""
CROSS_PART_BYTES = 16 << 20
"""The most the factor's partial sums may take for a whole step; over it, every segment's
chunks shrink in proportion."""
COLUMN_ROWS = 32
COLUMN_PART_BYTES = 48 << 20
"""Rows per chunk (at most 128 chunks per segment) in the column segments' reduction, and the
most their partial sums and maxima may take for a step (12 bytes per column and chunk)."""

SIGNATURES: set[tuple] = set()
"""(kernel, constexpr values) of every launch so far: what could select a compiled variant."""

_kern: Any = None
_error: str | None = None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _kernels() -> Any:
    """triton_kernels, imported on first use (and with it triton); None and ``build_error()``
    where triton does not import."""
    global _kern, _error
    if _kern is None and _error is None:
        try:
            from . import triton_kernels

            _kern = triton_kernels
        except Exception as e:  # no triton, or one that cannot parse the kernels
            _error = f"{type(e).__name__}: {e}"
    return _kern


def _interpreted(k: Any) -> bool:
    """Whether the kernels were decorated under the interpreter (decided at their import)."""
    return type(k.dense_kernel).__name__ == "InterpretedFunction"


def _mode(k: Any) -> str:
    """'interpreted' or 'compiled', where the kernels and triton's own language functions
    (decorated when triton was first imported) agree; else 'mixed', where neither path runs."""
    import triton.language as tl

    modes = {_interpreted(k), type(tl.zeros).__name__ == "InterpretedFunction"}
    return "mixed" if len(modes) == 2 else ("interpreted" if modes.pop() else "compiled")


_device_error: dict[str, str | None] = {}


def available(device: torch.device | None = None) -> bool:
    """Triton imports, and (with ``device``) runs there: a CUDA device with the kernels
    compiled for it (not under the interpreter), or the CPU under the interpreter."""
    k = _kernels()
    if k is None:
        return False
    if device is None:
        return True
    device = torch.device(device)
    key = str(device)
    if key not in _device_error:
        why = None
        mode = _mode(k)
        if mode == "mixed":
            why = "triton and the kernels were imported with TRITON_INTERPRET set differently"
        elif device.type == "cuda":
            if mode == "interpreted":
                why = "the kernels were imported under TRITON_INTERPRET=1 (CPU tensors only)"
            elif not torch.cuda.is_available():
                why = "CUDA is not available"
            else:
                try:
                    import triton

                    torch.zeros(1, device=device).add_(1)
                    triton.runtime.driver.active.get_current_device()
                except Exception as e:
                    why = f"triton's CUDA driver: {type(e).__name__}: {e}"
        elif device.type == "cpu":
            if mode != "interpreted":
                why = "CPU tensors need TRITON_INTERPRET=1 set before triton is first imported"
        else:
            why = f"no Triton path for {device.type} tensors"
        _device_error[key] = why
    return _device_error[key] is None


def build_error(device: torch.device | None = None) -> str | None:
    """Why ``available`` is False: triton's import error, or (with ``device``, or the last
    device asked about) why that device cannot run the kernels."""
    _kernels()
    if _error is not None:
        return _error
    if device is not None:
        available(device)
        return _device_error.get(str(torch.device(device)))
    return next((e for e in reversed(_device_error.values()) if e), None)


def supports(p: torch.Tensor, g: torch.Tensor) -> bool:
    """fp32/bf16/fp16 parameter and gradient on one CUDA device, or on the CPU under the
    interpreter (whose kernels read the tables' addresses as host memory, so CUDA tensors are
    not for it)."""
    if p.dtype not in DTYPES or g.dtype not in DTYPES or p.device != g.device:
        return False
    if p.device.type == "cuda":
        return not interpreting()
    return p.device.type == "cpu" and interpreting()


def _launch(kernel: Any, grid: int, *args: Any, **const: int) -> None:
    SIGNATURES.add((kernel.__name__, tuple(sorted(const.items()))))
    kernel[(grid,)](*args, **const, **LAUNCH)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _width(block: int) -> tuple[int, int]:
    return next((w, r) for w, r in WIDTHS if block <= w or w == WIDTHS[-1][0])


def _to_device(values: array, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A table on the device: one pinned host-to-device copy on CUDA; on the CPU the array's own
    memory (alive while the plan is)."""
    host = torch.frombuffer(values, dtype=dtype) if len(values) else torch.zeros(1, dtype=dtype)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _on(device: torch.device) -> Any:
    """The launches' device context: CUDA launches go to the device's current stream."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    import contextlib

    return contextlib.nullcontext()


# ------------------------------------------------------------------------------ the update


@dataclass
class Launch:
    """One launch of a step plan: ``kernel`` over ``n`` table rows from ``meta_at`` (ints),
    ``hyp_at`` (floats), ``aux_at`` (ints, blocked and column rows), its prefix of each row's
    first program at ``prefix_at``, ``programs`` in all, and its tile constexprs."""

    kernel: str
    n: int
    meta_at: int
    hyp_at: int
    aux_at: int
    prefix_at: int
    programs: int
    const: dict[str, int]


@dataclass
class StepPlan:
    """One step's tables on the host, flat arrays that reach the device in two copies: every
    row's integers (segment_table.row), the aux rows and the launches' prefixes in ``ints``,
    the hyperparameter rows in ``floats``. ``rows``: per row, (work item, where it starts in
    ints, in floats), for a kept plan to rewrite; ``scratch``: blocks of the blocked
    and column segments (new absmax and denominator per block); ``part``: the column segments'
    partials (chunks x columns)."""

    ints: array
    floats: array
    launches: list[Launch]
    rows: list[tuple[int, int, int]]
    factors: list  # this step's cross factors, alive until the launches are queued
    scratch: int = 0
    part: int = 0


def _column_chunks(sts: list[SegmentState]) -> list[tuple[int, int, int]]:
    """Each column segment's chunks of rows, rows per chunk and columns: min(128, rows /
    COLUMN_ROWS) chunks, scaled down together to keep the partials within COLUMN_PART_BYTES."""
    want = []
    for st in sts:
        rows = -(-st.numel // -st.block_size)
        want.append(
            (max(1, min(128, _cdiv(rows, COLUMN_ROWS))), rows, min(st.numel, -st.block_size))
        )
    total = 12 * sum(c * nb for c, _, nb in want)
    out = []
    for chunks, rows, nb in want:
        if total > COLUMN_PART_BYTES:
            chunks = max(1, chunks * COLUMN_PART_BYTES // total)
        per = _cdiv(rows, chunks)
        out.append((_cdiv(rows, per), per, nb))
    return out


def step_plan(work: list[tuple], made: dict[int, torch.Tensor | None]) -> StepPlan:
    """The host side of ``step``: ``made`` holds the factors computed for items without one.
    Rows: the B = 1 segments, then the blocked ones by width class, then the column ones, so
    every launch covers a contiguous run of rows."""
    device = work[0][0].device
    dense: list[tuple] = []
    blocked: dict[int, list[tuple]] = {w: [] for w, _ in WIDTHS}
    columns: list[tuple] = []
    factors = []
    for i, (p, g, st, h, levels, mids, bits, *given) in enumerate(work):
        if st.numel == 0:
            continue
        if p.device != device or g.device != device:
            raise ValueError("Gefen's Triton step got tensors on several devices in one call")
        if p.numel() != st.numel or g.numel() != st.numel:
            raise ValueError(f"segment of {st.numel} elements got p {p.numel()}, g {g.numel()}")
        if not 0 < abs(st.block_size) < 1 << 30 or (st.block_size != 1 and bits not in (4, 8)):
            raise ValueError(f"Gefen's Triton step: block size {st.block_size}, {bits} bits")
        f = given[0] if given else made.get(i)
        factors.append(f)
        row = table.row(p, g, st, levels, mids, bits, h.step, f, stochastic=h.bf16_stochastic_round)
        entry = (row, table.hyper_row(h), i, st)
        if st.block_size == 1:
            dense.append(entry)
        elif st.block_size < 0:
            columns.append(entry)
        else:
            blocked[_width(st.block_size)[0]].append(entry)
    ints: list[int] = []
    floats: list[float] = []
    plan = StepPlan(array("q"), array("f"), [], [], factors)

    def put_rows(entries: list[tuple]) -> tuple[int, int]:
        at = (len(ints), len(floats))
        for row, hyp, i, _ in entries:
            plan.rows.append((i, len(ints), len(floats)))
            ints.extend(row)
            floats.extend(hyp)
        return at

    def put_prefix(counts: list[int]) -> int:
        at = len(ints)
        ints.extend(itertools.accumulate(counts, initial=0))
        return at

    if dense:
        m_at, h_at = put_rows(dense)
        counts = [_cdiv(st.numel, TILE) for *_, st in dense]
        plan.launches.append(
            Launch(
                "dense_kernel",
                len(dense),
                m_at,
                h_at,
                0,
                put_prefix(counts),
                sum(counts),
                {"TILE": TILE},
            )
        )
    classes = [(w, r, blocked[w]) for w, r in WIDTHS if blocked[w]]
    rest = [e for *_, es in classes for e in es] + columns
    if not rest:
        plan.ints.extend(ints)
        plan.floats.extend(floats)
        return plan
    m_at, h_at = put_rows(rest)
    aux_at = len(ints)
    scratch = part = 0
    shapes = iter(_column_chunks([e[3] for e in columns]))
    nbs = []
    for *_, st in rest:
        if st.block_size > 0:
            nb = num_blocks(st.start, st.numel, st.block_size)
            ints += [scratch, 0, 0, 0, nb]
        else:
            chunks, per, nb = next(shapes)
            ints += [scratch, part, chunks, per, nb]
            part += chunks * nb
        scratch += nb
        nbs.append(nb)
    plan.scratch, plan.part = scratch, part
    first = 0  # the class's first row among ``rest``
    for w, r, entries in classes:
        counts = [_cdiv(nb, r) for nb in nbs[first : first + len(entries)]]
        plan.launches.append(
            Launch(
                "block_reduce_kernel",
                len(entries),
                m_at + first * META_COLS,
                h_at + first * HYP_COLS,
                aux_at + first * AUX_COLS,
                put_prefix(counts),
                sum(counts),
                {"R": r, "W": w},
            )
        )
        first += len(entries)
    if columns:
        n = len(columns)
        at = (m_at + first * META_COLS, h_at + first * HYP_COLS, aux_at + first * AUX_COLS)
        col_nb = nbs[first:]
        chunks = [ints[aux_at + (first + k) * AUX_COLS + 2] for k in range(n)]
        counts = [_cdiv(nb, COL_TILE[1]) * c for nb, c in zip(col_nb, chunks, strict=True)]
        plan.launches.append(
            Launch(
                "col_reduce_kernel",
                n,
                *at,
                put_prefix(counts),
                sum(counts),
                {"RB": COL_TILE[0], "CB": COL_TILE[1]},
            )
        )
        counts = [_cdiv(nb, COL_FINISH) for nb in col_nb]
        plan.launches.append(
            Launch("col_finish_kernel", n, *at, put_prefix(counts), sum(counts), {"CB": COL_FINISH})
        )
    for kernel, counts in (
        ("apply_kernel", [_cdiv(st.numel, TILE) for *_, st in rest]),  # a program per tile
        ("commit_kernel", [_cdiv(nb, TILE) for nb in nbs]),  # a program per tile of blocks
    ):
        at_counts = (put_prefix(counts), sum(counts))
        plan.launches.append(
            Launch(kernel, len(rest), m_at, h_at, aux_at, *at_counts, {"TILE": TILE})
        )
    plan.ints.extend(ints)
    plan.floats.extend(floats)
    return plan


def step(work: list[tuple]) -> StepPlan | None:
    """Run every (p, g, segment views, Hyper, levels, mids, bits[, factor]) of one device:
    at most 9 launches for all segments, their tables in two host-to-device copies
    (``step_plan``). Flat 1-D contiguous views; the optimizer guarantees it. ``factor``: this
    step's ``reference.cross_factor`` of the segment's tensor, or None for none; an item
    without it whose v_cross is non-empty gets its factor from one ``cross_table`` pass over
    such items (each taken as its whole tensor). Returns the plan it ran."""
    if not work:
        return None
    if _kernels() is None:
        raise RuntimeError(f"Gefen's Triton kernels are unavailable: {build_error()}")
    own = [
        i
        for i, (_, g, st, h, *rest) in enumerate(work)
        if len(rest) == 3 and st.numel and st.v_cross is not None and st.v_cross.numel()
    ]
    made = cross_table([(work[i][1], work[i][2], work[i][3], True) for i in own]).views
    plan = step_plan(work, {i: f for i, (*_, f) in zip(own, made, strict=True)})
    launch_step(plan, work[0][0].device)
    return plan


def launch_step(plan: StepPlan, device: torch.device) -> None:
    """The launches of a step plan, in order: B = 1, the reductions, the element pass, the
    commit of the new absmax."""
    if not plan.launches:
        return
    k = _kernels()
    ints = _to_device(plan.ints, torch.int64, device)
    floats = _to_device(plan.floats, torch.float32, device)
    f32, f64 = dict(dtype=torch.float32, device=device), dict(dtype=torch.float64, device=device)
    scr_amax = torch.empty(max(1, plan.scratch), **f32)
    scr_den = torch.empty(max(1, plan.scratch), **f32)
    part_sum = torch.empty(max(1, plan.part), **f64)
    part_max = torch.empty(max(1, plan.part), **f32)
    with _on(device):
        for la in plan.launches:
            kernel = getattr(k, la.kernel)
            head = (la.meta_at, la.hyp_at, la.aux_at, la.prefix_at, la.n)
            if la.kernel == "dense_kernel":
                args = (ints, floats, la.meta_at, la.hyp_at, la.prefix_at, la.n)
            elif la.kernel in ("block_reduce_kernel", "apply_kernel"):
                args = (ints, floats, *head, scr_amax, scr_den)
            elif la.kernel == "col_reduce_kernel":
                args = (ints, floats, *head, part_sum, part_max)
            elif la.kernel == "col_finish_kernel":
                args = (ints, floats, *head, part_sum, part_max, scr_amax, scr_den)
            else:  # commit_kernel
                args = (ints, la.meta_at, la.aux_at, la.prefix_at, la.n, scr_amax)
            _launch(kernel, la.programs, *args, **la.const)


# ------------------------------------------------------------------------- the factor pass


def _cross_rows(start: int, numel: int, width: int) -> int:
    """Tensor rows of width ``width`` that a piece of ``numel`` elements from ``start`` touches."""
    return (start + numel - 1) // width - start // width + 1


@dataclass
class CrossPlan:
    """What ``launch_cross`` gets for one step's factored segments of one device: the table
    rows (triton_kernels.X_*; contiguous blocks first, then columns; ``order`` maps
    them to the work items), per-row hyperparameters, each launch's prefix of programs (per
    row: cross_rows_kernel's, cross_finish_kernel's, cross_cols_kernel's), the partial sums'
    length, and per work item the views of the step's buffers its results land in: (sums,
    counts, factor or None)."""

    meta: list[list[int]]
    hyps: list[list[float]]
    order: list[int]
    row_prefix: list[int]
    pos_prefix: list[int]
    col_prefix: list[int]
    part_n: int
    views: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]


Dest = tuple[torch.Tensor, torch.Tensor] | None


def cross_plan(
    work: list[tuple[torch.Tensor, SegmentState, Hyper, bool]], dest: list[Dest] | None = None
) -> CrossPlan:
    """The launch plan of ``cross_table``: plain numbers and pointers. Contiguous rows get
    min(256, rows / CROSS_ROWS) chunks of tensor rows, scaled down together to keep the
    partial sums within CROSS_PART_BYTES. ``dest``: per item, None or the (sums, counts) it is
    to write into (fp64, contiguous, of its v_cross's length, zero where its piece has no
    element: a spread tensor's slot in the all-reduce's buffer, where it is the only piece)."""
    device = work[0][0].device
    dest = dest or [None] * len(work)
    lengths = [w[1].v_cross.numel() for w in work]
    own = sum(n for n, d in zip(lengths, dest, strict=True) if d is None)
    sums_all = torch.zeros(2 * own, dtype=torch.float64, device=device)
    fac_all = torch.empty(sum(n for n, w in zip(lengths, work, strict=True) if w[3]), device=device)
    views, at, f_at = [], 0, 0
    for n, (_, _, _, whole), d in zip(lengths, work, dest, strict=True):
        f = fac_all[f_at : f_at + n] if whole else None
        f_at += n if whole else 0
        if d is None:
            views.append((sums_all[at : at + n], sums_all[at + n : at + 2 * n], f))
            at += 2 * n
            continue
        if any(
            x.numel() != n
            or x.dtype != torch.float64
            or not x.is_contiguous()
            or x.device != device
            for x in d
        ):
            raise ValueError(f"factor destination must be contiguous fp64 of {n} entries")
        views.append((*d, f))
    rows_kind = [i for i, (_, st, _, _) in enumerate(work) if st.block_size > 1 and st.numel]
    cols_kind = [i for i, (_, st, _, _) in enumerate(work) if st.block_size < 0 and st.numel]
    chunks = {}
    for i in rows_kind:
        st = work[i][1]
        chunks[i] = max(
            1, min(256, _cdiv(_cross_rows(st.start, st.numel, st.block_size), CROSS_ROWS))
        )
    part_total = sum(chunks[i] * work[i][1].block_size for i in rows_kind)
    if 8 * part_total > CROSS_PART_BYTES:
        for i in rows_kind:
            chunks[i] = max(1, chunks[i] * CROSS_PART_BYTES // (8 * part_total))
    plan = CrossPlan([], [], rows_kind + cols_kind, [0], [0], [0], 0, views)
    for i in plan.order:
        g, st, h, _ = work[i]
        if g.device != device or st.v_cross.device != device:
            raise ValueError("Gefen's factor pass got tensors on several devices in one call")
        if g.dtype not in DTYPES or g.numel() != st.numel:
            raise ValueError(f"factor pass: g of {g.numel()} {g.dtype} for {st.numel} elements")
        sums, counts, f = views[i]
        width, c = abs(st.block_size), chunks.get(i, 0)
        ptrs = [sums.data_ptr(), counts.data_ptr(), st.v_cross.data_ptr()]
        row = [g.data_ptr(), DTYPES[g.dtype], st.start, st.numel, st.block_size, lengths[i], *ptrs]
        plan.meta.append(row + [0 if f is None else f.data_ptr(), plan.part_n, c])
        plan.hyps.append(table.cross_hyper_row(h))
        if st.block_size > 1:
            plan.part_n += c * width
            plan.row_prefix.append(plan.row_prefix[-1] + c * _cdiv(width, CROSS_TILE[1]))
            plan.pos_prefix.append(plan.pos_prefix[-1] + _cdiv(width, CROSS_FINISH))
        else:
            rows = _cross_rows(st.start, st.numel, width)
            plan.col_prefix.append(plan.col_prefix[-1] + _cdiv(rows, CROSS_COLS[0]))
    return plan


def cross_table(
    work: list[tuple[torch.Tensor, SegmentState, Hyper, bool]], dest: list[Dest] | None = None
) -> CrossPlan:
    """``reference.cross_sums`` of every (g, segment, h, whole) of one device, and
    ``reference.cross_factor`` of each ``whole`` one (a tensor held whole; v_cross is folded in
    place), in at most four launches (``launch_cross``). Returns the plan it ran, whose
    ``views`` hold (sums, counts, factor or None) per item, in order: fp64 sums and counts for
    the all-reduce of a spread tensor, written into ``dest`` where given (``cross_plan``)."""
    if not work:
        return CrossPlan([], [], [], [0], [0], [0], 0, [])
    plan = cross_plan(work, dest)
    launch_cross(plan, work[0][0].device)
    for (_, st, h, whole), (sums, counts, f) in zip(work, plan.views, strict=True):
        if whole and not st.numel:  # nothing launched for it: the reference's factor of zeros
            f.copy_(cross_factor(st, h, cross_mean(sums, counts)))
    return plan


def factor_plan(work: list[tuple[SegmentState, Hyper, torch.Tensor, torch.Tensor]]) -> CrossPlan:
    """``factors``' launch plan: factor rows only (no sums to compute), their sums and counts
    moved to v_cross's device as contiguous fp64 (``views`` keeps them alive until launched)."""
    device = work[0][0].v_cross.device
    out = torch.empty(sum(st.v_cross.numel() for st, *_ in work), device=device)
    plan = CrossPlan([], [], [], [0], [0], [0], 0, [])
    at = 0
    for st, h, sums, counts in work:
        n = st.v_cross.numel()
        if sums.numel() != n or counts.numel() != n:
            raise ValueError(
                f"factor sums/counts have {sums.numel()}/{counts.numel()} entries, v_cross {n}"
            )
        sums, counts = (x.to(device, torch.float64).contiguous() for x in (sums, counts))
        f, at = out[at : at + n], at + n
        plan.views.append((sums, counts, f))
        ptrs = [sums.data_ptr(), counts.data_ptr(), st.v_cross.data_ptr(), f.data_ptr()]
        plan.meta.append([0, 0, st.start, 0, st.block_size, n, *ptrs, 0, 0])
        plan.hyps.append(table.cross_hyper_row(h))
    return plan


def factors(
    work: list[tuple[SegmentState, Hyper, torch.Tensor, torch.Tensor]],
) -> list[torch.Tensor]:
    """``reference.cross_factor(st, h, cross_mean(sums, counts))`` of every (segment, h, sums,
    counts) of one device in one launch, v_cross folded in place: the factors of tensors spread
    over ranks, from their all-reduced sums."""
    if not work:
        return []
    plan = factor_plan(work)
    launch_cross(plan, work[0][0].v_cross.device)
    return [f for *_, f in plan.views]


def launch_cross(plan: CrossPlan, device: torch.device) -> None:
    """The factor pass of a plan, its integers in one host-to-device copy and its
    hyperparameters in another: partial sums per chunk and their reduction (contiguous
    rows), the row sums (column rows), then the factors of the rows that want one."""
    if not plan.meta:
        return
    k = _kernels()
    nr = len(plan.row_prefix) - 1
    flat = array("q", [x for r in plan.meta for x in r])
    rp = len(flat)
    flat.extend(plan.row_prefix)
    pp = len(flat)
    flat.extend(plan.pos_prefix)
    cp = len(flat)
    flat.extend(plan.col_prefix)
    ints = _to_device(flat, torch.int64, device)
    hyps = _to_device(array("f", [x for r in plan.hyps for x in r]), torch.float32, device)
    part = torch.empty(max(1, plan.part_n), dtype=torch.float64, device=device)
    nc = len(plan.col_prefix) - 1
    with _on(device):
        if plan.row_prefix[-1]:
            _launch(
                k.cross_rows_kernel,
                plan.row_prefix[-1],
                ints,
                0,
                rp,
                nr,
                part,
                RB=CROSS_TILE[0],
                CB=CROSS_TILE[1],
            )
            _launch(
                k.cross_finish_kernel, plan.pos_prefix[-1], ints, 0, pp, nr, part, CB=CROSS_FINISH
            )
        if plan.col_prefix[-1]:
            _launch(
                k.cross_cols_kernel,
                plan.col_prefix[-1],
                ints,
                nr * CROSS_META_COLS,
                cp,
                nc,
                GR=CROSS_COLS[0],
                CW=CROSS_COLS[1],
            )
        _launch(k.cross_factor_kernel, len(plan.meta), ints, hyps, 0, 0, TILE=FACTOR_TILE)


# ---------------------------------------------------------------------- codebook histogram


def histogram(
    g: torch.Tensor,
    start: int,
    block: int,
    head_amax: float,
    tail_amax: float,
    counts: torch.Tensor,
) -> None:
    """Add one segment's g / absmax(block) to int64 ``counts`` (on g's device), binned as
    ``codebook.histogram``; ``head_amax`` / ``tail_amax`` (or -1) replace the absmax of a cut
    first / last block with the whole block's. Integer atomics: the counts are exact."""
    k = _kernels()
    numel = g.numel()
    nb = num_blocks(start, numel, block)
    if nb == 0:
        return
    if counts.dtype != torch.int64 or not counts.is_contiguous() or counts.device != g.device:
        raise ValueError("histogram counts must be contiguous int64 on g's device")
    g = g.contiguous()
    ints = _to_device(
        array(
            "q",
            [
                g.data_ptr(),
                DTYPES[g.dtype],
                start,
                numel,
                block,
                nb,
                counts.numel(),
                counts.data_ptr(),
            ],
        ),
        torch.int64,
        g.device,
    )
    floats = _to_device(array("f", [head_amax, tail_amax]), torch.float32, g.device)
    with _on(g.device):
        _launch(k.histogram_kernel, nb, ints, floats, TILE=TILE)


# ------------------------------------------------------------------ compiled, without a GPU


def variants() -> list[tuple[str, dict[str, str], dict[str, int]]]:
    """Every (kernel, signature, constexprs) the launchers use: the compiled variants there can
    be (their keys as in ``SIGNATURES``), whatever the model or the schedule."""
    i64, f32, f64, n = "*i64", "*fp32", "*fp64", "i32"
    step = {"ints": i64, "floats": f32, "meta_at": n, "hyp_at": n}
    rows = {**step, "aux_at": n, "prefix_at": n, "n_rows": n}
    scr = {"scr_amax": f32, "scr_den": f32}
    part = {"part_sum": f64, "part_max": f32}
    cross = {"ints": i64, "meta_at": n, "prefix_at": n, "n_rows": n}
    out = [("dense_kernel", {**step, "prefix_at": n, "n_rows": n}, {"TILE": TILE})]
    out += [("block_reduce_kernel", {**rows, **scr}, {"R": r, "W": w}) for w, r in WIDTHS]
    out += [
        ("col_reduce_kernel", {**rows, **part}, {"RB": COL_TILE[0], "CB": COL_TILE[1]}),
        ("col_finish_kernel", {**rows, **part, **scr}, {"CB": COL_FINISH}),
        ("apply_kernel", {**rows, **scr}, {"TILE": TILE}),
        (
            "commit_kernel",
            {"ints": i64, "meta_at": n, "aux_at": n, "prefix_at": n, "n_rows": n, "scr_amax": f32},
            {"TILE": TILE},
        ),
        ("cross_rows_kernel", {**cross, "part": f64}, {"RB": CROSS_TILE[0], "CB": CROSS_TILE[1]}),
        ("cross_finish_kernel", {**cross, "part": f64}, {"CB": CROSS_FINISH}),
        ("cross_cols_kernel", cross, {"GR": CROSS_COLS[0], "CW": CROSS_COLS[1]}),
        ("cross_factor_kernel", step, {"TILE": FACTOR_TILE}),
        ("histogram_kernel", {"ints": i64, "floats": f32}, {"TILE": TILE}),
    ]
    return out


def compile_ptx(arch: int = 90) -> dict[tuple, str]:
    """Compile every variant (``variants``) for CUDA sm_``arch`` with the launch options, no GPU
    needed (triton's own ptxas): the PTX per ``SIGNATURES`` key. Not under the interpreter."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    k = _kernels()
    if k is None or _mode(k) != "compiled":
        raise RuntimeError("compile_ptx needs triton's compiler, not TRITON_INTERPRET=1")
    out = {}
    for name, sig, const in variants():
        src = ASTSource(
            fn=getattr(k, name),
            signature={**sig, **{c: "constexpr" for c in const}},
            constexprs=const,
        )
        done = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(LAUNCH))
        out[(name, tuple(sorted(const.items())))] = done.asm["ptx"]
    return out


# ------------------------------------------------------------------------------- agreement

STATE_FIELDS = ("codes", "absmax", "v", "v_cross", "exp_avg", "exp_avg_sq")
PARAM_RTOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
"""How far a kernel's parameters may sit from the reference's after one step, relative to the
step's operands, by parameter dtype (``agree``)."""


def agree(
    p: torch.Tensor,
    st: SegmentState,
    p_ref: torch.Tensor,
    st_ref: SegmentState,
    before: torch.Tensor,
    bits: int,
    what: str,
) -> None:
    """Raise unless one step of the kernel (``p``, ``st``) matches the reference's from the same
    state (the CUDA backend's, moved here unchanged). The reference runs torch's kernels, which
    contract multiply-adds (and on this CPU's torch take a square root that is not correctly
    rounded) where these kernels do neither, so an fp32 result can sit an ulp away, and a code
    flips where m / absmax lies within that ulp of a midpoint or of its stochastic threshold:
    rare, but over thousands of elements not negligible. At most one code in 500 may differ,
    each by one level; a wrong kernel differs in whole blocks, in the bytes blocks share, or
    everywhere. Everything else within its tolerance, the parameters relative to the step's
    operands (``before``, the parameter before the step), as where a step nearly cancels p an
    ulp of the step is far more of the result."""
    tol = PARAM_RTOL[p.dtype]
    scale = torch.maximum(before.float().abs(), p_ref.float().abs()).clamp_min(1e-3)
    err = ((p.float() - p_ref.float()).abs() / scale).max()
    if not err <= tol:
        raise RuntimeError(f"parameters differ by {float(err):.3g} ({what})")
    dense = st.exp_avg is not None and st.exp_avg.numel() > 0
    if dense:  # bf16 B = 1 state: an fp32 result an ulp apart may carry differently (a bf16 ulp)
        pairs = [("exp_avg", 1e-2), ("exp_avg_sq", 1e-2)]
    else:
        pairs = [("v", 1e-5), ("absmax", 1e-5), ("v_cross", 1e-5)]
    for k, rtol in pairs:
        a, b = getattr(st, k).float(), getattr(st_ref, k).float()
        floor = 1e-6 * b.abs().max() if dense else 1e-30  # m where a lerp cancels
        if not ((a - b).abs() <= rtol * b.abs() + floor).all():
            raise RuntimeError(f"{k} differs ({what})")
    if not dense:
        mine, ref = st.codes, st_ref.codes
        if bits == 4:
            mine, ref = unpack4(mine, st.numel), unpack4(ref, st.numel)
        d = (mine.long() - ref.long()).abs()
        flipped = int((d > 0).sum())
        if flipped > st.numel // 500 or (flipped and int(d.max()) > 1):
            raise RuntimeError(
                f"{flipped} of {st.numel} codes differ, by up to {int(d.max())} levels ({what})"
            )
