import itertools

import numpy as np
import pytest
import torch

from gefen_dist.method import codebook as cb

pytestmark = pytest.mark.unit

torch.set_num_threads(1)


def _cluster_cost(x, w, lo, hi, level=None):
    if hi <= lo:
        return 0.0
    xs, ws = x[lo:hi], w[lo:hi]
    if level is None:
        if ws.sum() == 0:
            return 0.0
        level = np.dot(ws, xs) / ws.sum()
    return float(np.dot(ws, (xs - level) ** 2))


def _brute_force(counts, n_levels):
    """Every way to cut the bins into [pinned -1 | n_levels-2 free | pinned +1] contiguous runs."""
    w = np.asarray(counts, dtype=np.float64)
    x = cb.bin_centers(w.size).numpy()
    n = w.size
    free = [[_cluster_cost(x, w, a, b) for b in range(n + 1)] for a in range(n + 1)]
    left = [_cluster_cost(x, w, 0, b, -1.0) for b in range(n + 1)]
    right = [_cluster_cost(x, w, a, n, 1.0) for a in range(n + 1)]
    best = np.inf
    for cuts in itertools.combinations_with_replacement(range(n + 1), n_levels - 1):
        cost = left[cuts[0]] + right[cuts[-1]]
        for a, b in zip(cuts[:-1], cuts[1:], strict=True):
            cost += free[a][b]
        best = min(best, cost)
    return best


def _quadratic_dp(counts, n_levels):
    """Plain O(K N^2) DP without the monotone-argmin shortcut, to check the divide and conquer."""
    w = np.asarray(counts, dtype=np.float64)
    x = cb.bin_centers(w.size).numpy()
    s0, s1, s2 = (np.concatenate([[0.0], np.cumsum(v)]) for v in (w, w * x, w * x * x))
    i, j = np.meshgrid(np.arange(w.size + 1), np.arange(w.size + 1), indexing="ij")
    cw = s0[j] - s0[i]
    d1 = s1[j] - s1[i]
    with np.errstate(divide="ignore", invalid="ignore"):
        sse = np.where((j > i) & (cw > 0), (s2[j] - s2[i]) - d1 * d1 / cw, 0.0)
    sse = np.where(j >= i, np.maximum(sse, 0.0), np.inf)
    f = s2 + 2 * s1 + s0
    for _ in range(n_levels - 2):
        f = (f[:, None] + sse).min(axis=0)
    right = (s2[-1] - s2) - 2 * (s1[-1] - s1) + (s0[-1] - s0)
    return float((f + right).min())


def _block_normalised(kind, n=1 << 16, block=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    if kind == "gauss":
        x = torch.randn(n, generator=g, dtype=torch.float64)
    elif kind == "laplace":
        u = torch.rand(n, generator=g, dtype=torch.float64) - 0.5
        x = -torch.sign(u) * torch.log1p(-2 * u.abs())
    else:
        z = torch.randn(n, generator=g, dtype=torch.float64)
        chi2 = (torch.randn(n, 3, generator=g, dtype=torch.float64) ** 2).sum(1)
        x = z / torch.sqrt(chi2 / 3)
    x = x.reshape(-1, block)
    return (x / x.abs().amax(dim=1, keepdim=True)).float()


def _assert_valid(levels, bits):
    assert isinstance(levels, torch.Tensor)
    assert levels.dtype == torch.float32
    assert levels.shape == (2**bits,)
    assert levels[0].item() == -1.0
    assert levels[-1].item() == 1.0
    assert bool((levels[1:] > levels[:-1]).all())
    assert bool(torch.isfinite(levels).all())


def test_dp_matches_brute_force_on_small_histograms():
    rng = np.random.default_rng(1)
    for _ in range(60):
        n_bins = int(rng.integers(6, 13))
        n_levels = int(rng.integers(2, 7))
        counts = rng.exponential(size=n_bins) * (rng.random(n_bins) < 0.8)
        if rng.random() < 0.5:
            counts = np.round(counts * 10)
        brute = _brute_force(counts, n_levels)
        levels, cost = cb._optimal_levels(counts, n_levels)
        assert levels.size == n_levels
        assert levels[0] == -1.0 and levels[-1] == 1.0
        assert np.all(np.diff(levels) > 0)
        scale = max(brute, 1e-300)
        assert abs(cost - brute) <= 1e-12 * scale + 1e-15
        assert abs(cb.quantization_error(counts, levels) - brute) <= 1e-12 * scale + 1e-15


@pytest.mark.parametrize("n_levels", [3, 16, 41])
def test_divide_and_conquer_matches_quadratic_dp(n_levels):
    rng = np.random.default_rng(n_levels)
    counts = rng.poisson(rng.gamma(0.5, 20, size=300)).astype(np.float64)
    _, cost = cb._optimal_levels(counts, n_levels)
    ref = _quadratic_dp(counts, n_levels)
    assert cost == pytest.approx(ref, rel=1e-10)


@pytest.mark.parametrize("kind", ["gauss", "laplace", "student_t"])
@pytest.mark.parametrize("bits", [4, 8])
def test_never_worse_than_baselines(kind, bits):
    counts = cb.histogram(_block_normalised(kind))
    levels = cb.learn_codebook(counts, bits)
    _assert_valid(levels, bits)
    err = cb.quantization_error(counts, levels)
    _, optimum = cb._optimal_levels(counts, 2**bits)
    assert err == pytest.approx(optimum, rel=1e-5)
    baselines = {
        "lloyd": cb.lloyd_max(counts, bits),
        "uniform": cb.uniform_levels(bits),
        "dynamic": cb.dynamic_levels(bits),
    }
    for name, base in baselines.items():
        _assert_valid(base, bits)
        base_err = cb.quantization_error(counts, base)
        assert err <= base_err * (1 + 1e-6), name
    assert err < 0.9 * cb.quantization_error(counts, baselines["uniform"])
    assert err < 0.5 * cb.quantization_error(counts, baselines["dynamic"])


@pytest.mark.parametrize("bits", range(1, 9))
def test_invariants_for_every_bit_width(bits):
    counts = np.random.default_rng(bits).random(cb.DEFAULT_BINS)
    _assert_valid(cb.learn_codebook(counts, bits), bits)
    _assert_valid(cb.uniform_levels(bits), bits)
    _assert_valid(cb.dynamic_levels(bits), bits)
    _assert_valid(cb.lloyd_max(counts, bits), bits)


def test_torch_and_numpy_counts_agree_and_scale_does_not_matter():
    counts = cb.histogram(_block_normalised("laplace", n=1 << 14))
    a = cb.learn_codebook(counts, 4)
    b = cb.learn_codebook(counts.numpy(), 4)
    c = cb.learn_codebook(counts * 8.0, 4)
    assert torch.equal(a, b)
    assert torch.equal(a, c)


@pytest.mark.parametrize("bits", [4, 8])
def test_all_zero_counts_give_uniform_levels(bits):
    levels = cb.learn_codebook(torch.zeros(cb.DEFAULT_BINS, dtype=torch.float64), bits)
    _assert_valid(levels, bits)
    assert torch.equal(levels, cb.uniform_levels(bits))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(
    "nonempty", [[2048], [0], [4095], [1000, 3000], [2047, 2048], [0, 4095], list(range(5))]
)
def test_degenerate_histograms_give_valid_levels(bits, nonempty):
    counts = np.zeros(cb.DEFAULT_BINS)
    counts[nonempty] = 7.0
    levels = cb.learn_codebook(counts, bits)
    _assert_valid(levels, bits)
    centers = cb.bin_centers(cb.DEFAULT_BINS).numpy()[nonempty]
    if len(nonempty) <= 2**bits - 2:
        # enough free levels to sit on every occupied bin
        assert cb.quantization_error(counts, levels) <= 1e-12 * counts.sum()
        assert np.isin(centers.astype(np.float32), levels.numpy()).all()


def test_unused_levels_are_spread_over_the_widest_gaps():
    counts = np.zeros(cb.DEFAULT_BINS)
    counts[2048] = 1.0
    levels = cb.learn_codebook(counts, 4).double()
    gaps = levels.diff()
    assert gaps.max() / gaps.min() < 1.2


@pytest.mark.parametrize(
    ("counts", "match"),
    [
        (np.array([1.0, np.nan, 2.0]), "NaN or inf"),
        (np.array([1.0, np.inf, 2.0]), "NaN or inf"),
        (np.array([1.0, -1.0, 2.0]), "non-negative"),
        (np.ones((4, 4)), "1-D"),
        (torch.ones(2, 8, dtype=torch.float64), "1-D"),
        (np.array([]), "at least one bin"),
    ],
)
def test_bad_counts_raise(counts, match):
    with pytest.raises(ValueError, match=match):
        cb.learn_codebook(counts, 4)


@pytest.mark.parametrize("bits", [0, 9, -1, 4.0, True])
def test_bad_bits_raise(bits):
    with pytest.raises(ValueError, match="bits"):
        cb.learn_codebook(np.ones(16), bits)
    with pytest.raises(ValueError, match="bits"):
        cb.uniform_levels(bits)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_histogram_rejects_non_finite(bad):
    x = torch.zeros(10)
    x[3] = bad
    with pytest.raises(ValueError, match="NaN or inf"):
        cb.histogram(x)


def test_histogram_rejects_bad_out_and_integer_input():
    with pytest.raises(ValueError, match="float64"):
        cb.histogram(torch.zeros(4), bins=8, out=torch.zeros(8, dtype=torch.float32))
    with pytest.raises(ValueError, match="shape"):
        cb.histogram(torch.zeros(4), bins=8, out=torch.zeros(16, dtype=torch.float64))
    with pytest.raises(TypeError):
        cb.histogram(torch.zeros(4, dtype=torch.int32))


def test_histogram_counts_and_chunking(monkeypatch):
    x = _block_normalised("gauss", n=1 << 14)
    h = cb.histogram(x)
    assert h.dtype == torch.float64 and h.shape == (cb.DEFAULT_BINS,)
    assert h.sum().item() == x.numel()
    out = torch.zeros(cb.DEFAULT_BINS, dtype=torch.float64)
    for part in x.reshape(-1).split(1000):
        assert cb.histogram(part, out=out) is out
    assert torch.equal(out, h)
    monkeypatch.setattr(cb, "_HIST_CHUNK", 777)
    assert torch.equal(cb.histogram(x), h)


def test_histogram_edges_and_clamping():
    bins = 8
    x = torch.tensor([-1.0, 1.0, -1.0 - 1e-7, 1.0 + 1e-7, 0.0, -0.25, 0.2499])
    h = cb.histogram(x, bins=bins)
    assert h.tolist() == [2.0, 0.0, 0.0, 1.0, 2.0, 0.0, 0.0, 2.0]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_histogram_dtypes_agree(dtype):
    x = _block_normalised("student_t", n=1 << 12).to(dtype)
    ref = cb.histogram(x.double())
    got = cb.histogram(x)
    assert torch.equal(got, ref)
    assert got[0] + got[-1] >= x.shape[0]


def test_quantization_error_by_hand():
    counts = np.array([1.0, 2.0, 0.0, 3.0])
    centers = cb.bin_centers(4).numpy()
    assert np.allclose(centers, [-0.75, -0.25, 0.25, 0.75])
    levels = np.array([-1.0, 0.0, 1.0])
    expected = 1 * 0.25**2 + 2 * 0.25**2 + 3 * 0.25**2
    assert cb.quantization_error(counts, levels) == pytest.approx(expected, rel=1e-15)


def test_dynamic_levels_shape():
    lv = cb.dynamic_levels(8).double().numpy()
    assert lv.size == 256 and np.unique(lv).size == 256
    assert 0.0 in lv
    nonzero = np.abs(lv[lv != 0])
    assert nonzero.min() < 1e-5  # decades down to 1e-6: the point of the dynamic map
    assert np.abs(lv).max() == 1.0
    assert np.allclose(cb.uniform_levels(4).double().diff().numpy(), 2 / 15)
