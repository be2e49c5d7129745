"""The CUDA backend (``csrc/gefen_cuda.cu``): JIT-built with torch's cpp_extension, cached.

Why a segment table: a step touches hundreds of tensors, and FSDP/ZeRO hand each rank pieces of
many tensors in one flat buffer; one row per segment (pointers, offsets, block size, dtypes, the
step's hyperparameters) lets three launches cover every blocked and B = 1 segment of a step,
four the column segments and four the factor's pass, whatever the model; an lr schedule
changes only a row's numbers, never the kernels.

The build needs ninja, nvcc and a CUDA build of torch; it goes to ``$GEFEN_CACHE_DIR``
(default ``~/.cache/gefen_dist``) keyed by the sources, torch's version and the architectures
it is built for (every visible GPU's, or ``$TORCH_CUDA_ARCH_LIST``), so a second process loads
it in a second. When it cannot be built, or its
self-check against the reference fails on a device (``_verified``), ``available(device)`` is
False and ``build_error()`` says why; Gefen then runs the reference update and says so once.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import segment_table as table
from .codes import unpack4
from .reference import Hyper, SegmentState, cross_factor, cross_mean
from .segments import num_blocks

CSRC = Path(__file__).resolve().parent.parent / "csrc"
SOURCES = [CSRC / "gefen_cuda_binding.cpp", CSRC / "gefen_cuda.cu"]
HEADERS = [CSRC / "gefen_cuda.h"]
CUDA_FLAGS = ["-O3", "--fmad=false"]
WIDE = 1024
"""Blocks of at least this many elements get a whole thread block (256 threads), shorter ones
a warp: a warp alone would leave most of a long block's bandwidth unused, a thread block on a
short one would idle most of its threads."""
DTYPES = table.DTYPES

_ext: Any = None
_error: str | None = None


def _build() -> Any:
    if not torch.cuda.is_available():
        raise RuntimeError("CUDA is not available")
    if torch.version.cuda is None:
        raise RuntimeError("this torch is a CPU build")
    missing = [str(p) for p in SOURCES + HEADERS if not p.exists()]
    if missing:
        raise RuntimeError(f"sources not found: {missing} (an install without csrc/)")
    from torch.utils.cpp_extension import load

    # every visible GPU's architecture (a node may mix generations), or the user's own list
    caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST") or ";".join(f"{a}.{b}" for a, b in sorted(caps))
    h = hashlib.sha256()
    for p in SOURCES + HEADERS:
        h.update(p.read_bytes())
    h.update(f"{torch.__version__} {torch.version.cuda} {archs} {CUDA_FLAGS}".encode())
    cache = Path(os.environ.get("GEFEN_CACHE_DIR", Path.home() / ".cache" / "gefen_dist"))
    build = cache / f"cuda_{h.hexdigest()[:16]}"
    build.mkdir(parents=True, exist_ok=True)
    before = os.environ.get("TORCH_CUDA_ARCH_LIST")
    os.environ["TORCH_CUDA_ARCH_LIST"] = archs  # cpp_extension reads it; the caller's is restored
    try:
        return load(
            name="gefen_cuda_ext",
            sources=[str(p) for p in SOURCES],
            extra_cflags=["-O3"],
            extra_cuda_cflags=CUDA_FLAGS,
            extra_include_paths=[str(CSRC)],
            build_directory=str(build),
            verbose=False,
        )
    finally:
        if before is None:
            del os.environ["TORCH_CUDA_ARCH_LIST"]
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = before


def load() -> Any:
    """The extension, built on first call; None (and ``build_error()``) when it cannot be."""
    global _ext, _error
    if _ext is None and _error is None:
        try:
            _ext = _build()
        except Exception as e:  # any failure leaves the reference update in charge
            _error = f"{type(e).__name__}: {e}"
    return _ext


def available(device: torch.device | None = None) -> bool:
    """Built, and (with ``device``) passed the self-check on that device."""
    if load() is None:
        return False
    return device is None or _verified(device)


_checked: dict[str, bool] = {}


def _verified(device: torch.device) -> bool:
    """Run the kernels once per device on a small awkward layout against the reference
    (4-bit blocks of odd length from an odd start, so bytes are shared; 8-bit; B = 1; bf16).
    Why: a kernel that miscompiles or misbehaves on a device must not corrupt a training run;
    on a mismatch the reference update runs instead and ``build_error()`` says why."""
    global _error
    key = str(device)
    if key not in _checked:
        try:
            _self_check(device)
            _checked[key] = True
        except Exception as e:
            _error = f"self-check on {key} failed: {type(e).__name__}: {e}"
            _checked[key] = False
    return _checked[key]


def _self_check(device: torch.device) -> None:
    from . import codebook as cb
    from .codes import midpoints
    from .reference import block_update, column_update, cross_length, dense_update

    gen = torch.Generator().manual_seed(0)
    for bits, dtype, start, numel, block in [
        (4, torch.float32, 37, 4001, 97),
        (8, torch.bfloat16, 0, 3000, 1000),
        (4, torch.float32, 0, 777, 1),
        (4, torch.float32, 37, 4001, -97),
        (8, torch.float16, 5, 9000, -300),
    ]:
        rand = torch.rand(4096, generator=gen, device="cpu")
        levels = cb.learn_codebook(cb.histogram(rand * 2 - 1), bits)
        levels, mids = levels.to(device), midpoints(levels).to(device)
        p0 = torch.randn(numel, generator=gen, device="cpu").to(device, dtype)
        sts, ps = [], []
        for _ in range(2):
            nb = num_blocks(start, numel, block)
            st = SegmentState(start, numel, block)
            if block == 1:
                st.exp_avg = torch.zeros(numel, dtype=torch.bfloat16, device=device)
                st.exp_avg_sq = torch.zeros(numel, dtype=torch.bfloat16, device=device)
            else:
                st.codes = torch.zeros(
                    numel if bits == 8 else (numel + 1) // 2, dtype=torch.uint8, device=device
                )
                st.absmax = torch.zeros(nb, device=device)
                st.v = torch.zeros(nb, device=device)
                st.v_cross = torch.zeros(cross_length(block, start + numel), device=device)
            sts.append(st)
            ps.append(p0.clone())
        for t in range(1, 4):
            g = torch.randn(numel, generator=gen, device="cpu").to(device, dtype)
            h = Hyper(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, step=t)
            before = ps[0].clone()
            if block == 1:
                dense_update(ps[0], g, sts[0], h)
            elif block < 0:
                column_update(ps[0], g, sts[0], h, levels, mids, bits)
            else:
                block_update(ps[0], g, sts[0], h, levels, mids, bits)
            step([(ps[1], g, sts[1], h, levels, mids, bits)])
            torch.cuda.synchronize(device)
            agree(ps[1], sts[1], ps[0], sts[0], before, bits, f"step {t}, bits={bits}, B={block}")
            ps[1].copy_(ps[0])  # from the same state again: one step's differences only
            for k in STATE_FIELDS:
                if getattr(sts[0], k) is not None:
                    getattr(sts[1], k).copy_(getattr(sts[0], k))


STATE_FIELDS = ("codes", "absmax", "v", "v_cross", "exp_avg", "exp_avg_sq")
PARAM_RTOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
"""How far a kernel's parameters may sit from the reference's after one step, relative to the
step's operands, by parameter dtype (``agree``; launch/gpu_check.py's layouts)."""


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
    state. The reference on the device runs torch's kernels, which contract multiply-adds and
    divide by a scalar through its reciprocal where the extension does neither, so an fp32
    result can sit an ulp away, and a code flips where m / absmax lies within that ulp of a
    midpoint or of its stochastic threshold: rare, but over thousands of elements not
    negligible, and before this allowance one such flip made the next step's parameters fail
    and the backend switch itself off. At most one code in 500 may differ, each by one level; a
    wrong kernel differs in whole blocks, in the bytes blocks share, or everywhere. Everything
    else within its tolerance, the parameters relative to the step's operands (``before``, the
    parameter before the step), as where a step nearly cancels p an ulp of the step is far
    more of the result."""
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


def build_error() -> str | None:
    load()
    return _error


def supports(p: torch.Tensor, g: torch.Tensor) -> bool:
    return p.device.type == "cuda" and p.dtype in DTYPES and g.dtype in DTYPES


@dataclass
class ColumnLaunch:
    """Where ``launch_columns``' arrays sit in a StepPlan's buffers: ``n`` table rows from
    ``meta_at`` (ints) and ``hyp_at`` (floats), then from ``aux_at`` the aux rows (ColumnAux) and
    the reduce, column and unit prefixes; the grids; the scratch: ``part_n`` partial sums and
    maxima, ``col_n`` denominators and new maxima."""

    n: int
    meta_at: int
    hyp_at: int
    aux_at: int
    reduce_blocks: int
    col_blocks: int
    unit_blocks: int
    part_n: int
    col_n: int


@dataclass
class StepPlan:
    """One step's tables on the host: every launch's integers (meta rows, then its prefix) in
    ``ints`` and hyperparameter rows in ``floats``, flat arrays that reach the device in two
    copies. ``launches``: (group, segments, where its rows start in ints, in floats, work items);
    ``columns``: the column segments' launch, if any; ``rows``: per row, (work item, where it
    starts in ints, in floats), for ``cuda_plan.CudaPlan`` to rewrite."""

    ints: array
    floats: array
    launches: list[tuple[str, int, int, int, int]]
    columns: ColumnLaunch | None
    rows: list[tuple[int, int, int]]
    factors: list  # this step's cross factors, alive until the launches are queued


def step_plan(work: list[tuple], made: dict[int, torch.Tensor | None], dense_tile: int) -> StepPlan:
    """The host side of ``step``: ``made`` holds the factors computed for items without one."""
    device = work[0][0].device
    groups: dict[str, tuple[list, list, list, list]] = {
        "narrow": ([], [], [], []),
        "wide": ([], [], [], []),
        "dense": ([], [], [], []),
    }
    columns, factors = [], []
    for i, (p, g, st, h, levels, mids, bits, *given) in enumerate(work):
        if st.numel == 0:
            continue
        if p.device != device or g.device != device:
            raise ValueError("Gefen's CUDA step got tensors on several devices in one call")
        f = given[0] if given else made.get(i)
        factors.append(f)
        row, hyp = table.row(p, g, st, levels, mids, bits, h.step, f), table.hyper_row(h)
        if st.block_size < 0:
            columns.append((row, hyp, st, bits, i))
            continue
        if st.block_size == 1:
            key, count = "dense", -(-st.numel // dense_tile)
        else:
            key = "wide" if st.block_size >= WIDE else "narrow"
            count = num_blocks(st.start, st.numel, st.block_size)
        rows, hyps, counts, items = groups[key]
        rows.append(row)
        hyps.append(hyp)
        counts.append(count)
        items.append(i)
    ints: list[int] = []
    floats: list[float] = []
    plan = StepPlan(array("q"), array("f"), [], None, [], factors)
    mc, hc = table.META_COLS, table.HYP_COLS
    for key, (rows, hyps, counts, items) in groups.items():
        if rows:
            prefix = list(itertools.accumulate(counts, initial=0))
            plan.launches.append((key, len(rows), len(ints), len(floats), prefix[-1]))
            plan.rows += [
                (i, len(ints) + r * mc, len(floats) + r * hc) for r, i in enumerate(items)
            ]
            ints += [x for r in rows for x in r] + prefix
            floats += [x for r in hyps for x in r]
    if columns:
        at = (len(ints), len(floats))
        for row, hyp, _, _, i in columns:
            plan.rows.append((i, len(ints), len(floats)))
            ints += row
            floats += hyp
        aux, reduce, cols, units, part, col = [], [0], [0], [0], 0, 0
        shapes = _column_chunks([st for _, _, st, _, _ in columns])
        for (_, _, st, bits, _), (chunks, per, nb) in zip(columns, shapes, strict=True):
            aux += [part, col, chunks, per]
            part, col = part + chunks * nb, col + nb
            tiles = -(-nb // THREADS)
            reduce.append(reduce[-1] + tiles * chunks)
            cols.append(cols[-1] + tiles)
            units.append(
                units[-1] + -(-((st.numel + 1) // 2 if bits == 4 else st.numel) // THREADS)
            )
        plan.columns = ColumnLaunch(
            len(columns), *at, len(ints), reduce[-1], cols[-1], units[-1], part, col
        )
        ints += aux + reduce + cols + units
    plan.ints.extend(ints)
    plan.floats.extend(floats)
    return plan


def step(work: list[tuple]) -> StepPlan | None:
    """Run every (p, g, segment views, Hyper, levels, mids, bits[, factor]) of one device: three
    launches for all blocked and B = 1 segments, four for all column segments, their tables in
    two host-to-device copies (``step_plan``). Flat 1-D contiguous views; the optimizer
    guarantees it. ``factor`` as ``native_cpu.step``'s. Returns the plan it ran."""
    ext = load()
    if not work:
        return None
    # factors not given (a tensor held whole, called without the optimizer): one factor pass
    own = [
        i
        for i, (_, g, st, h, *_rest) in enumerate(work)
        if len(_rest) == 3 and st.numel and st.v_cross is not None and st.v_cross.numel()
    ]
    made = cross_table([(work[i][1], work[i][2], work[i][3], True) for i in own]).views
    plan = step_plan(work, {i: f for i, (*_, f) in zip(own, made, strict=True)}, ext.DENSE_TILE)
    launch_step(plan, work[0][0].device)
    return plan


def launch_step(plan: StepPlan, device: torch.device) -> None:
    """The launches of a step plan: its two arrays copied to the device, views of them each
    launch's table."""
    ext = load()
    if not plan.ints:
        return
    ints = torch.frombuffer(plan.ints, dtype=torch.int64).pin_memory()
    ints = ints.to(device, non_blocking=True)
    floats = torch.frombuffer(plan.floats, dtype=torch.float32).pin_memory()
    floats = floats.to(device, non_blocking=True)
    mc, hc = table.META_COLS, table.HYP_COLS

    def rows_at(a: int, b: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return ints[a : a + n * mc].view(n, mc), floats[b : b + n * hc].view(n, hc)

    with torch.cuda.device(device):
        stream = torch.cuda.current_stream(device).cuda_stream
        for key, n, a, b, total in plan.launches:
            meta, hyp = rows_at(a, b, n)
            pre = ints[a + n * mc : a + n * mc + n + 1]
            if key == "dense":
                ext.dense(meta, hyp, pre, total, stream)
            else:
                ext.blocks(meta, hyp, pre, total, 256 if key == "wide" else 32, stream)
        c = plan.columns
        if c is None:
            return
        meta, hyp = rows_at(c.meta_at, c.hyp_at, c.n)
        a, n = c.aux_at, c.n
        aux = ints[a : a + 4 * n].view(n, 4)
        reduce, cols, units = (ints[a + 4 * n + k * (n + 1) :][: n + 1] for k in range(3))
        part_sum = torch.empty(c.part_n, dtype=torch.float64, device=device)
        part_max = torch.empty(c.part_n, dtype=torch.float32, device=device)
        small = torch.empty(2, c.col_n, dtype=torch.float32, device=device)
        grids = (c.reduce_blocks, c.col_blocks, c.unit_blocks)
        ext.columns(
            meta,
            hyp,
            aux,
            reduce,
            grids[0],
            cols,
            grids[1],
            units,
            grids[2],
            part_sum,
            part_max,
            small[0],
            small[1],
            stream,
        )


CROSS_ROWS = 32
"""Tensor rows per thread in the factor's pass over contiguous blocks, with at most 256 chunks
of rows per segment: enough threads to fill the device on a tall tensor."""
CROSS_PART_BYTES = 16 << 20
"""The most the factor's partial sums may take for a whole step (fp64, chunks x B per segment);
over it, every segment's chunks shrink in proportion. With COLUMN_PART_BYTES (the two are never
held at once) it keeps the step's scratch near 64 MiB on the largest models: the sums and factors
themselves take 20 bytes per v_cross entry (fp64 sums and counts, the fp32 factor)."""
CROSS_META_COLS = 12  # csrc/gefen_cuda.h, Cross
THREADS = 256  # csrc/gefen_cuda.cu, kThreads: cross_rows_kernel's tile of positions


def _cross_rows(start: int, numel: int, width: int) -> int:
    """Tensor rows of width ``width`` that a piece of ``numel`` elements from ``start`` touches."""
    return (start + numel - 1) // width - start // width + 1


@dataclass
class CrossPlan:
    """What ``launch_cross`` gets for one step's factored segments of one device: the table rows
    (contiguous blocks first, then columns; ``order`` maps them to the work items), per-row
    hyperparameters, the three prefixes, the partial sums' length, and per work item the views
    of the step's buffers its results land in: (sums, counts, factor or None)."""

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
    """The launch plan of ``cross_table``, on whatever device the tensors are: plain numbers
    and pointers, so the index arithmetic is checked on the CPU too (tests/test_cuda_plans.py).
    Contiguous rows get min(256, rows / CROSS_ROWS) chunks, scaled down together to keep the
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
        if any(x.numel() != n or x.dtype != torch.float64 or not x.is_contiguous() for x in d):
            raise ValueError(f"factor destination must be contiguous fp64 of {n} entries")
        views.append((*d, f))
    rows_kind = [i for i, (_, st, _, _) in enumerate(work) if st.block_size > 1 and st.numel]
    cols_kind = [i for i, (_, st, _, _) in enumerate(work) if st.block_size < 0 and st.numel]
    chunks = {}
    for i in rows_kind:
        st = work[i][1]
        rows = _cross_rows(st.start, st.numel, st.block_size)
        chunks[i] = max(1, min(256, -(-rows // CROSS_ROWS)))
    part_total = sum(chunks[i] * work[i][1].block_size for i in rows_kind)
    if 8 * part_total > CROSS_PART_BYTES:
        for i in rows_kind:
            chunks[i] = max(1, chunks[i] * CROSS_PART_BYTES // (8 * part_total))
    plan = CrossPlan([], [], rows_kind + cols_kind, [0], [0], [0], 0, views)
    for i in plan.order:
        g, st, h, _ = work[i]
        if g.device != device or st.v_cross.device != device:
            raise ValueError("Gefen's factor pass got tensors on several devices in one call")
        sums, counts, f = views[i]
        width, c = abs(st.block_size), chunks.get(i, 0)
        ptrs = [sums.data_ptr(), counts.data_ptr(), st.v_cross.data_ptr()]
        row = [g.data_ptr(), DTYPES[g.dtype], st.start, st.numel, st.block_size, lengths[i], *ptrs]
        plan.meta.append(row + [0 if f is None else f.data_ptr(), plan.part_n, c])
        plan.hyps.append(table.cross_hyper_row(h))
        if st.block_size > 1:
            plan.part_n += c * width
            plan.row_prefix.append(plan.row_prefix[-1] + c * -(-width // THREADS))
            plan.pos_prefix.append(plan.pos_prefix[-1] + width)
        else:
            plan.col_prefix.append(plan.col_prefix[-1] + _cross_rows(st.start, st.numel, width))
    return plan


def cross_table(
    work: list[tuple[torch.Tensor, SegmentState, Hyper, bool]], dest: list[Dest] | None = None
) -> CrossPlan:
    """``reference.cross_sums`` of every (g, segment, h, whole) of one device, and
    ``reference.cross_factor`` of each ``whole`` one (a tensor held whole; v_cross is folded in
    place), in four launches (``launch_cross``). Why: the torch ops of ``reference.cross_sums``
    run per chunk of 2^16 elements, a few launches each, so on a GPU a step of a 1B-parameter
    model would have spent its time launching them. Returns the plan it ran, whose ``views``
    hold (sums, counts, factor or None) per item, in order: fp64 sums and counts for the
    all-reduce of a spread tensor, written into ``dest`` where given (``cross_plan``)."""
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
    plan = CrossPlan([], [], [], [0], [0], [0] * (len(work) + 1), 0, [])
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
    """``launch_cross`` of a plan, its integers in one host-to-device copy and its
    hyperparameters in another."""
    ext = load()
    if not plan.meta:
        return
    nr = len(plan.row_prefix) - 1
    flat = [x for r in plan.meta for x in r] + plan.row_prefix + plan.pos_prefix + plan.col_prefix
    ints = (
        torch.tensor(flat, dtype=torch.int64, device="cpu")
        .pin_memory()
        .to(device, non_blocking=True)
    )
    hyp = (
        torch.tensor(plan.hyps, dtype=torch.float32, device="cpu")
        .pin_memory()
        .to(device, non_blocking=True)
    )
    k = len(plan.meta) * CROSS_META_COLS
    m_dev = ints[:k].view(len(plan.meta), CROSS_META_COLS)
    rp, pp, cp = ints[k : k + nr + 1], ints[k + nr + 1 : k + 2 * nr + 2], ints[k + 2 * nr + 2 :]
    part = torch.empty(plan.part_n, dtype=torch.float64, device=device)
    items = (plan.row_prefix[-1], plan.pos_prefix[-1], plan.col_prefix[-1])
    with torch.cuda.device(device):
        stream = torch.cuda.current_stream(device).cuda_stream
        ext.cross(m_dev, hyp, nr, rp, items[0], pp, items[1], cp, items[2], part, stream)


COLUMN_ROWS = 32
"""Rows per thread in the column segments' reduction pass, with at most 128 chunks of rows per
segment: enough threads to fill the device on a tall tensor."""
COLUMN_PART_BYTES = 48 << 20
"""The most the column segments' partial sums and maxima may take for a whole step (12 bytes
per column and chunk); over it, every segment's chunks shrink in proportion."""


def _column_chunks(sts: list[SegmentState]) -> list[tuple[int, int, int]]:
    """Each column segment's chunks of rows, rows per chunk and columns (``launch_columns``)."""
    want = []
    for st in sts:
        rows = -(-st.numel // -st.block_size)
        want.append(
            (max(1, min(128, -(-rows // COLUMN_ROWS))), rows, min(st.numel, -st.block_size))
        )
    total = 12 * sum(c * nb for c, _, nb in want)
    out = []
    for chunks, rows, nb in want:
        if total > COLUMN_PART_BYTES:
            chunks = max(1, chunks * COLUMN_PART_BYTES // total)
        per = -(-rows // chunks)
        out.append((-(-rows // per), per, nb))
    return out


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
    first / last block with the whole block's."""
    ext = load()
    with torch.cuda.device(g.device):
        stream = torch.cuda.current_stream(g.device).cuda_stream
        ext.histogram(g, start, block, head_amax, tail_amax, counts, stream)
