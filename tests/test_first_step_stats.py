"""The first step's statistics and histogram, made with few reads back to the host, choose the
same blocks and the same codebook as the per-chunk loops they replaced.

The reference here is those loops, kept verbatim but for one fix (they squared a float64
gradient in place): ``_loop_stats`` read every chunk's sums back one number at a time,
``_loop_histogram`` dropped all-zero blocks by a boolean mask. The statistics may differ in
their last bits (other summation orders); the blocks chosen from them and the histogram counts
must be equal.
"""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gefen_dist import Gefen
from gefen_dist import first_step as fs
from gefen_dist.method import codebook as cb
from gefen_dist.method import partition as pt
from gefen_dist.method import state
from gefen_dist.method.segments import Segment, block_chunks, column_chunks

pytestmark = pytest.mark.unit

_LOOP_CHUNK = 1 << 18  # the loops' chunks (statistics)
_LOOP_HIST_CHUNK = 1 << 17  # the loops' chunks (histogram)


def _loop_stats(grad, start, candidates, period=0):
    stats = pt.TensorStats(list(candidates), period=period)
    flat = grad.reshape(-1)
    n = flat.numel()
    end = start + n
    carry = [0.0] * len(candidates)
    for a in range(0, n, _LOOP_CHUNK):
        x = flat[a : a + _LOOP_CHUNK].double().square()
        stats.count += x.numel()
        stats.s1 += float(x.sum())
        stats.s2 += float(x.square().sum())
        if period:
            pt._add_columns(stats.col_sums, x, start + a, period)
        prefix = torch.cat([x.new_zeros(1), x.cumsum(0)])
        t0, t1 = start + a, start + a + x.numel()
        for i, p in enumerate(candidates):
            first = (t0 // p + 1) * p
            if first > t1:
                carry[i] += float(prefix[-1])
                continue
            at = prefix[torch.arange(first - t0, t1 - t0 + 1, p)]
            sums = torch.diff(at, prepend=prefix[:1])
            sums[0] += carry[i]
            block_lo = t0 // p
            if (block_lo * p) < start:
                stats.partial[i][block_lo] = stats.partial[i].get(block_lo, 0.0) + float(sums[0])
                sums = sums[1:]
            stats.block_sq[i] += float(sums.square().sum())
            carry[i] = float(prefix[-1] - at[-1])
    for i, p in enumerate(candidates):
        if n and end % p:
            last = (end - 1) // p
            stats.partial[i][last] = stats.partial[i].get(last, 0.0) + carry[i]
    return stats


def _loop_column_absmax(g, period):
    amax = torch.zeros(min(g.numel(), period), dtype=torch.float32)
    for lo, hi, w in column_chunks(g.numel(), period, _LOOP_HIST_CHUNK):
        torch.maximum(amax[:w], g[lo:hi].float().view(-1, w).abs().amax(dim=0), out=amax[:w])
    return amax


def _loop_histogram(g, seg, block_size, counts, cut):
    if block_size == 1:
        return
    if block_size < 0:
        period, columns = -block_size, cut.get(-1)
        nb = min(g.numel(), period)
        if columns is None:
            amax = _loop_column_absmax(g, period)
        else:
            amax = columns[(seg.start + torch.arange(nb)) % period]
        keep = amax > 0
        for lo, hi, w in column_chunks(g.numel(), period, _LOOP_HIST_CHUNK):
            x = g[lo:hi].float().view(-1, w)[:, keep[:w]]
            cb.histogram((x / amax[:w][keep[:w]]).reshape(-1), cb.DEFAULT_BINS, out=counts)
        return
    for c in block_chunks(seg.start, seg.numel, block_size, _LOOP_HIST_CHUNK):
        x = g[c.elem : c.end].float().view(c.rows, c.length)
        amax = x.abs().amax(dim=1, keepdim=True)
        whole = cut.get((seg.start + c.elem) // block_size)
        if c.length < block_size and whole is not None:
            amax.fill_(whole)
        keep = amax.view(-1) > 0
        cb.histogram(x[keep] / amax[keep], cb.DEFAULT_BINS, out=counts)


def _structured(shape, seed, kind):
    """A first gradient with structure the rule finds: rows, columns, gates or none."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if kind == "rows":
        x *= torch.randn(shape[0], *[1] * (len(shape) - 1), generator=g).exp()
    elif kind == "cols":
        x *= torch.randn(1, shape[1], generator=g).exp()
    elif kind == "gates":
        x *= torch.randn(3, 1, generator=g).exp().repeat_interleave(shape[0] // 3, 0)
        x *= torch.randn(shape[0], 1, generator=g).mul(0.3).exp()
    elif kind == "zero_rows":
        x *= torch.randn(shape[0], 1, generator=g).exp()
        x[::7] = 0.0
    return x


# (shape, structure, cuts: where the tensor is split into pieces, as FSDP or ZeRO would)
LAYOUTS = [
    ((96, 432), "rows", []),
    ((800, 500), "cols", []),
    ((576, 192), "gates", []),
    ((8192,), "none", []),
    ((27648,), "rows", []),  # a fused qkv held flat: its row hidden
    ((300, 96), "rows", [1000, 17777]),  # pieces cut mid-block and mid-row
    ((64, 96), "zero_rows", [5]),
    ((40, 50), "rows", []),  # under MIN_SHARED_NUMEL: B = 1
    ((2100, 2048), "rows", [1_000_003, 3_000_000]),  # more than one chunk, cut pieces
    ((1536, 2816), "cols", [2_200_001]),  # columns over more than one chunk
]


def _pieces(x, cuts):
    flat = x.reshape(-1)
    edges = [0, *cuts, flat.numel()]
    return [(flat[a:b], a) for a, b in zip(edges, edges[1:], strict=False)]


def _exact_block_sum(pieces, stats, st, b, p):
    """The sum of x = g^2 over the elements of block b (size p) that ``st``'s piece holds."""
    g, a = pieces[next(i for i, s in enumerate(stats) if s is st)]
    lo, hi = max(b * p, a), min((b + 1) * p, a + g.numel())
    return math.fsum(g[lo - a : hi - a].double().square().tolist())


@pytest.mark.parametrize(("shape", "kind", "cuts"), LAYOUTS)
def test_statistics_and_blocks_match_the_loops(shape, kind, cuts):
    x = _structured(shape, 0, kind)
    cands, period = pt.candidate_block_sizes(shape), pt.column_period(shape)
    pieces = _pieces(x, cuts)
    new = pt.stats_of([pt.StatsRequest(g, a, cands, period) for g, a in pieces])
    old = [_loop_stats(g, a, cands, period) for g, a in pieces]
    for n, o in zip(new, old, strict=True):
        assert n.count == o.count
        assert n.s1 == pytest.approx(o.s1, rel=1e-12)
        assert n.s2 == pytest.approx(o.s2, rel=1e-12)
        assert n.block_sq == pytest.approx(o.block_sq, rel=1e-12)
        for p, pn, po in zip(cands, n.partial, o.partial, strict=True):
            assert pn.keys() == po.keys()
            for b, v in pn.items():  # the cut blocks' sums, against exact ones (fsum): the
                # loops' came from differences of running sums and kept fewer digits
                exact = _exact_block_sum(pieces, new, n, b, p)
                assert v == pytest.approx(exact, rel=1e-12)
                assert po[b] == pytest.approx(exact, rel=1e-7)
        if period:
            torch.testing.assert_close(n.col_sums, o.col_sums, rtol=1e-12, atol=0)
    numel, row = x.numel(), pt.row_length(shape)
    chosen = pt.choose_block_size(pt.merge_stats(new), numel, row)
    assert chosen == pt.choose_block_size(pt.merge_stats(old), numel, row)
    if kind == "rows" and numel >= pt.MIN_SHARED_NUMEL and len(shape) == 2:
        assert chosen > 1  # the layout has structure: the comparison is not of B = 1 twice


def test_a_float64_gradient_is_left_as_it_was():
    g = torch.randn(5000, dtype=torch.float64)
    before = g.clone()
    pt.segment_stats(g, 0, pt.candidate_block_sizes((5000,)))
    assert torch.equal(g, before)


@pytest.mark.parametrize(("shape", "kind", "cuts"), LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_histogram_counts_match_the_loops(shape, kind, cuts, dtype):
    x = _structured(shape, 1, kind).to(dtype)
    block = pt.block_size_for(x.float().reshape(-1), shape)
    if block == 1:
        block = 8 if x.numel() % 8 == 0 else -shape[-1]
    counted = 0.0
    for g, a in _pieces(x, cuts):
        seg = Segment(0, g.numel(), a, shape)
        cut = {}
        if block > 0 and a % block:  # the first block cut: its whole absmax from elsewhere
            cut[a // block] = float(g[: block - a % block].abs().max()) * 1.5
        elif block < 0:
            cut[-1] = _loop_column_absmax(x.reshape(-1), -block) * 1.25
        new = torch.zeros(cb.DEFAULT_BINS, dtype=torch.float64)
        old = torch.zeros(cb.DEFAULT_BINS, dtype=torch.float64)
        fs.histogram(g, seg, block, new, cut)
        _loop_histogram(g, seg, block, old, cut)
        assert torch.equal(new, old)
        counted += float(old.sum())
    assert counted > 0


def _model(n_layers, seed=0):
    """Named parameters of a small GPT-like set with first gradients of some structure."""
    shapes = [("wte", (512, 64), "rows")]
    for i in range(n_layers):
        shapes += [
            (f"h{i}.qkv", (192, 64), "gates"),
            (f"h{i}.proj", (64, 64), "rows"),
            (f"h{i}.fc", (256, 64), "rows"),
            (f"h{i}.down", (64, 256), "cols"),
            (f"h{i}.ln", (64,), "none"),
            (f"h{i}.bias", (256,), "none"),
        ]
    out = []
    for j, (name, shape, kind) in enumerate(shapes):
        p = torch.nn.Parameter(torch.zeros(shape))
        p.grad = _structured(shape, seed * 1000 + j, kind) * 1e-3
        out.append((name, p))
    return out


@pytest.mark.parametrize("bits", [4, 8])
def test_the_optimizer_learns_the_blocks_and_codebook_of_the_loops(bits):
    named = _model(4)
    opt = Gefen(named, lr=1e-3, bits=bits)
    opt.step()
    counts = torch.zeros(cb.DEFAULT_BINS, dtype=torch.float64)
    for name, p in named:
        shape, g = tuple(p.shape), p.grad.reshape(-1)
        stats = _loop_stats(g, 0, pt.candidate_block_sizes(shape), pt.column_period(shape))
        block = pt.choose_block_size(stats, g.numel(), pt.row_length(shape))
        assert [r.block for r in state.layout_rows(opt.state[p])] == [block], name
        _loop_histogram(g, Segment(0, g.numel(), 0, shape), block, counts, {})
    assert torch.equal(opt.codebooks[bits], cb.learn_codebook(counts, bits))


class _HostReads(TorchDispatchMode):
    """The calls that make a device's host wait: a scalar read (item, float, bool), a shape
    that depends on the data (boolean masks, nonzero, bincount); tolist is counted apart."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        bool_index = name.startswith("aten.index.Tensor") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]
        )
        if bool_index or name.split(".")[1] in {
            "_local_scalar_dense",
            "nonzero",
            "masked_select",
            "bincount",
        }:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _first_step_reads(n_layers, monkeypatch):
    named = _model(n_layers, seed=3)
    opt = Gefen(named, lr=1e-3, bits=4)
    reads = _HostReads()
    tolist = torch.Tensor.tolist
    calls = []

    def counted(self, *a, **kw):
        calls.append(self.numel())
        return tolist(self, *a, **kw)

    inner = opt._initialize

    def learn(pending):
        with monkeypatch.context() as m:
            m.setattr(torch.Tensor, "tolist", counted)
            with reads:
                inner(pending)

    opt._initialize = learn
    opt.step()
    return reads.count + len(calls)


def test_the_first_step_reads_back_a_fixed_number_of_times(monkeypatch):
    """Reads back to the host do not grow with the number of tensors (nor of chunks)."""
    few, many = _first_step_reads(2, monkeypatch), _first_step_reads(8, monkeypatch)
    assert few == many
    assert many <= 4
