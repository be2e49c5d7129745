"""The CUDA backend's host side, checked on the CPU: the step's tables (``native_cuda.step_plan``:
every launch's rows in two buffers) and the factor pass's launch plans (``cross_plan``,
``factor_plan``) with the index arithmetic of its kernels: ``emulate`` runs csrc/gefen_cuda.cu's
cross_rows_kernel, cross_finish_kernel, cross_cols_kernel and cross_factor_kernel line by line
over a plan's own numbers (a thread block or warp at a time, its threads as a vector), and the
sums, counts, folded v_cross and factors must equal the reference's on pieces of awkward
layouts, several in one plan. What this cannot catch is a CUDA line that differs from its
emulation: ``native_cuda``'s self-check and ``launch/gpu_check.py`` run the kernels themselves."""

import math
from array import array

import pytest
import torch

from gefen_dist import Gefen, Segment, codebook, native_cuda, segment_table, state
from gefen_dist.codes import midpoints
from gefen_dist.cuda_plan import CudaPlan
from gefen_dist.reference import (
    Hyper,
    SegmentState,
    cross_factor,
    cross_length,
    cross_mean,
    cross_sums,
)
from gefen_dist.segments import num_blocks

THREADS = native_cuda.THREADS
(G, G_DTYPE, START, NUMEL, BLOCK, LENGTH, SUMS, COUNTS, V_CROSS, OUT, PART, CHUNKS) = range(
    native_cuda.CROSS_META_COLS
)


def _find(prefix: list[int], item: int) -> int:
    """find_segment: the largest s with prefix[s] <= item"""
    return max(s for s in range(len(prefix) - 1) if prefix[s] <= item)


def emulate(plan: native_cuda.CrossPlan, tensors: dict[int, torch.Tensor]) -> None:
    """launch_cross over ``plan``, reading and writing the tensors its pointers name."""
    meta, nr = plan.meta, len(plan.row_prefix) - 1
    part = torch.full((plan.part_n,), float("nan"), dtype=torch.float64)
    lane = torch.arange(THREADS)
    for block in range(plan.row_prefix[-1]):  # cross_rows_kernel
        s = _find(plan.row_prefix, block)
        m = meta[s]
        width, start, numel = m[BLOCK], m[START], m[NUMEL]
        tiles, local = -(-width // THREADS), block - plan.row_prefix[s]
        chunk, j = local // tiles, (local % tiles) * THREADS + lane
        j = j[j < width]
        first = start // width
        rows = (start + numel - 1) // width - first + 1
        per = -(-rows // m[CHUNKS])
        r0 = first + chunk * per
        g = tensors[m[G]].double()
        acc = torch.zeros(len(j), dtype=torch.float64)
        for r in range(r0, min(r0 + per, first + rows)):
            i = r * width + j - start
            ok = (i >= 0) & (i < numel)
            acc += torch.where(ok, g[i.clamp(0, numel - 1)] ** 2, 0.0)
        part[m[PART] + chunk * width + j] = acc
    for item in range(plan.pos_prefix[-1]):  # cross_finish_kernel, a thread at a time
        s = _find(plan.pos_prefix, item)
        m = meta[s]
        width, start, end = m[BLOCK], m[START], m[START] + m[NUMEL]
        j = item - plan.pos_prefix[s]
        total = 0.0
        for c in range(m[CHUNKS]):
            total += part[m[PART] + j + c * width].item()
        e0 = start + (int(math.fmod(j - start % width, width)) + width) % width
        tensors[m[SUMS]][j] = total
        tensors[m[COUNTS]][j] = 1 + (end - 1 - e0) // width if e0 < end else 0
    for item in range(plan.col_prefix[-1]):  # cross_cols_kernel, a warp at a time
        s = _find(plan.col_prefix, item)
        m = meta[nr + s]
        period, start, numel = -m[BLOCK], m[START], m[NUMEL]
        r = start // period + item - plan.col_prefix[s]
        lo, hi = max(r * period, start) - start, min((r + 1) * period, start + numel) - start
        tensors[m[SUMS]][r] = (tensors[m[G]][lo:hi].double() ** 2).sum()
        tensors[m[COUNTS]][r] = hi - lo
    for m, h in zip(meta, plan.hyps, strict=True):  # cross_factor_kernel
        if not m[OUT]:
            continue
        sums, counts, v = (tensors[m[k]] for k in (SUMS, COUNTS, V_CROSS))
        before = (v.double().sum() / m[LENGTH]).float()
        if before > 0:  # the factor from v_cross as the steps before left it
            tensors[m[OUT]].copy_((v / before).clamp(min=h[3]).sqrt() / torch.tensor(h[2]))
        mean = torch.where(counts > 0, sums / counts.clamp(min=1), 0.0).float()
        v.copy_(v * h[0] + torch.tensor(h[1]) * mean)
        if before > 0:
            continue
        total = (v.double().sum() / m[LENGTH]).float()
        total = total if total > 0 else torch.tensor(1.0)
        tensors[m[OUT]].copy_((v / total).clamp(min=h[3]).sqrt() / torch.tensor(h[2]))


def _pieces(specs, seed=0):
    """(g, state, h, whole) per (tensor numel, block, start, numel, dtype): a piece of a tensor,
    its v_cross of the tensor's length, random and positive."""
    gen = torch.Generator().manual_seed(seed)
    work = []
    for t, (total, block, start, numel, dtype) in enumerate(specs):
        st = SegmentState(start, numel, block)
        st.v_cross = torch.rand(cross_length(block, total), generator=gen) + 0.1
        g = (torch.randn(numel, generator=gen) * (1 + t)).to(dtype)
        h = Hyper(lr=1e-3, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, step=3 + t)
        work.append((g, st, h, start == 0 and numel == total))
    return work


def _tensors(work, plan) -> dict[int, torch.Tensor]:
    named = {}
    for (g, st, _, _), views in zip(work, plan.views, strict=True):
        for t in (g, st.v_cross, *views):
            if t is not None:
                named[t.data_ptr()] = t
    return named


LAYOUTS = [
    (300 * 70, 300, 0, 300 * 70, torch.float32),  # two tiles of positions, three chunks
    (97 * 600, 97, 1234, 5000, torch.float32),  # a piece cut mid-row at both ends
    (300 * 40, 300, 10, 50, torch.bfloat16),  # a piece inside one row
    (64 * 50, -64, 0, 64 * 50, torch.float32),  # column blocks, whole
    (300 * 30, -300, 37, 1000, torch.float16),  # column blocks, a piece cut mid-row
    (513 * 33, 513, 0, 513 * 33, torch.float32),  # odd width over three tiles
]


# min(256, ceil(rows / 32)) chunks for 70, 53, 1 and 33 rows; a budget that binds leaves one each
@pytest.mark.parametrize(
    "budget, chunks", [(native_cuda.CROSS_PART_BYTES, [3, 2, 1, 2]), (8 * 600, [1, 1, 1, 1])]
)
def test_cross_plan_and_kernels_give_the_reference_sums_and_factors(monkeypatch, budget, chunks):
    monkeypatch.setattr(native_cuda, "CROSS_PART_BYTES", budget)
    work = _pieces(LAYOUTS)
    work[5][1].v_cross.zero_()  # a first step: the factor from this step's fold
    expect = []
    for g, st, h, whole in work:
        sums, counts = cross_sums(g, st.start, st.block_size, st.v_cross.numel())
        f = None
        if whole:
            twin = SegmentState(st.start, st.numel, st.block_size)
            twin.v_cross = st.v_cross.clone()
            f = (cross_factor(twin, h, cross_mean(sums, counts)), twin.v_cross)
        expect.append((sums, counts, f))
    plan = native_cuda.cross_plan(work)
    assert [m[CHUNKS] for m in plan.meta if m[BLOCK] > 1] == chunks
    emulate(plan, _tensors(work, plan))
    for (_, st, _, whole), (sums, counts, f), (e_sums, e_counts, e_f) in zip(
        work, plan.views, expect, strict=True
    ):
        assert torch.equal(counts, e_counts)
        torch.testing.assert_close(sums, e_sums, rtol=1e-12, atol=0)
        assert (f is None) == (not whole)
        if whole:
            torch.testing.assert_close(f, e_f[0], rtol=2e-7, atol=0)
            torch.testing.assert_close(st.v_cross, e_f[1], rtol=2e-7, atol=0)


def test_cross_plan_writes_a_spread_pieces_sums_into_its_slot():
    """A spread tensor's only piece on a rank writes its sums and counts straight into its slot
    of the all-reduce's buffer (``dest``), entries its piece does not reach left at zero; a
    piece without a slot keeps the plan's own buffer; a wrong slot is refused."""
    work = _pieces([LAYOUTS[1], LAYOUTS[4], LAYOUTS[2]], seed=2)
    lengths = [st.v_cross.numel() for _, st, _, _ in work]
    buf = torch.zeros(2 * (sum(lengths[:2]) + 5), dtype=torch.float64)
    total = sum(lengths[:2]) + 5
    slots = [(5, lengths[0]), (5 + lengths[0], lengths[1])]
    dest = [(buf[a : a + n], buf[total + a : total + a + n]) for a, n in slots] + [None]
    plan = native_cuda.cross_plan(work, dest)
    for (sums, counts, _), d in zip(plan.views, dest, strict=True):
        if d is not None:
            assert sums.data_ptr() == d[0].data_ptr() and counts.data_ptr() == d[1].data_ptr()
    emulate(plan, _tensors(work, plan))
    for (g, st, _, _), (sums, counts, _) in zip(work, plan.views, strict=True):
        e_sums, e_counts = cross_sums(g, st.start, st.block_size, st.v_cross.numel())
        assert torch.equal(counts, e_counts)
        torch.testing.assert_close(sums, e_sums, rtol=1e-12, atol=0)
    assert not buf[:5].any() and not buf[total : total + 5].any()
    with pytest.raises(ValueError, match="contiguous fp64 of"):
        native_cuda.cross_plan(work[:1], [(buf[:3], buf[3:6])])


def test_factor_plan_folds_all_reduced_sums_as_the_reference():
    work = _pieces(LAYOUTS[1:2] + LAYOUTS[4:5], seed=1)
    items, expect = [], []
    for g, st, h, _ in work:
        sums, counts = cross_sums(g, st.start, st.block_size, st.v_cross.numel())
        sums, counts = sums * 3, counts * 3  # as if three ranks had added theirs
        twin = SegmentState(st.start, st.numel, st.block_size)
        twin.v_cross = st.v_cross.clone()
        expect.append(cross_factor(twin, h, cross_mean(sums, counts)))
        items.append((st, h, sums.float(), counts))  # not fp64: the plan converts
    plan = native_cuda.factor_plan(items)
    assert plan.row_prefix == [0] and plan.col_prefix == [0, 0, 0] and plan.part_n == 0
    named = {t.data_ptr(): t for st, *_ in items for t in (st.v_cross,)}
    for views in plan.views:
        assert views[0].dtype == torch.float64 and views[0].is_contiguous()
        named.update({t.data_ptr(): t for t in views})
    emulate(plan, named)
    for (*_, f), e in zip(plan.views, expect, strict=True):
        torch.testing.assert_close(f, e, rtol=2e-7, atol=0)


def test_factor_plan_refuses_sums_of_the_wrong_length():
    [(_, st, h, _)] = _pieces(LAYOUTS[:1])
    with pytest.raises(ValueError, match="v_cross 300"):
        native_cuda.factor_plan([(st, h, torch.zeros(299, dtype=torch.float64), torch.ones(300))])


def test_step_plan_packs_every_launch_and_column_row_where_step_reads_them():
    """Segments of each launch group in work order (narrow blocks, blocks of WIDE or more,
    B = 1), then column rows; an empty segment gets none. Read back the way ``step`` slices."""
    levels = codebook.learn_codebook(codebook.histogram(torch.linspace(-1, 1, 999)), 4)
    mids = midpoints(levels)
    specs = [  # (start, numel, block); the group it belongs to
        ((5, 300, 64), "narrow"),
        ((0, 4096, 2048), "wide"),
        ((3, 777, 1), "dense"),
        ((37, 1000, -100), None),
        ((0, 0, 64), None),
        ((0, 640, 32), "narrow"),
        ((1, 1025, -64), None),  # odd: 513 bytes at 4 bits, three tiles
    ]
    work = []
    for t, ((start, numel, block), _) in enumerate(specs):
        st = SegmentState(start, numel, block)
        nb = -(-(start % abs(block) + numel) // abs(block)) if block > 0 else abs(block)
        if block == 1:
            st.exp_avg = torch.zeros(numel, dtype=torch.bfloat16)
            st.exp_avg_sq = torch.zeros(numel, dtype=torch.bfloat16)
        else:
            st.codes = torch.zeros((numel + 1) // 2, dtype=torch.uint8)
            st.absmax, st.v = torch.zeros(nb), torch.zeros(nb)
        p, g = torch.zeros(numel), torch.zeros(numel)
        h = Hyper(lr=1e-3 * (t + 1), beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, step=t + 1)
        work.append((p, g, st, h, levels, mids, 4))
    made = {1: torch.ones(2048)}  # a factor computed for item 1
    plan = native_cuda.step_plan(work, made, dense_tile=2048)
    mc, hc = segment_table.META_COLS, segment_table.HYP_COLS

    def expect(i):
        p, g, st, h, lv, md, bits = work[i]
        hyp = array("f", segment_table.hyper_row(h))  # fp32, as the device reads it
        return segment_table.row(p, g, st, lv, md, bits, h.step, made.get(i)), hyp

    groups = {}
    for i, (_, group) in enumerate(specs):
        if group:
            groups.setdefault(group, []).append(i)
    assert [(k, n) for k, n, *_ in plan.launches] == [(k, len(v)) for k, v in groups.items()]
    rows = []  # where each segment's row is: what CudaPlan rewrites
    for key, n, a, b, total in plan.launches:
        counts = []
        for r, i in enumerate(groups[key]):
            row, hyp = expect(i)
            assert plan.ints[a + r * mc : a + (r + 1) * mc].tolist() == row
            assert plan.floats[b + r * hc : b + (r + 1) * hc] == hyp
            rows.append((i, a + r * mc, b + r * hc))
            st = work[i][2]
            counts.append(
                -(-st.numel // 2048)
                if key == "dense"
                else num_blocks(st.start, st.numel, st.block_size)
            )
        prefix = plan.ints[a + n * mc : a + n * mc + n + 1].tolist()
        assert prefix == [sum(counts[:k]) for k in range(n + 1)] and total == prefix[-1]
    c = plan.columns
    assert c.n == 2
    for r, i in enumerate((3, 6)):
        row, hyp = expect(i)
        assert plan.ints[c.meta_at + r * mc : c.meta_at + (r + 1) * mc].tolist() == row
        assert plan.floats[c.hyp_at + r * hc : c.hyp_at + (r + 1) * hc] == hyp
    assert c.aux_at + 4 * c.n + 3 * (c.n + 1) == len(plan.ints)
    assert plan.rows == [*rows, (3, c.meta_at, c.hyp_at), (6, c.meta_at + mc, c.hyp_at + hc)]
    cover_columns(plan)
    assert plan.factors[1] is made[1] and len(plan.factors) == 6


def cover_columns(plan) -> None:
    """launch_columns' four kernels' thread-to-index arithmetic over the plan (columns_reduce,
    _finish, _apply, _commit in csrc/gefen_cuda.cu): every partial, column and unit of every
    segment written once, a segment's chunks covering its rows once, nothing outside."""
    c, mc, ints = plan.columns, segment_table.META_COLS, plan.ints
    meta = [ints[c.meta_at + r * mc : c.meta_at + (r + 1) * mc] for r in range(c.n)]
    aux = [ints[c.aux_at + 4 * r : c.aux_at + 4 * r + 4] for r in range(c.n)]
    at = c.aux_at + 4 * c.n
    reduce, cols, units = (ints[at + k * (c.n + 1) : at + (k + 1) * (c.n + 1)] for k in range(3))
    assert (reduce[-1], cols[-1], units[-1]) == (c.reduce_blocks, c.col_blocks, c.unit_blocks)
    part = torch.zeros(c.part_n, dtype=torch.int64)
    col, commit = torch.zeros(c.col_n, dtype=torch.int64), torch.zeros(c.col_n, dtype=torch.int64)
    lane = torch.arange(THREADS)
    seen_rows = {}
    for block in range(c.reduce_blocks):
        s = _find(reduce, block)
        numel, period = meta[s][8], -meta[s][9]
        nb, (p_off, _, _, per) = min(numel, period), aux[s]
        tiles, local = -(-nb // THREADS), block - reduce[s]
        chunk, k = local // tiles, (local % tiles) * THREADS + lane
        k = k[k < nb]
        part[p_off + chunk * nb + k] += 1
        rows = range(chunk * per, min(chunk * per + per, -(-numel // period)))
        seen_rows.setdefault(s, []).extend(rows if k.numel() and k[0] == 0 else [])
    for counter in (col, commit):  # columns_finish and columns_commit: a thread per column
        for block in range(cols[-1]):
            s = _find(cols, block)
            nb = min(meta[s][8], -meta[s][9])
            k = (block - cols[s]) * THREADS + lane
            counter[aux[s][1] + k[k < nb]] += 1
    for s in range(c.n):
        numel, bits = meta[s][8], meta[s][10]
        n_units = (numel + 1) // 2 if bits == 4 else numel
        done = torch.zeros(n_units, dtype=torch.int64)
        for block in range(units[s], units[s + 1]):
            assert _find(units, block) == s
            u = (block - units[s]) * THREADS + lane
            done[u[u < n_units]] += 1
        assert (done == 1).all()
        assert sorted(seen_rows[s]) == list(range(-(-numel // -meta[s][9])))
    assert (part == 1).all() and (col == 1).all() and (commit == 1).all()


def test_column_chunks_fit_the_step_budget(monkeypatch):
    """At most 128 chunks of >= 32 rows per segment; over COLUMN_PART_BYTES for the step, every
    segment's chunks shrink in proportion (one at least), each still covering its rows."""
    sts = [SegmentState(0, 64 * 5000, -64), SegmentState(3, 1000 * 70, -1000)]
    assert native_cuda._column_chunks(sts) == [(125, 40, 64), (3, 24, 1000)]
    monkeypatch.setattr(native_cuda, "COLUMN_PART_BYTES", 12 * 4000)
    shapes = native_cuda._column_chunks(sts)
    # within the budget, but for the one chunk each segment keeps whatever the budget
    assert 12 * sum(ch * nb for ch, _, nb in shapes) <= 12 * 4000 + 12 * (64 + 1000)
    assert [ch for ch, _, _ in shapes] == [45, 1]  # 128 and 3 times 48000 / 134304
    for (chunks, per, _), rows in zip(shapes, (5000, 70), strict=True):
        assert chunks * per >= rows > (chunks - 1) * per


def _by_hand():
    """Gefen on CPU parameters with segments laid out by hand, as launch/gpu_check.py does:
    factored blocks of rows, factored column blocks and B = 1, in two groups, and a parameter of
    two segments; on the reference backend, so it keeps no plan of its own."""
    gen = torch.Generator().manual_seed(0)
    hist = codebook.histogram(torch.randn(20000, generator=gen).clamp(-1, 1))
    levels = codebook.learn_codebook(hist, 4)
    # per parameter: its shape, then (offset, numel, start, tensor shape, block) per segment; the
    # last one a flat buffer holding pieces of two tensors, as FSDP's flat parameters do
    layouts = [
        ((96, 64), [(0, 96 * 64, 0, (96, 64), 64)]),
        ((48, 80), [(0, 48 * 80, 0, (48, 80), -80)]),
        ((33,), [(0, 33, 0, (33,), 1)]),
        ((1140,), [(0, 640, 0, (20, 64), 32), (640, 500, 100, (60, 50), -50)]),
    ]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s, _ in layouts]
    groups = [{"params": params[:2]}, {"params": params[2:], "lr": 3e-4, "betas": (0.8, 0.99)}]
    opt = Gefen(groups, lr=1e-3, bits=4)
    opt.backend = "reference"
    for p, (_, segs) in zip(params, layouts, strict=True):
        opt.set_segments(p, [Segment(*seg[:4]) for seg in segs])
        blocks = [seg[4] for seg in segs]
        opt.state[p] = state.allocate([Segment(*seg[:4]) for seg in segs], blocks, levels, p.device)
    return opt, params


def _cuda_plans(opt):
    """The plans the optimizer's long way would give native_cuda for this step's items."""
    items, origins = opt._items()
    factored = [i for i, it in enumerate(items) if it[3].v_cross is not None]
    factored = [i for i in factored if items[i][3].v_cross.numel()]
    cross = native_cuda.cross_plan([(*items[i][2:5], True) for i in factored])
    fac = {i: f for i, (*_, f) in zip(factored, cross.views, strict=True)}
    work = [(*it[1:8], fac.get(i)) for i, it in enumerate(items)]
    return origins, factored, cross, native_cuda.step_plan(work, {}, dense_tile=2048)


def test_cuda_plan_rewrites_what_plans_built_anew_would_hold():
    """CudaPlan.refresh (its launches need a GPU): after new gradient tensors and a new lr, the
    kept plans' addresses, step keys and hyperparameter rows are those of plans built anew from
    the optimizer's own items, and everything else is as it was (the factor addresses into the
    kept factor plan's buffers included)."""
    opt, params = _by_hand()
    for t in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(t))
        opt.step()
    origins, factored, cross, step = _cuda_plans(opt)
    assert len(factored) == 4 and step.columns.n == 2 and len(step.rows) == 5
    assert [off for _, _, off in origins] == [0, 0, 0, 0, 640]
    kept = CudaPlan(opt, origins, torch.device("cpu"), step, cross, factored, list(range(5)))
    ints0, meta0 = step.ints.tolist(), [list(r) for r in cross.meta]
    for p in params:
        p.grad = torch.randn(p.shape) + 1  # new tensors, new addresses
    opt.param_groups[0]["lr"] = 5e-4
    assert kept.refresh(opt)
    _, _, cross_new, step_new = _cuda_plans(opt)
    ints, fresh = step.ints.tolist(), step_new.ints.tolist()
    assert step.floats == step_new.floats and step.rows == step_new.rows
    factor = segment_table.FACTOR_COL
    for _, at, _ in step.rows:
        for col in range(segment_table.META_COLS):
            want = ints0[at + col] if col == factor else fresh[at + col]
            assert ints[at + col] == want, col
    outside = set(range(len(ints))) - {at + c for _, at, _ in step.rows for c in range(factor + 1)}
    assert all(ints[k] == fresh[k] == ints0[k] for k in outside)  # prefixes, column aux
    assert [array("f", r) for r in cross.hyps] == [array("f", r) for r in cross_new.hyps]
    for row, row0, new in zip(cross.meta, meta0, cross_new.meta, strict=True):
        buffers = (SUMS, COUNTS, OUT)  # the kept plan's own, written by its launches
        assert [row[k] for k in buffers] == [row0[k] for k in buffers]
        assert [x for k, x in enumerate(row) if k not in buffers] == [
            x for k, x in enumerate(new) if k not in buffers
        ]
    params[2].grad = None  # a parameter without its gradient: the long way
    assert not kept.refresh(opt)
