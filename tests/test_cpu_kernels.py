"""The C++ CPU kernel against the reference update, step by step from identical
state; and what the C++ kernel must get exactly right on its own."""

import os
import platform
import subprocess
import sys

import pytest
import torch

from gefen_dist import Gefen, Segment
from gefen_dist.backends.segment_table import Meta
from gefen_dist.backends.work import CrossWork, SegmentWork
from gefen_dist.method import codebook as cb
from gefen_dist.method import state
from gefen_dist.method.codes import midpoints, unpack4

pytestmark = pytest.mark.unit

torch.set_num_threads(1)


def _pair(bits, start, numel, shape, backend, seed=0, levels=None, block=None, **kw):
    g = torch.Generator().manual_seed(seed)
    p0 = torch.randn(numel, generator=g)
    if levels is None:
        hist = cb.histogram(torch.randn(10000, generator=g).clamp(-1, 1))
        levels = cb.learn_codebook(hist, bits)
    ps, opts = [], []
    for name in ("reference", backend):
        p = p0.clone().requires_grad_()
        o = Gefen([p], lr=1e-2, weight_decay=0.1, bits=bits, **kw)
        o.backend = name
        seg = Segment(0, numel, start, shape)
        o.set_segments(p, [seg])
        # a piece of a larger tensor: its block size is given, as another rank's merge would
        o.state[p] = state.allocate([seg], [block or shape[1]], levels, p.device)
        ps.append(p)
        opts.append(o)
    return ps, opts


def _grad(numel, start, row, seed):
    g = torch.Generator().manual_seed(seed)
    rows = torch.exp(torch.randn((start + numel) // row + 2, generator=g))
    idx = (torch.arange(numel) + start) // row
    return rows[idx] * torch.randn(numel, generator=g)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(
    "start,numel,shape",
    [(0, 96 * 200, (200, 96)), (37, 4001, (90, 96)), (1, 5 * 96, (6, 96)), (0, 97 * 60, (60, 97))],
)
def test_cpu_step_matches_reference(bits, start, numel, shape):
    (pr, pn), (orf, onb) = _pair(bits, start, numel, shape, "native")
    row = shape[1]
    grads = [_grad(numel, start, row, 10 + t) for t in range(5)]
    for sr, sn in _steps_from_reference_state((pr, pn), (orf, onb), grads):
        assert int(sr["layout"][0, 3]) == row and int(sn["layout"][0, 3]) == row
        _assert_step_close(pr, pn, sr, sn, bits, numel, absmax_atol=0.0)
    assert onb.memory_report()["backend"] == "native-cpu"
    assert orf.memory_report()["backend"] == "reference"


def _steps_from_reference_state(ps, opts, grads):
    """Step both optimizers on each gradient, the second continuing from the reference's
    state each time, so every comparison is of one step; yields both states after each."""
    (pr, pn), (orf, onb) = ps, opts
    for t, g in enumerate(grads):
        pr.grad, pn.grad = g.clone(), g.clone()
        if t:
            pn.data.copy_(pr.data)
            for k, v in orf.state[pr].items():
                onb.state[pn][k].copy_(v)
        orf.step()
        onb.step()
        yield orf.state[pr], onb.state[pn]


def _assert_step_close(pr, pn, sr, sn, bits, numel, absmax_atol):
    # v: fp64 vs fp32 accumulation of the block mean of g^2
    torch.testing.assert_close(sn["v"], sr["v"], rtol=2e-6, atol=0)
    # v_cross: the C++ pass sums in its own order
    torch.testing.assert_close(sn["v_cross"], sr["v_cross"], rtol=1e-6, atol=0)
    torch.testing.assert_close(sn["absmax"], sr["absmax"], rtol=1e-6, atol=absmax_atol)
    torch.testing.assert_close(pn.detach(), pr.detach(), rtol=1e-6, atol=1e-7)
    cr, cn = sr["codes"], sn["codes"]
    if bits == 4:
        cr, cn = unpack4(cr, numel), unpack4(cn, numel)
    diff = (cr.long() - cn.long()).abs()
    assert diff.max() <= 1  # a value on a midpoint may round to the neighbouring level
    assert (diff > 0).float().mean() < 1e-3


def _col_grad(numel, start, row, seed, row_scale=False):
    """Columns of different scales; with ``row_scale`` rows too (what v_cross follows; the
    partition then no longer picks columns, so only for a given block size)."""
    g = torch.Generator().manual_seed(seed)
    cols = torch.exp(torch.randn(row, generator=g))
    at = torch.arange(numel) + start
    x = cols[at % row] * torch.randn(numel, generator=g)
    if row_scale:
        x *= torch.exp(torch.randn((start + numel) // row + 1, generator=g))[at // row]
    return x


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(
    "start,numel,shape",
    [(0, 96 * 200, (200, 96)), (37, 4001, (90, 96)), (5, 50, (60, 97)), (3, 97 * 59, (60, 97))],
)
def test_column_step_matches_reference(bits, start, numel, shape):
    """Column segments; pieces start and end mid-row."""
    row = shape[1]
    (pr, pn), (orf, onb) = _pair(bits, start, numel, shape, "native", block=-row)
    grads = [_col_grad(numel, start, row, 10 + t, row_scale=True) for t in range(5)]
    for sr, sn in _steps_from_reference_state((pr, pn), (orf, onb), grads):
        assert sr["v"].numel() == min(numel, row)
        # a piece shorter than a row has one-element columns, whose absmax is |m| itself: where
        # m + w (g - m) cancels, torch's vectorised lerp and the scalar one differ by an ulp of
        # the operands (~4e-9 here), far more than an ulp of the small result
        _assert_step_close(pr, pn, sr, sn, bits, numel, absmax_atol=1e-8)
    assert onb.memory_report()["backend"] == "native-cpu"


def test_backend_is_validated():
    o = Gefen([torch.zeros(3, requires_grad=True)])
    assert o.backend == "auto"
    with pytest.raises(ValueError, match="backend"):
        o.backend = "cuda"


def test_auto_is_the_cpp_kernel_on_cpu():
    p = torch.randn(64, 128, requires_grad=True)
    o = Gefen([p])
    p.grad = _grad(p.numel(), 0, 128, 0).view_as(p)
    o.step()
    assert o.memory_report()["backend"] == "native-cpu"


@pytest.mark.parametrize("bits", [4, 8])
def test_cpp_codes_are_the_nearest_level_even_for_crowded_levels(bits):
    """From zero state, m = (1 - b1) g exactly in both: the codes must be identical, also when
    many levels crowd into one cell of the kernel's lookup table (its exact walk)."""
    n = 2**bits
    crowd = torch.linspace(0.1, 0.1 + 1e-4 * (n - 3), n - 2)
    levels = torch.cat([torch.tensor([-1.0]), crowd, torch.tensor([1.0])])
    numel, row = 64 * 96, 96
    (pr, pn), (orf, onb) = _pair(bits, 0, numel, (64, row), "native", levels=levels)
    g = _grad(numel, 0, row, 3).abs() * 0.12  # values land inside the crowd
    g[::7] = 0.1 + 1e-4 * torch.arange(len(g[::7])) % (1e-4 * (n - 3))
    pr.grad, pn.grad = g.clone(), g.clone()
    orf.step()
    onb.step()
    assert torch.equal(onb.state[pn]["codes"], orf.state[pr]["codes"])


def _grid_reach(levels):
    """The most interior levels in one of the C++ kernel's 128 grid cells over [-1, 1], each
    widened by 2^-23 (gefen_cpu.cpp, levels4): which of its 4-bit level counts the codes take."""
    inner = levels[1:15].double()
    edges = -1.0 + torch.arange(129, dtype=torch.float64) / 64
    lo, hi = edges[:-1, None] - 2**-23, edges[1:, None] + 2**-23
    return int(((inner > lo) & (inner <= hi)).sum(dim=1).max())


def _ulps(x, k):
    """x moved k float32 steps (k < 0: down)."""
    toward = torch.full_like(x, float("inf") if k > 0 else float("-inf"))
    for _ in range(abs(k)):
        x = torch.nextafter(x, toward)
    return x


@pytest.mark.parametrize("reach", [1, 2, 3])
def test_cpp_4bit_codes_at_grid_edges(reach):
    """The 4-bit level count from the grid (a byte permute of x's cell, then ``reach`` compares)
    must give the reference's codes where rounding decides: levels on cell edges and a float
    step either side of them, grouped ``reach`` to a cell, and x on and around every edge and
    level. Each step from zero state, with one |g| = 1 per block: x = g up to an ulp, and
    m = (1 - b1) g exactly in both (later steps' m may differ by an ulp: torch's lerp)."""
    edges = -1.0 + torch.arange(129, dtype=torch.float32) / 64
    if reach == 1:  # on edges, a cell or more apart
        inner = edges[torch.arange(14) * 9 + 5]
    elif reach == 2:  # a cell's two edges
        inner = edges[torch.tensor([2, 3, 20, 21, 40, 41, 60, 61, 80, 81, 100, 101, 120, 121])]
    else:  # an edge, a step below it and a step above
        at = edges[torch.tensor([3, 30, 60, 90, 110])]
        inner = torch.stack([_ulps(at, -1), at, _ulps(at, 1)], dim=1).flatten()[:14]
    levels = torch.cat([torch.tensor([-1.0]), inner, torch.tensor([1.0])])
    assert _grid_reach(levels) == reach
    _assert_codes_where_rounding_decides(4, levels, torch.cat([inner, edges]), row=96)


def _assert_codes_where_rounding_decides(bits, levels, targets, row):
    """One step from zero state on 64 rows of ``row``, x on and up to two float steps around
    each target (shuffled among uniform ones) and one |g| = 1 per block, both signs: x = g up to
    an ulp and m = (1 - b1) g exactly in both (later steps' m may differ by an ulp: torch's
    lerp). The C++ codes must be the reference's."""
    near = torch.cat([_ulps(targets, k) for k in (-2, -1, 0, 1, 2)]).clamp(-1, 1)
    numel = 64 * row
    g = torch.rand(numel, generator=torch.Generator().manual_seed(1)) * 2 - 1
    g[: len(near)] = near
    g = g[torch.randperm(numel, generator=torch.Generator().manual_seed(2))]
    g[::row] = 1.0
    for sign in (1.0, -1.0):
        (pr, pn), (orf, onb) = _pair(bits, 0, numel, (64, row), "native", levels=levels)
        pr.grad, pn.grad = sign * g, sign * g
        orf.step()
        onb.step()
        assert torch.equal(onb.state[pn]["codes"], orf.state[pr]["codes"]), f"sign {sign}"


def _grid8_reach(levels):
    """The most midpoints in one of the C++ kernel's 8192 8-bit grid cells over [-1, 1], each
    widened by 2^-23 (gefen_cpu.cpp, levels8): 1 takes its one-load path, more its compares."""
    mids = midpoints(levels).double()
    edges = -1.0 + torch.arange(8193, dtype=torch.float64) / 4096
    lo, hi = edges[:-1] - 2**-23, edges[1:] + 2**-23
    inside = torch.searchsorted(mids, hi, right=True) - torch.searchsorted(mids, lo)
    return int(inside.max())


@pytest.mark.parametrize("shift", [-1, 0, 1])
def test_cpp_8bit_codes_at_grid_edges(shift):
    """The 8-bit code from the grid (base and the next midpoint, one 8-byte load) must be the
    reference's nearest level (ties to the lower) where rounding decides: midpoints on cell edges
    (or, from pairs around a float step off the edge, next to them), x on and around every midpoint
    and every eighth edge.
    Levels in pairs around an edge E, E -+ 3 cells, put a midpoint on E exactly and the next one
    halfway to the next pair's edge, 16 cells on."""
    edges = -1.0 + torch.arange(8193, dtype=torch.float32) / 4096
    at = _ulps(edges[32 * torch.arange(127) + 32], shift)
    d = 3.0 / 4096
    levels = torch.cat(
        [torch.tensor([-1.0]), torch.stack([at - d, at + d], 1).flatten(), torch.tensor([1.0])]
    )
    mids = midpoints(levels)
    assert shift or torch.equal(mids[1::2], at)
    assert _grid8_reach(levels) == 1
    _assert_codes_where_rounding_decides(8, levels, torch.cat([mids, edges[::8]]), row=128)


@pytest.mark.parametrize("bits", [4, 8])
def test_cpp_follows_torch_lerp_for_small_beta1(bits):
    """torch's lerp switches formula at weight 0.5 (beta1 < 0.5); the kernel must follow (at 4
    bits in the loop that decodes as it moves, too)."""
    (pr, pn), (orf, onb) = _pair(bits, 0, 96 * 64, (64, 96), "native", betas=(0.3, 0.9))
    for t in range(3):
        g = _grad(96 * 64, 0, 96, t)
        pr.grad, pn.grad = g.clone(), g.clone()
        orf.step()
        onb.step()
    torch.testing.assert_close(pn.detach(), pr.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("columns", [False, True], ids=["rows", "columns"])
@pytest.mark.parametrize("bits,shape", [(8, (300, 64)), (4, (300, 64)), (4, (301, 63))])
def test_cpp_result_does_not_depend_on_threads(bits, shape, columns):
    """Two threads give the one-thread result bit for bit. Row blocks are independent (odd
    4-bit boundaries run in order); column segments reduce over chunks of rows fixed by the
    shape, not by the thread count (odd row lengths at 4 bits: chunks of an even number of
    rows, no byte shared)."""
    grad = _col_grad if columns else _grad
    out = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        p = torch.randn(shape, generator=torch.Generator().manual_seed(0)).requires_grad_()
        o = Gefen([p], bits=bits)
        for t in range(3):
            p.grad = grad(p.numel(), 0, shape[1], t).view(shape)
            o.step()
        out.append((p.detach().clone(), {k: v.clone() for k, v in o.state[p].items()}))
    torch.set_num_threads(1)
    assert int(out[0][1]["layout"][0, 3]) == (-shape[1] if columns else shape[1])
    assert torch.equal(out[0][0], out[1][0])
    for k in out[0][1]:
        assert torch.equal(out[0][1][k], out[1][1][k]), k


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpp_columns_of_low_precision_params_match_reference(dtype):
    shape, row = (90, 97), 97
    ps = []
    for backend in ("reference", "native"):
        torch.manual_seed(0)
        p = torch.randn(shape).to(dtype).requires_grad_()
        o = Gefen([p], lr=1e-2, bits=4)
        o.backend = backend
        for t in range(3):
            p.grad = _col_grad(p.numel(), 0, row, t).view(shape).to(dtype)
            o.step()
        assert int(o.state[p]["layout"][0, 3]) == -row
        ps.append(p.detach().float())
    assert o.memory_report()["backend"] == "native-cpu"
    # same fp32 arithmetic rounded once: at most one ulp of the low-precision format apart
    ulp = {torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]
    torch.testing.assert_close(ps[1], ps[0], rtol=ulp, atol=1e-3 * ulp)


NARROWER = {
    "avx512": "-mno-avx512vbmi",
    "avx2": "-mno-avx512f",
    "scalar": "-mno-avx512f -mno-avx2",
}


@pytest.mark.slow
@pytest.mark.parametrize("isa", list(NARROWER))
def test_narrower_vector_paths_pass_the_kernel_tests_too(isa):
    """The library is built for the widest vector path the CPU has, so on an AVX-512 machine
    the AVX2 loops (and the scalar ones everywhere) would never run in CI. Build each on
    purpose and run this file's C++ checks against it: same reference, same bounds. Skipped
    where there is nothing to narrow: inside such a run, off x86 (whose flags these are), for
    the machine's own path, which the rest of this file tests, and for paths wider than the
    machine's, whose instructions it cannot run."""
    from gefen_dist.backends import native_cpu

    if os.environ.get("GEFEN_CPU_FLAGS"):
        pytest.skip("this run is already a narrowed build")
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the flags that narrow the build are x86's")
    width = ["scalar", "avx2", "avx512", "avx512vbmi"]
    own = native_cpu.isa()
    if own == isa:
        pytest.skip(f"{isa} is this machine's own build: the main run covers it")
    if own is None or width.index(isa) > width.index(own):
        pytest.skip(f"{isa} is wider than this machine's own build ({own}): nothing to narrow to")
    env = dict(os.environ, GEFEN_CPU_FLAGS=NARROWER[isa])
    probe = "from gefen_dist.backends import native_cpu; print(native_cpu.isa())"
    r = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert r.stdout.strip() == isa, r.stderr[-2000:]
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            __file__,
            "-k",
            "native or cpp",
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout[-3000:]
    assert " passed" in r.stdout and " failed" not in r.stdout


@pytest.mark.slow
def test_missing_compiler_falls_back_with_a_warning(tmp_path):
    code = (
        "import warnings, torch\n"
        "from gefen_dist import Gefen\n"
        "from gefen_dist.backends import native_cpu\n"
        "assert not native_cpu.available() and 'failed' in native_cpu.build_error()\n"
        "p = torch.randn(64, 128, requires_grad=True)\n"
        "o = Gefen([p]); p.grad = torch.randn(64, 128)\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always'); o.step()\n"
        "assert any('C++ CPU kernels are unavailable' in str(x.message) for x in w)\n"
        "print(o.memory_report()['backend'])\n"
    )
    env = dict(os.environ, CXX="false", GEFEN_CACHE_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "reference"
    o = Gefen([torch.zeros(3, requires_grad=True)])
    o.backend = "native"  # where the kernel builds, asking for it explicitly works
    o.param_groups[0]["params"][0].grad = torch.ones(3)
    o.step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "start,numel,block,length",
    [
        (0, 96 * 200, 96, 96),  # whole rows
        (37, 4001, 96, 96),  # cut head and tail blocks
        (50, 30, 96, 96),  # a piece inside one block
        (0, 96 * 200, -96, 200),  # columns: one entry per tensor row
        (37, 4001, -96, 43),  # a piece starting mid-row
        (5, 50, -97, 2),  # inside one row
    ],
)
def test_native_cross_sums_match_reference(dtype, start, numel, block, length):
    """The C++ pass that gathers v_cross's sums, against the reference's, in fp64: equal up to
    summation order; and the same bits on one thread as on two."""
    from gefen_dist.backends import native_cpu, reference

    g = (torch.randn(numel, generator=torch.Generator().manual_seed(3)) * 3).to(dtype)
    want = reference.cross_sums(g, start, block, length)
    outs = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        outs.append(native_cpu.cross_sums(g, start, block, length))
    torch.set_num_threads(1)
    for got in outs:
        torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=0)
        assert torch.equal(got[1], want[1])
    assert torch.equal(outs[0][0], outs[1][0])
    assert want[1].sum() == numel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [96, 97])
def test_native_row_sums_do_not_depend_on_the_rows_beside_them(dtype, width):
    """Column segments' v_cross sums run over tensor rows, several rows to a loop where the vector
    path allows: each row's sum is the same bits whichever rows a piece groups it with (pieces
    starting 0 to 4 rows in), so a tensor cut differently over ranks gets the same v_cross."""
    from gefen_dist.backends import native_cpu

    rows = 23
    g = (torch.randn(rows * width, generator=torch.Generator().manual_seed(6)) * 3).to(dtype)
    whole = native_cpu.cross_sums(g, 0, -width, rows)[0]
    for first in range(1, 5):
        start = first * width
        part = native_cpu.cross_sums(g[start:], start, -width, rows)[0]
        assert torch.equal(part[first:], whole[first:]), first
        assert torch.equal(part[:first], torch.zeros(first, dtype=part.dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "start,numel,block", [(0, 96 * 200, 96), (37, 4001, 96), (50, 30, 96), (96, 96 * 40, 96)]
)
def test_native_cross_sums_fold_each_blocks_mean_square_into_v(dtype, start, numel, block):
    """Told v, the pass that gathers v_cross's sums also steps each block's v (the kernel then
    skips its own first pass over g): v * beta2 + (1 - beta2) * mean g^2 over the block's part
    in the piece, the same bits on one thread as on two, and the sums unchanged."""
    from gefen_dist.backends import native_cpu, reference
    from gefen_dist.method.segments import block_runs, num_blocks

    g = (torch.randn(numel, generator=torch.Generator().manual_seed(4)) * 2).to(dtype)
    h = reference.Hyper(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, step=3)
    v0 = torch.rand(num_blocks(start, numel, block), generator=torch.Generator().manual_seed(5))
    blocks = [
        g[r.elem : r.elem + r.length * r.count].double().view(r.count, r.length)
        for r in block_runs(start, numel, block)
    ]
    means = torch.cat([b.square().mean(1) for b in blocks])
    beta2, a2 = torch.tensor(0.95), torch.tensor(1.0 - 0.95)
    want = v0 * beta2 + a2 * means.float()
    vs = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        v = v0.clone()
        sums = native_cpu.cross_sums(g, start, block, block, v, h)
        torch.testing.assert_close(sums[0], reference.cross_sums(g, start, block, block)[0])
        vs.append(v)
    torch.set_num_threads(1)
    assert len(means) == len(v0)
    torch.testing.assert_close(vs[0], want, rtol=1e-6, atol=0)
    assert torch.equal(vs[0], vs[1])
    with pytest.raises(ValueError, match="contiguous blocks"):
        native_cpu.cross_sums(g, start, -block, 3, v, h)


def _lane_order_sum(squares: torch.Tensor, lanes_first: range) -> torch.Tensor:
    """Row sums in fp64 the way the AVX-512 loop adds them: lane j mod 16 over the row, then the
    lanes one by one in the order given."""
    rows, width = squares.shape
    lanes = torch.zeros(rows, 16, dtype=torch.float64)
    for i in range(width // 16):
        lanes = lanes + squares[:, 16 * i : 16 * (i + 1)]
    total = torch.zeros(rows, dtype=torch.float64)
    for k in lanes_first:
        total = total + lanes[:, k]
    return total


@pytest.mark.parametrize("threads", [1, 2])
def test_native_block_sums_add_sixteen_lanes_in_order(threads):
    """With AVX-512 the factor pass sums an fp32 row whose length is a multiple of 16 by hand
    (beside a prefetch), in the order GCC's vector loop adds the other rows: lane j mod 16, then
    lanes 0 to 15 one by one. The rows here make the order show in the folded fp32 v: a row
    mean of 0.5 + 2^-25 (an fp32 tie, rounding to 0.5) made of 16 + 2^-20 in two lanes and four
    2^-50 in others, which vanish when added after the 16 and make 2^-48 (enough to round the
    mean up) when added first. Skipped on a CPU without AVX-512: no build there has the loop."""
    from gefen_dist.backends import native_cpu, reference

    if native_cpu.isa() not in ("avx512", "avx512vbmi"):
        pytest.skip(f"the hand-written row loop is AVX-512's; this build is {native_cpu.isa()}")
    width = 32
    g = torch.zeros(4, width)
    g[0, [0, 1]] = torch.tensor([4.0, 2.0**-10])  # the 16 + 2^-20 in lanes 0 and 1 ...
    g[0, 8:12] = 2.0**-25  # ... the four 2^-50 in lanes 8-11
    g[1, [16, 17]] = torch.tensor([4.0, 2.0**-10])  # the same in the row's second sixteen
    g[1, 2:6] = 2.0**-25
    g[2, [0, 17]] = torch.tensor([4.0, 2.0**-10])
    g[2, [12, 13, 30, 31]] = 2.0**-25
    # eight 2^-50 that a tree of pairwise sums (lane k with k + 8, then + 4, + 2, + 1) would
    # gather into 2^-47 before the 16: the mean rounds up then
    g[3, [0, 4]] = torch.tensor([4.0, 2.0**-10])
    g[3, [2, 3, 6, 7, 10, 11, 14, 15]] = 2.0**-25
    h = reference.Hyper(lr=1e-3, beta1=0.9, beta2=0.5, eps=1e-8, weight_decay=0.0, step=3)
    v = torch.zeros(4)
    torch.set_num_threads(threads)
    try:
        native_cpu.cross_sums(g.flatten(), 0, width, width, v, h)
    finally:
        torch.set_num_threads(1)
    squares = g.double().square()

    def folded(total):
        return torch.tensor(0.5) * (total / width).float()

    want = folded(_lane_order_sum(squares, range(16)))
    assert torch.equal(want, torch.full((4,), 0.25))  # the tie went to 0.5
    # the rows tell orders apart: lanes 8-15 first would round every mean up
    assert not torch.equal(want, folded(_lane_order_sum(squares, [*range(8, 16), *range(8)])))
    assert torch.equal(v, want)


def test_native_step_names_the_segment_it_refuses_and_writes_nothing():
    """A row the kernel refuses (here 6-bit codes) is reported as that row of the flat table,
    not its neighbour's, and no segment of the call moves."""
    from gefen_dist.backends import native_cpu, reference

    h = reference.Hyper(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, step=1)
    levels = torch.linspace(-1, 1, 16)
    mids = (levels[1:] + levels[:-1]) / 2
    bf16 = dict(dtype=torch.bfloat16)
    dense = reference.SegmentState(
        0, 64, 1, exp_avg=torch.zeros(64, **bf16), exp_avg_sq=torch.zeros(64, **bf16)
    )
    blocked = reference.SegmentState(
        0, 64, 16, codes=torch.zeros(32, dtype=torch.uint8), absmax=torch.zeros(4), v=torch.zeros(4)
    )
    ps, gs = [torch.zeros(64), torch.zeros(64)], [torch.ones(64), torch.ones(64)]
    work = [
        SegmentWork(ps[0], gs[0], dense, h, levels, mids, 4),
        SegmentWork(ps[1], gs[1], blocked, h, levels, mids, 6),
    ]
    named = r"'START': 0, 'NUMEL': 64, 'BLOCK': 16, 'BITS': 6, "
    with pytest.raises(RuntimeError, match=r"refused a segment .*" + named):
        native_cpu.step(work)
    assert not ps[0].any() and not ps[1].any()


def _cross_segment(numel, start, block, dtype, seed, fold):
    from gefen_dist.backends import reference

    g = (torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * 2).to(dtype)
    length = block if block > 0 else -(-(start + numel) // -block)
    blocks = -(-(start % block + numel) // block) if block > 0 else 0
    st = reference.SegmentState(
        start,
        numel,
        block,
        v=torch.rand(blocks, generator=torch.Generator().manual_seed(seed + 1)) if fold else None,
        v_cross=torch.rand(length, generator=torch.Generator().manual_seed(seed + 2)),
    )
    return g, st


@pytest.mark.parametrize("threads", [1, 2])
def test_native_cross_table_equals_the_per_segment_calls(threads):
    """The one call for every factored segment gives, bit for bit, the per-segment calls' folded
    block v, and for tensors held whole the folded v_cross and factor, for the others the sums
    and counts: whether a segment runs on one thread among others or, holding most of the
    elements, on all."""
    from gefen_dist.backends import native_cpu, reference

    h = reference.Hyper(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, step=4)
    specs = [  # numel, start, block, dtype, whole; the first holds over half the elements
        (96 * 300, 0, 96, torch.float32, True),
        (4001, 37, 96, torch.bfloat16, True),
        (96 * 40, 0, -96, torch.float32, True),
        (2000, 50, 64, torch.float16, False),
        (777, 5, -97, torch.bfloat16, False),
    ]
    segs = [_cross_segment(n, s, b, dt, 10 * i, b > 0) for i, (n, s, b, dt, _) in enumerate(specs)]
    torch.set_num_threads(threads)
    try:
        mine = []
        for (g, st), spec in zip(segs, specs, strict=True):
            v = None if st.v is None else st.v.clone()
            copy = reference.SegmentState(st.start, st.numel, st.block_size, v=v)
            copy.v_cross = st.v_cross.clone()
            mine.append(CrossWork(g, copy, h, spec[4]))
        got = native_cpu.cross_table(mine).results
        for (g, st), w, (sums, counts, f) in zip(segs, mine, got, strict=True):
            mst, whole = w.seg, w.whole
            want = native_cpu.cross_sums(g, st.start, st.block_size, st.v_cross.numel(), st.v, h)
            if st.v is not None:
                assert torch.equal(mst.v, st.v)
            if whole:  # its sums only feed its factor
                assert sums is None and counts is None
                assert torch.equal(f, native_cpu.cross_factor(st, h, *want))
            else:  # its sums go to the all-reduce, and its factor waits for it
                assert torch.equal(sums, want[0]) and torch.equal(counts, want[1]) and f is None
            assert torch.equal(mst.v_cross, st.v_cross)
    finally:
        torch.set_num_threads(1)


def test_native_cross_table_refuses_a_b1_segment_and_writes_nothing():
    from gefen_dist.backends import native_cpu, reference

    h = reference.Hyper(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, step=2)
    g, st = _cross_segment(960, 0, 96, torch.float32, 0, True)
    v0 = st.v.clone()
    bad = reference.SegmentState(0, 64, 1, v_cross=torch.zeros(4))
    with pytest.raises(RuntimeError, match="refused a segment: torch.float32 gradient, block 1"):
        native_cpu.cross_table(
            [CrossWork(g, st, h, True), CrossWork(torch.zeros(64), bad, h, True)]
        )
    assert torch.equal(st.v, v0)


def _factored(numel, block, bits):
    """A segment holding its whole tensor, with v_cross still zero (a first step)."""
    from gefen_dist.backends import reference

    blocks = -(-numel // abs(block)) if block > 0 else abs(block)
    codes = torch.zeros(-(-numel // 2) if bits == 4 else numel, dtype=torch.uint8)
    return reference.SegmentState(
        0,
        numel,
        block,
        codes=codes,
        absmax=torch.zeros(blocks),
        v=torch.zeros(blocks),
        v_cross=torch.zeros(state.cross_length(block, numel)),
    )


def _clone_state(st):
    from gefen_dist.backends import reference

    return reference.SegmentState(
        st.start,
        st.numel,
        st.block_size,
        codes=st.codes.clone(),
        absmax=st.absmax.clone(),
        v=st.v.clone(),
        v_cross=st.v_cross.clone(),
    )


# numel, block, bits, g dtype: chunks of 32 rows and a tail block; an odd block at 4 bits (one
# run); under 32 rows (one chunk); bf16 and fp16 g
FUSED = [
    (96 * 300 + 50, 96, 4, torch.float32),
    (97 * 70, 97, 4, torch.bfloat16),
    (64 * 20, 64, 8, torch.float32),
    (128 * 600 + 3, 128, 8, torch.float16),
]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("numel, block, bits, gdtype", FUSED)
def test_the_step_takes_a_whole_tensors_factor_pass_in_its_update(
    numel, block, bits, gdtype, threads
):
    """Given no factor, the step takes a whole tensor's v_cross sums in the update's own read of
    g (contiguous blocks) and gives, bit for bit, what the separate pass gives: parameters,
    codes, absmax, v, v_cross over four steps, the first from a zero v_cross (the factor from
    that step's own sums), whatever the thread count."""
    from gefen_dist.backends import native_cpu, reference

    levels = torch.sort(torch.cat([torch.tensor([-1.0, 1.0]), torch.rand(2**bits - 2) * 2 - 1]))[0]
    mids = midpoints(levels)
    st = _factored(numel, block, bits)
    twin = _clone_state(st)
    gen = torch.Generator().manual_seed(3)
    p = torch.randn(numel, generator=gen)
    q = p.clone()
    torch.set_num_threads(threads)
    try:
        for t in range(1, 5):
            rows = torch.exp(torch.randn(block, generator=gen))  # positions of different scales
            g = (torch.randn(numel, generator=gen) * rows.repeat(-(-numel // block))[:numel]).to(
                gdtype
            )
            h = reference.Hyper(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=t)
            table = native_cpu.step([SegmentWork(p, g, st, h, levels, mids, bits)])
            assert table.meta[Meta.V_CROSS] == st.v_cross.data_ptr()
            sums, counts = native_cpu.cross_sums(g, 0, block, twin.v_cross.numel())
            f = native_cpu.cross_factor(twin, h, sums, counts)
            native_cpu.step([SegmentWork(q, g, twin, h, levels, mids, bits, f)])
            assert torch.equal(st.v_cross, twin.v_cross), t
            assert torch.equal(table.keep[0], f), t
            for name in ("codes", "absmax", "v"):
                assert torch.equal(getattr(st, name), getattr(twin, name)), (t, name)
            assert torch.equal(p, q), t
    finally:
        torch.set_num_threads(1)


@pytest.mark.parametrize("bits", [4, 8])
def test_the_step_takes_a_whole_column_tensors_row_sums_in_its_first_pass(bits):
    """Column blocks: the rows' sums of g^2 come from the first pass over the rows, in an order
    of their own, so against the separate pass they agree to fp64 rounding in v_cross, and the
    factor (from the step before) to an ulp; over four steps the parameters stay within the
    reference's tolerance."""
    from gefen_dist.backends import native_cpu, reference

    levels = torch.sort(torch.cat([torch.tensor([-1.0, 1.0]), torch.rand(2**bits - 2) * 2 - 1]))[0]
    mids = midpoints(levels)
    numel, block = 96 * 40 + 17, -96
    st = _factored(numel, block, bits)
    twin = _clone_state(st)
    gen = torch.Generator().manual_seed(5)
    p = torch.randn(numel, generator=gen)
    q = p.clone()
    rows = torch.exp(torch.randn(-(-numel // 96), generator=gen))
    for t in range(1, 5):
        g = torch.randn(numel, generator=gen) * rows.repeat_interleave(96)[:numel]
        h = reference.Hyper(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=t)
        table = native_cpu.step([SegmentWork(p, g, st, h, levels, mids, bits)])
        sums, counts = native_cpu.cross_sums(g, 0, block, twin.v_cross.numel())
        f = native_cpu.cross_factor(twin, h, sums, counts)
        native_cpu.step([SegmentWork(q, g, twin, h, levels, mids, bits, f)])
        torch.testing.assert_close(table.keep[0], f, rtol=2e-7, atol=0)
        torch.testing.assert_close(st.v_cross, twin.v_cross, rtol=2e-7, atol=0)
        assert st.v_cross.gt(0).all() and (table.keep[0] - f).abs().max() < 1e-5
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_a_refused_fused_row_writes_nothing():
    """A row asking the kernel for its factor pass that it cannot take (a piece starting
    inside its tensor) is refused before any v_cross, factor or parameter moves."""
    from gefen_dist.backends import native_cpu, reference

    levels = torch.linspace(-1, 1, 16)
    mids = midpoints(levels)
    h = reference.Hyper(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, step=1)
    good = _factored(64 * 20, 64, 4)
    bad = _factored(64 * 20, 64, 4)
    bad.start = 64
    ps = [torch.zeros(64 * 20), torch.zeros(64 * 20)]
    g = torch.ones(64 * 20)
    t = native_cpu.StepTable([SegmentWork(ps[0], g, good, h, levels, mids, 4)])
    t.meta.extend(
        native_cpu.table.row(ps[1], g, bad, levels, mids, 4, 1, torch.empty(64), bad.v_cross)
    )
    t.hyp.extend(native_cpu.table.hyper_row(h))
    t.done.append(0)
    with pytest.raises(RuntimeError, match="refused a segment"):
        t.run()
    assert not ps[0].any() and not good.v_cross.any() and not good.v.any()


def _turn_state(start, numel, block, bits):
    """A piece's state without v_cross (the factor, where any, is given)."""
    from gefen_dist.backends import reference
    from gefen_dist.method.segments import num_blocks

    blocks = num_blocks(start, numel, block)
    return reference.SegmentState(
        start,
        numel,
        block,
        codes=torch.zeros(-(-numel // 2) if bits == 4 else numel, dtype=torch.uint8),
        absmax=torch.zeros(blocks),
        v=torch.zeros(blocks),
    )


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("factored", [False, True], ids=["shared", "factored"])
@pytest.mark.parametrize("block", [96, -96], ids=["blocks", "columns"])
def test_cpp_takes_the_overshoot_rule_where_the_gradient_turns(block, factored, bits, monkeypatch):
    """Four steps on one gradient, then its negative: at the fifth, g opposes m nearly
    everywhere, and where an element's m_hat^2 outgrows its share of the block's v the
    reference's denominator grows (``overshoot_denominator``). The kernel must take the
    reference's step each time, from the reference's state, on a piece that starts mid-block
    (mid-row) and ends in a partial one, with the factor given or none; and at the fifth step
    over a tenth of the elements must move otherwise than with the rule-free denominator, so
    a kernel without the rule fails."""
    from gefen_dist.backends import native_cpu, reference

    levels = torch.sort(torch.cat([torch.tensor([-1.0, 1.0]), torch.rand(2**bits - 2) * 2 - 1]))[0]
    mids = midpoints(levels)
    start, numel, period = 37, 96 * 40 + 17, abs(block)
    gen = torch.Generator().manual_seed(7)
    p0 = torch.randn(numel, generator=gen)
    length = period if block > 0 else -(-(start + numel) // period)
    f = torch.exp(torch.randn(length, generator=gen)) if factored else None
    g0 = torch.randn(numel, generator=gen) * torch.exp(torch.randn(numel, generator=gen))
    st, twin = _turn_state(start, numel, block, bits), _turn_state(start, numel, block, bits)
    update = reference.block_update if block > 0 else reference.column_update
    pr, pn = p0.clone(), p0.clone()
    changed = []
    for t in range(1, 6):
        g = g0 if t < 5 else -g0
        h = reference.Hyper(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=t)
        pn.copy_(pr)
        for name in ("codes", "absmax", "v"):
            getattr(twin, name).copy_(getattr(st, name))
        free, p_free = _turn_state(start, numel, block, bits), pr.clone()
        for name in ("codes", "absmax", "v"):
            getattr(free, name).copy_(getattr(st, name))
        update(pr, g, st, h, levels, mids, bits, f)
        native_cpu.step([SegmentWork(pn, g, twin, h, levels, mids, bits, f)])
        torch.testing.assert_close(twin.v, st.v, rtol=2e-6, atol=0)
        torch.testing.assert_close(twin.absmax, st.absmax, rtol=1e-6, atol=1e-8)
        torch.testing.assert_close(pn, pr, rtol=1e-6, atol=1e-7)
        with monkeypatch.context() as mp:
            mp.setattr(reference, "overshoot_denominator", lambda shared, *_: shared.clone())
            update(p_free, g, free, h, levels, mids, bits, f)
        changed.append((~torch.isclose(pn, p_free, rtol=1e-6, atol=1e-7)).float().mean())
    # before the turn only elements whose stored m lost its sign (4-bit rounding) take the rule
    assert changed[-1] > 0.1 and changed[-1] > max(changed[:-1]), changed
