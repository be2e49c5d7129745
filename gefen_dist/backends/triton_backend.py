"""The Triton backend (``triton_kernels.py``): Gefen's update on CUDA tensors, and on CPU tensors
under Triton's interpreter (``TRITON_INTERPRET=1``, set before triton is first imported), so CI
runs the GPU kernels themselves on a machine without a GPU. It replaced a CUDA C++ backend
(removed: docs/history.md) and kept its API: ``supports``, ``available``,
``build_error``, ``step`` (returning the plan it ran) and ``launch_step``, ``cross_table``
(``cross_plan``, ``launch_cross``), ``factors``, ``histogram``, ``DTYPES``; a plan
kept from one step to the next can rewrite ``StepPlan.ints`` / ``floats`` at ``rows`` (the
columns of ``segment_table.Meta`` / ``Hyp``) and ``CrossPlan.meta`` / ``hyps`` and launch them
again. What checks the kernels (``agree``, the compiled ``variants``, ``compile_ptx``) is in
``triton_checks``.

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
had (lerp as torch's, p * (1 - lr wd) + (-step) * (m / denom); the shared s = sqrt(v) / bc2,
or sqrt(v) * factor; per block keep = max(0, 1 - mean(m_hat^2) / ms2), 0 where ms2 is not > 0,
ms2 = s * s or (sqrt(v) * sqrt(v)) * mean(factor^2), m_hat = m / bc1, each mean an fp64 sum
of squares over the block's elements / their count, rounded to fp32; denom = max(s, sqrt(s * s
* keep + m_hat * m_hat)) + eps where g * m < 0, else s + eps (the overshoot rule); correctly
rounded division and square root, no contraction), those sums and v's of g^2 in fp64 in a
fixed order, so results are deterministic and a resumed run continues bit for bit. Against
``reference.py`` run by torch they agree within ``agree``'s bounds, not bit for bit: torch's
CPU kernels contract lerp and add-with-alpha into FMAs, compute addcdiv as
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
from typing import Any, NamedTuple

import torch

from ..method.segments import num_blocks
from ..method.state import SegmentState
from . import segment_table as table
from .reference import cross_factor, cross_mean
from .segment_table import Aux, Cross, Hist, HistAmax, Hyp, Meta
from .work import CrossDest, CrossResult, CrossWork, FactorWork, SegmentWork

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
META_COLS, HYP_COLS, AUX_COLS = len(Meta), len(Hyp), len(Aux)
CROSS_META_COLS = len(Cross)
CROSS_ROWS = 32
"""Tensor rows per chunk in the factor's pass over contiguous blocks (at most 256 chunks per
segment): enough programs to fill the device on a tall tensor."""
CROSS_PART_BYTES = 16 << 20
"""The most the factor's partial sums may take for a whole step; over it, every segment's
chunks shrink in proportion."""
COLUMN_ROWS = 32
COLUMN_PART_BYTES = 48 << 20
"""Rows per chunk (at most 128 chunks per segment) in the column segments' reduction, and the
most their partial sums and maxima may take for a step (28 bytes per column and chunk: fp64
sums of g^2, (m / bc1)^2 and f^2, an fp32 maximum)."""

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


class PlanRow(NamedTuple):
    """Where a work item's rows sit in a ``StepPlan``, for a kept plan to rewrite."""

    item: int
    """The index of the ``SegmentWork`` in the step's work."""
    meta_at: int
    """Its ``Meta`` row's first entry in ``ints``."""
    hyp_at: int
    """Its ``Hyp`` row's first entry in ``floats``."""


class _Entry(NamedTuple):
    """A segment's rows while ``step_plan`` sorts them into launches."""

    meta: list[int]
    hyp: list[float]
    item: int
    seg: SegmentState


@dataclass
class StepPlan:
    """One step's tables on the host, flat arrays that reach the device in two copies: every
    row's integers (``segment_table.row``), the ``Aux`` rows and the launches' prefixes in
    ``ints``, the hyperparameter rows in ``floats``. ``rows``: a ``PlanRow`` per row;
    ``scratch``: blocks of the blocked and column segments (new absmax, denominator and keep
    per block); ``part``: the column segments' partials (chunks x columns)."""

    ints: array
    floats: array
    launches: list[Launch]
    rows: list[PlanRow]
    factors: list  # this step's cross factors, alive until the launches are queued
    scratch: int = 0
    part: int = 0


class _ColumnShape(NamedTuple):
    """How a column segment's reduction is cut (``Aux``'s CHUNKS, PER, NB)."""

    chunks: int
    per: int
    columns: int


def _column_chunks(sts: list[SegmentState]) -> list[_ColumnShape]:
    """Each column segment's chunks of rows, rows per chunk and columns: min(128, rows /
    COLUMN_ROWS) chunks, scaled down together to keep the partials within COLUMN_PART_BYTES."""
    want = []
    for st in sts:
        rows = -(-st.numel // -st.block_size)
        want.append(
            (max(1, min(128, _cdiv(rows, COLUMN_ROWS))), rows, min(st.numel, -st.block_size))
        )
    total = 28 * sum(c * nb for c, _, nb in want)
    out = []
    for chunks, rows, nb in want:
        if total > COLUMN_PART_BYTES:
            chunks = max(1, chunks * COLUMN_PART_BYTES // total)
        per = _cdiv(rows, chunks)
        out.append(_ColumnShape(_cdiv(rows, per), per, nb))
    return out


def step_plan(work: list[SegmentWork], made: dict[int, torch.Tensor]) -> StepPlan:
    """The host side of ``step``: ``made`` holds the factors ``step`` computed for items
    whose ``factor`` is None. Rows: the B = 1 segments, then the blocked ones by width class,
    then the column ones, so every launch covers a contiguous run of rows."""
    device = work[0].p.device
    dense: list[_Entry] = []
    blocked: dict[int, list[_Entry]] = {w: [] for w, _ in WIDTHS}
    columns: list[_Entry] = []
    factors = []
    for i, item in enumerate(work):
        p, g, st, h, bits = item.p, item.g, item.seg, item.hyper, item.bits
        if st.numel == 0:
            continue
        if p.device != device or g.device != device:
            raise ValueError("Gefen's Triton step got tensors on several devices in one call")
        if p.numel() != st.numel or g.numel() != st.numel:
            raise ValueError(f"segment of {st.numel} elements got p {p.numel()}, g {g.numel()}")
        if not 0 < abs(st.block_size) < 1 << 30 or (st.block_size != 1 and bits not in (4, 8)):
            raise ValueError(f"Gefen's Triton step: block size {st.block_size}, {bits} bits")
        f = item.factor if item.factor is not None else made.get(i)
        factors.append(f)
        row = table.row(
            p, g, st, item.levels, item.mids, bits, h.step, f, stochastic=h.bf16_stochastic_round
        )
        entry = _Entry(row, table.hyper_row(h), i, st)
        if st.block_size == 1:
            dense.append(entry)
        elif st.block_size < 0:
            columns.append(entry)
        else:
            width, _ = _width(st.block_size)
            blocked[width].append(entry)
    ints: list[int] = []
    floats: list[float] = []
    plan = StepPlan(array("q"), array("f"), [], [], factors)

    def put_rows(entries: list[_Entry]) -> tuple[int, int]:
        at = (len(ints), len(floats))
        for e in entries:
            plan.rows.append(PlanRow(e.item, len(ints), len(floats)))
            ints.extend(e.meta)
            floats.extend(e.hyp)
        return at

    def put_prefix(counts: list[int]) -> int:
        at = len(ints)
        ints.extend(itertools.accumulate(counts, initial=0))
        return at

    if dense:
        m_at, h_at = put_rows(dense)
        counts = [_cdiv(e.seg.numel, TILE) for e in dense]
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
    shapes = iter(_column_chunks([e.seg for e in columns]))
    nbs = []
    chunks_of = []
    for e in rest:
        st = e.seg
        if st.block_size > 0:
            nb = num_blocks(st.start, st.numel, st.block_size)
            aux = {Aux.SCR: scratch, Aux.PART: 0, Aux.CHUNKS: 0, Aux.PER: 0, Aux.NB: nb}
        else:
            shape = next(shapes)
            nb = shape.columns
            aux = {
                Aux.SCR: scratch,
                Aux.PART: part,
                Aux.CHUNKS: shape.chunks,
                Aux.PER: shape.per,
                Aux.NB: nb,
            }
            part += shape.chunks * nb
            chunks_of.append(shape.chunks)
        ints += table.as_row(aux, Aux)
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
        counts = [_cdiv(nb, COL_TILE[1]) * c for nb, c in zip(col_nb, chunks_of, strict=True)]
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
        ("apply_kernel", [_cdiv(e.seg.numel, TILE) for e in rest]),  # a program per tile
        ("commit_kernel", [_cdiv(nb, TILE) for nb in nbs]),  # a program per tile of blocks
    ):
        at_counts = (put_prefix(counts), sum(counts))
        plan.launches.append(
            Launch(kernel, len(rest), m_at, h_at, aux_at, *at_counts, {"TILE": TILE})
        )
    plan.ints.extend(ints)
    plan.floats.extend(floats)
    return plan


def step(work: list[SegmentWork]) -> StepPlan | None:
    """Run every ``SegmentWork`` of one device: at most 9 launches for all segments, their
    tables in two host-to-device copies (``step_plan``). Flat 1-D contiguous views; the
    optimizer guarantees it. Returns the plan it ran.

    ``factor`` None where the segment has a non-empty v_cross: the factor comes from one
    ``cross_table`` pass over such items, each taken as its whole tensor, before the update.
    Why the backend and not the caller: ``SegmentWork`` leaves a factor to the backend only
    for a segment whose own elements are its whole tensor, so its own g gives the exact
    factor, and computing it here keeps every such item of a device in that one pass (and
    this backend usable on its own, as the tests and ``launch/gpu_items.py`` call it)."""
    if not work:
        return None
    if _kernels() is None:
        raise RuntimeError(f"Gefen's Triton kernels are unavailable: {build_error()}")
    own = [
        i
        for i, w in enumerate(work)
        if w.factor is None and w.seg.numel and w.seg.v_cross is not None and w.seg.v_cross.numel()
    ]
    made = cross_table([CrossWork(work[i].g, work[i].seg, work[i].hyper, True) for i in own])
    plan = step_plan(work, {i: r.factor for i, r in zip(own, made.views, strict=True)})
    launch_step(plan, work[0].p.device)
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
    scr_keep = torch.empty(max(1, plan.scratch), **f32)
    part_sum = torch.empty(max(1, plan.part), **f64)
    part_max = torch.empty(max(1, plan.part), **f32)
    part_m2 = torch.empty(max(1, plan.part), **f64)
    part_f2 = torch.empty(max(1, plan.part), **f64)
    with _on(device):
        for la in plan.launches:
            kernel = getattr(k, la.kernel)
            head = (la.meta_at, la.hyp_at, la.aux_at, la.prefix_at, la.n)
            if la.kernel == "dense_kernel":
                args = (ints, floats, la.meta_at, la.hyp_at, la.prefix_at, la.n)
            elif la.kernel in ("block_reduce_kernel", "apply_kernel"):
                args = (ints, floats, *head, scr_amax, scr_den, scr_keep)
            elif la.kernel == "col_reduce_kernel":
                args = (ints, floats, *head, part_sum, part_max, part_m2, part_f2)
            elif la.kernel == "col_finish_kernel":
                parts = (part_sum, part_max, part_m2, part_f2)
                args = (ints, floats, *head, *parts, scr_amax, scr_den, scr_keep)
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
    rows (``segment_table.Cross``; contiguous blocks first, then columns; ``order`` maps
    them to the work items), per-row ``CrossHyp`` rows, each launch's prefix of programs (per
    row: cross_rows_kernel's, cross_finish_kernel's, cross_cols_kernel's), the partial sums'
    length, and per work item the ``CrossResult`` of views of the step's buffers its results
    land in (its factor None unless ``whole``)."""

    meta: list[list[int]]
    hyps: list[list[float]]
    order: list[int]
    row_prefix: list[int]
    pos_prefix: list[int]
    col_prefix: list[int]
    part_n: int
    views: list[CrossResult]


def cross_plan(work: list[CrossWork], dest: list[CrossDest | None] | None = None) -> CrossPlan:
    """The launch plan of ``cross_table``: plain numbers and pointers. Contiguous rows get
    min(256, rows / CROSS_ROWS) chunks of tensor rows, scaled down together to keep the
    partial sums within CROSS_PART_BYTES. ``dest``: per item, None or the ``CrossDest`` it is
    to write into (fp64, contiguous, of its v_cross's length, zero where its piece has no
    element: a spread tensor's slot in the all-reduce's buffer, where it is the only piece)."""
    device = work[0].g.device
    dest = dest or [None] * len(work)
    lengths = [w.seg.v_cross.numel() for w in work]
    own = sum(n for n, d in zip(lengths, dest, strict=True) if d is None)
    sums_all = torch.zeros(2 * own, dtype=torch.float64, device=device)
    fac_all = torch.empty(
        sum(n for n, w in zip(lengths, work, strict=True) if w.whole), device=device
    )
    views: list[CrossResult] = []
    at, f_at = 0, 0
    for n, w, d in zip(lengths, work, dest, strict=True):
        f = fac_all[f_at : f_at + n] if w.whole else None
        f_at += n if w.whole else 0
        if d is None:
            views.append(CrossResult(sums_all[at : at + n], sums_all[at + n : at + 2 * n], f))
            at += 2 * n
            continue
        if any(
            x.numel() != n
            or x.dtype != torch.float64
            or not x.is_contiguous()
            or x.device != device
            for x in (d.sums, d.counts)
        ):
            raise ValueError(f"factor destination must be contiguous fp64 of {n} entries")
        views.append(CrossResult(d.sums, d.counts, f))
    rows_kind = [i for i, w in enumerate(work) if w.seg.block_size > 1 and w.seg.numel]
    cols_kind = [i for i, w in enumerate(work) if w.seg.block_size < 0 and w.seg.numel]
    chunks = {}
    for i in rows_kind:
        st = work[i].seg
        chunks[i] = max(
            1, min(256, _cdiv(_cross_rows(st.start, st.numel, st.block_size), CROSS_ROWS))
        )
    part_total = sum(chunks[i] * work[i].seg.block_size for i in rows_kind)
    if 8 * part_total > CROSS_PART_BYTES:
        for i in rows_kind:
            chunks[i] = max(1, chunks[i] * CROSS_PART_BYTES // (8 * part_total))
    plan = CrossPlan([], [], rows_kind + cols_kind, [0], [0], [0], 0, views)
    for i in plan.order:
        g, st, h = work[i].g, work[i].seg, work[i].hyper
        if g.device != device or st.v_cross.device != device:
            raise ValueError("Gefen's factor pass got tensors on several devices in one call")
        if g.dtype not in DTYPES or g.numel() != st.numel:
            raise ValueError(f"factor pass: g of {g.numel()} {g.dtype} for {st.numel} elements")
        v = views[i]
        width, c = abs(st.block_size), chunks.get(i, 0)
        out = 0 if v.factor is None else v.factor.data_ptr()
        plan.meta.append(
            table.cross_row(
                g,
                st,
                sums=v.sums.data_ptr(),
                counts=v.counts.data_ptr(),
                out=out,
                part=plan.part_n,
                chunks=c,
            )
        )
        plan.hyps.append(table.cross_hyper_row(h))
        if st.block_size > 1:
            plan.part_n += c * width
            plan.row_prefix.append(plan.row_prefix[-1] + c * _cdiv(width, CROSS_TILE[1]))
            plan.pos_prefix.append(plan.pos_prefix[-1] + _cdiv(width, CROSS_FINISH))
        else:
            rows = _cross_rows(st.start, st.numel, width)
            plan.col_prefix.append(plan.col_prefix[-1] + _cdiv(rows, CROSS_COLS[0]))
    return plan


def cross_table(work: list[CrossWork], dest: list[CrossDest | None] | None = None) -> CrossPlan:
    """``reference.cross_sums`` of every ``CrossWork`` of one device, and
    ``reference.cross_factor`` of each ``whole`` one (a tensor held whole; v_cross is folded in
    place), in at most four launches (``launch_cross``). Returns the plan it ran, whose
    ``views`` hold a ``CrossResult`` per item, in order: fp64 sums and counts for the
    all-reduce of a spread tensor, written into ``dest`` where given (``cross_plan``)."""
    if not work:
        return CrossPlan([], [], [], [0], [0], [0], 0, [])
    plan = cross_plan(work, dest)
    launch_cross(plan, work[0].g.device)
    for w, r in zip(work, plan.views, strict=True):
        if w.whole and not w.seg.numel:  # nothing launched for it: the reference's factor of 0s
            r.factor.copy_(cross_factor(w.seg, w.hyper, cross_mean(r.sums, r.counts)))
    return plan


def factor_plan(work: list[FactorWork]) -> CrossPlan:
    """``factors``' launch plan: factor rows only (no sums to compute), their sums and counts
    moved to v_cross's device as contiguous fp64 (``views`` keeps them alive until launched)."""
    device = work[0].seg.v_cross.device
    out = torch.empty(sum(w.seg.v_cross.numel() for w in work), device=device)
    plan = CrossPlan([], [], [], [0], [0], [0], 0, [])
    at = 0
    for w in work:
        st = w.seg
        n = st.v_cross.numel()
        if w.sums.numel() != n or w.counts.numel() != n:
            raise ValueError(
                f"factor sums/counts have {w.sums.numel()}/{w.counts.numel()} entries, v_cross {n}"
            )
        sums, counts = (x.to(device, torch.float64).contiguous() for x in (w.sums, w.counts))
        f, at = out[at : at + n], at + n
        plan.views.append(CrossResult(sums, counts, f))
        plan.meta.append(
            table.cross_row(None, st, sums.data_ptr(), counts.data_ptr(), out=f.data_ptr())
        )
        plan.hyps.append(table.cross_hyper_row(w.hyper))
    return plan


def factors(work: list[FactorWork]) -> list[torch.Tensor]:
    """``reference.cross_factor(st, h, cross_mean(sums, counts))`` of every ``FactorWork`` of one
    device in one launch, v_cross folded in place: the factors of tensors spread over ranks,
    from their all-reduced sums."""
    if not work:
        return []
    plan = factor_plan(work)
    launch_cross(plan, work[0].seg.v_cross.device)
    return [r.factor for r in plan.views]


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
    row = {
        Hist.G: g.data_ptr(),
        Hist.G_DTYPE: DTYPES[g.dtype],
        Hist.START: start,
        Hist.NUMEL: numel,
        Hist.BLOCK: block,
        Hist.BLOCKS: nb,
        Hist.BINS: counts.numel(),
        Hist.COUNTS: counts.data_ptr(),
    }
    ints = _to_device(array("q", table.as_row(row, Hist)), torch.int64, g.device)
    amax = {HistAmax.HEAD: head_amax, HistAmax.TAIL: tail_amax}
    floats = _to_device(array("f", table.as_row(amax, HistAmax)), torch.float32, g.device)
    with _on(g.device):
        _launch(k.histogram_kernel, nb, ints, floats, TILE=TILE)
