import math

import pytest
import torch

from gefen_dist.method import partition as pt

pytestmark = pytest.mark.unit


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _rows(n_rows, row, seed=0):
    """Gradients whose rows have distinct scales (log-normal), noise inside a row."""
    g = _gen(seed)
    return torch.exp(torch.randn(n_rows, 1, generator=g)) * torch.randn(n_rows, row, generator=g)


@pytest.mark.parametrize("flat", [False, True])
def test_rows_of_distinct_scale_give_one_row(flat):
    x = _rows(256, 384)
    shape = (x.numel(),) if flat else tuple(x.shape)
    assert pt.block_size_for(x.reshape(-1), shape) == 384


@pytest.mark.parametrize("flat", [False, True])
def test_heads_of_several_rows_give_a_head(flat):
    g = _gen(1)
    head_scale = torch.exp(torch.randn(32, 1, 1, generator=g)).expand(32, 4, 1).reshape(128, 1)
    x = head_scale * torch.randn(128, 96, generator=g)
    shape = (x.numel(),) if flat else tuple(x.shape)
    assert pt.block_size_for(x.reshape(-1), shape) == 4 * 96


@pytest.mark.parametrize("flat", [False, True])
def test_fused_qkv_non_power_of_two_gives_aligned_row(flat):
    # (3 * 96, 96): 27648 = 2^10 * 27 elements, so 64, 128, 256, 512 are divisors that straddle rows
    x = _rows(3 * 96, 96, seed=2)
    shape = (x.numel(),) if flat else tuple(x.shape)
    cands = pt.candidate_block_sizes(shape)
    if flat:
        assert {128, 256, 144} <= set(cands)
    assert pt.block_size_for(x.reshape(-1), shape) == 96


@pytest.mark.parametrize("n", [4096, 5000, 65536, 3 * 2**15, 300000])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_iid_noise_of_varied_scales_gives_no_sharing(n, seed):
    """Elements that differ (each its own scale) but in no pattern a block follows: B = 1."""
    g = _gen(seed)
    x = torch.exp(torch.randn(n, generator=g)) * torch.randn(n, generator=g)
    assert pt.block_size_for(x) == 1
    assert pt.block_size_for(x.view(-1, 8) if n % 8 == 0 else x) == 1


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_iid_noise_of_one_scale_shares_per_row(seed):
    """Step 6: no structure, but every element has the same variance: one v per row."""
    x = torch.randn(96, 432, generator=_gen(seed))
    stats = pt.segment_stats(x.reshape(-1), 0, pt.candidate_block_sizes((96, 432)), 432)
    assert abs(pt.spread(stats, x.numel())) < 0.05
    assert pt.choose_block_size(stats, x.numel()) == 1  # steps 1-5 alone find nothing
    assert pt.block_size_for(x) == 432
    assert pt.block_size_for(torch.randn(5000, generator=_gen(seed))) == 1  # 1-D: no rows
    # 4-D (a 3x3 convolution): the row is everything but the first dim
    assert pt.block_size_for(torch.randn(48, 48, 3, 3, generator=_gen(seed))) == 432


@pytest.mark.parametrize("c", [0.1, 0.3, 0.7, 1.5])
def test_alike_threshold_follows_the_spread_of_variances(c):
    """Variances s^2 drawn with CV^2(s^2) = c (gamma): the estimate recovers c, and the tensor
    shares per row exactly when c <= ALIKE."""
    torch.manual_seed(7)  # Gamma.sample takes no generator
    n = 400_000
    var = torch.distributions.Gamma(1.0 / c, 1.0 / c).sample((n,))
    x = var.sqrt() * torch.randn(n)
    stats = pt.segment_stats(x, 0, pt.candidate_block_sizes((800, 500)), 500)
    assert abs(pt.spread(stats, n) - c) < 0.05 * c + 0.02  # ~3x the error over 10 seeds
    assert pt.block_size_for(x.view(800, 500)) == (500 if c <= pt.ALIKE else 1)


@pytest.mark.parametrize("n", [7919, 65521])
def test_prime_sizes_give_no_sharing(n):
    # structure is planted, but a prime size has no block size that tiles it
    scale = torch.exp(torch.arange(n, dtype=torch.float32) // 97 * 0.1)
    x = scale * torch.randn(n, generator=_gen())
    assert pt.block_size_for(x) == 1


def test_small_tensors_give_no_sharing_and_zero_ones_their_rows():
    assert pt.block_size_for(_rows(8, 256).reshape(-1)[:1024]) == 1  # under MIN_SHARED_NUMEL
    # an all-zero g0 (a LoRA A whose B is zero): its elements are alike (step 7), so rows
    assert pt.block_size_for(torch.zeros(64, 256)) == 256
    assert pt.block_size_for(torch.zeros(64 * 256)) == 1  # one dim: step 6 leaves it alone
    # a constant gradient: nothing in R, but every element alike (step 6)
    assert pt.block_size_for(torch.full((64, 256), 3.0)) == 256
    assert pt.block_size_for(torch.zeros(0)) == 1
    assert pt.block_size_for(torch.ones(1)) == 1


def test_candidates_are_row_aligned_divisors():
    cands = pt.candidate_block_sizes((288, 96))
    assert all(27648 % p == 0 for p in cands)
    assert all(96 % p == 0 or p % 96 == 0 for p in cands)
    assert 96 in cands and 4 * 96 in cands and 128 not in cands and 144 not in cands
    assert min(cands) >= pt.MIN_BLOCK and max(cands) <= 27648 // 2


@pytest.mark.parametrize(
    "cuts",
    [[0, 27648], [0, 5000, 27648], [0, 1, 95, 96, 1000, 13824, 27647, 27648], [0, 17, 40, 27648]],
)
def test_pieces_merge_to_the_whole_tensor_statistics(cuts):
    """Statistics gathered per segment (as ranks or FSDP shards hold them) merge exactly."""
    x = _rows(288, 96, seed=3).reshape(-1)
    cands = pt.candidate_block_sizes((288, 96))
    whole = pt.segment_stats(x, 0, cands)
    parts = [pt.segment_stats(x[a:b], a, cands) for a, b in zip(cuts, cuts[1:], strict=False)]
    merged = pt.merge_stats(parts[::-1])
    r_whole = pt.heterogeneity(whole, x.numel())
    r_merged = pt.heterogeneity(merged, x.numel())
    assert r_merged == pytest.approx(r_whole, rel=1e-9)
    assert pt.choose_block_size(merged, x.numel()) == pt.choose_block_size(whole, x.numel()) == 96


@pytest.mark.parametrize("cuts", [[0, 5000, 27648], [0, 1, 95, 13824, 27647, 27648]])
def test_pieces_merge_to_the_same_alike_choice(cuts):
    """Step 6 reads only additive moments, so ranks holding pieces choose as one process."""
    x = torch.randn(288 * 96, generator=_gen(5))
    cands = pt.candidate_block_sizes((288, 96))
    parts = [pt.segment_stats(x[a:b], a, cands) for a, b in zip(cuts, cuts[1:], strict=False)]
    merged = pt.merge_stats(parts[::-1])
    assert pt.spread(merged, x.numel()) == pytest.approx(
        pt.spread(pt.segment_stats(x, 0, cands), x.numel()), rel=1e-9
    )
    assert pt.choose_block_size(merged, x.numel(), 96) == 96


def test_statistics_that_miss_elements_are_refused():
    x = _rows(288, 96).reshape(-1)
    cands = pt.candidate_block_sizes((288, 96))
    part = pt.segment_stats(x[:1000], 0, cands)
    with pytest.raises(ValueError, match="cover 1000 of 27648"):
        pt.heterogeneity(part, x.numel())


def test_chunked_statistics_equal_one_pass(monkeypatch):
    x = _rows(288, 96, seed=4).reshape(-1)
    cands = pt.candidate_block_sizes((288, 96))
    one = pt.segment_stats(x[5:], 5, cands)
    monkeypatch.setattr(pt, "_CHUNK", {"cpu": 1000})
    chunked = pt.segment_stats(x[5:], 5, cands)
    assert chunked.block_sq == pytest.approx(one.block_sq, rel=1e-12)
    assert chunked.partial == [pytest.approx(d, rel=1e-12) for d in one.partial]


# ---------------------------------------------------------------------------------------------
# Columns: the strided reading of the period (module docstring, step 5)


def _cols(n_rows, row, seed=0, row_spread=0.0):
    """Gradients whose columns have distinct scales (an input axis of varying scale), optionally
    with a weaker spread of row scales on top."""
    g = _gen(seed)
    cols = torch.exp(torch.randn(1, row, generator=g))
    rows = torch.exp(row_spread * torch.randn(n_rows, 1, generator=g))
    return rows * cols * torch.randn(n_rows, row, generator=g)


@pytest.mark.parametrize("shape", [(256, 192), (192, 512), (48, 16, 3, 3), (101, 63)])
def test_columns_of_distinct_scale_give_columns(shape):
    x = _cols(shape[0], math.prod(shape[1:]), seed=3).view(shape)
    assert pt.block_size_for(x) == -math.prod(shape[1:])


def test_columns_win_only_where_they_are_the_more_alike():
    weak_cols = _rows(256, 192, seed=4) * _cols(1, 192, seed=5).abs().pow(0.2)
    assert pt.block_size_for(weak_cols) == 192
    assert pt.block_size_for(_cols(256, 192, seed=6, row_spread=0.3)) == -192


def test_columns_need_a_shape_and_enough_rows():
    x = _cols(256, 192, seed=7)
    assert pt.block_size_for(x.reshape(-1)) > 0  # a flat buffer hides its columns
    assert pt.column_period((4, 4096)) == 0  # columns of 4 elements: below MIN_BLOCK
    assert pt.column_period((256,)) == 0
    assert pt.column_period((16, 16)) == 0  # under MIN_SHARED_NUMEL
    assert pt.column_period((256, 192)) == 192
    assert pt.column_period((8, pt.MAX_BLOCK + 1)) == 0


def test_column_statistics_of_pieces_merge_to_the_whole():
    x = _cols(101, 63, seed=8).reshape(-1)
    cands = pt.candidate_block_sizes((101, 63))
    cuts = [0, 5, 63, 64, 2000, 4010, x.numel()]
    whole = pt.segment_stats(x, 0, cands, 63)
    parts = [pt.segment_stats(x[a:b], a, cands, 63) for a, b in zip(cuts, cuts[1:], strict=False)]
    merged = pt.merge_stats(parts)
    torch.testing.assert_close(merged.col_sums, whole.col_sums, rtol=1e-12, atol=0)
    want = (x.double().square().view(101, 63)).sum(dim=0)
    torch.testing.assert_close(whole.col_sums, want, rtol=1e-12, atol=0)
    assert pt.choose_block_size(merged, x.numel()) == pt.choose_block_size(whole, x.numel()) == -63
    with pytest.raises(ValueError, match="period"):
        pt.merge_stats([whole, pt.segment_stats(x, 0, cands, 0)])


def _gates(seed, gate_spread, row_spread, n_gates=3, rows=64, row=96):
    """Stacked gate matrices (a GRU's weight_hh: r, z, n on top of each other): g0 has one scale
    per gate and, inside a gate, one per row."""
    g = _gen(seed)
    gate = torch.exp(gate_spread * torch.randn(n_gates, 1, 1, generator=g))
    gate = gate.expand(n_gates, rows, 1).reshape(n_gates * rows, 1)
    rows_ = torch.exp(row_spread * torch.randn(n_gates * rows, 1, generator=g))
    return gate * rows_ * torch.randn(n_gates * rows, row, generator=g)


@pytest.mark.parametrize(("seed", "gate_spread", "row_spread"), [(0, 1.5, 0.5), (3, 2.0, 0.3)])
def test_gates_of_distinct_rows_give_a_row(seed, gate_spread, row_spread):
    """The gate is the largest jump here, but its rows differ (R(gate) >= (1 + JUMP) R(row)):
    blocks stay within a row. (3, 2.0, 0.3): no candidate inside a row has a clear jump of its
    own, so the row itself."""
    x = _gates(seed, gate_spread, row_spread)
    stats = pt.segment_stats(x.reshape(-1), 0, pt.candidate_block_sizes(tuple(x.shape)))
    assert pt._contiguous(stats, x.numel())[0] == 64 * 96  # the gate, without the rows test
    assert pt.block_size_for(x) == 96
