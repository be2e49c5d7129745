import pytest
import torch

from gefen_dist.method import codes
from gefen_dist.method.codebook import uniform_levels

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("n", [0, 1, 2, 7, 8, 1001])
def test_pack_unpack_roundtrip(n):
    c = torch.randint(0, 16, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    packed = codes.pack4(c)
    assert packed.dtype == torch.uint8 and packed.numel() == (n + 1) // 2
    assert torch.equal(codes.unpack4(packed, n), c)


def test_nibble_order_is_low_first():
    assert codes.pack4(torch.tensor([1, 2, 3], dtype=torch.uint8)).tolist() == [0x21, 0x03]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n", [1, 9, 64, 101])
def test_read_write_any_range_matches_unpacked(bits, n):
    g = torch.Generator().manual_seed(n + bits)
    top = 16 if bits == 4 else 256
    truth = torch.randint(0, top, (n,), dtype=torch.uint8, generator=g)
    store = codes.pack4(truth) if bits == 4 else truth.clone()
    for _ in range(50):
        a = int(torch.randint(0, n, (1,), generator=g))
        b = int(torch.randint(a, n + 1, (1,), generator=g))
        assert torch.equal(codes.read_codes(store, a, b, bits), truth[a:b])
        new = torch.randint(0, top, (b - a,), dtype=torch.uint8, generator=g)
        codes.write_codes(store, a, b, new, bits)
        truth[a:b] = new
        full = codes.unpack4(store, n) if bits == 4 else store
        assert torch.equal(full, truth)
    if bits == 4 and n % 2:
        assert int(store[-1]) >> 4 == 0  # the pad nibble stays zero


def test_quantize_is_nearest_level_ties_to_lower():
    levels = uniform_levels(4).double()
    mids = codes.midpoints(levels)
    x = torch.cat([torch.linspace(-1, 1, 2001, dtype=torch.float64), mids])
    q = codes.quantize(x, mids).long()
    dist = (x[:, None] - levels[None, :]).abs()
    best = dist.min(dim=1).values
    assert torch.equal(dist[torch.arange(x.numel()), q], best)
    assert torch.equal(q[-mids.numel() :], torch.arange(mids.numel()))


def _cell(x: torch.Tensor, cells: int) -> torch.Tensor:
    """csrc/gefen_cpu.cpp's cell(): fp32 (x + 1) * cells / 2, truncated, clamped."""
    return ((x + 1.0) * float(cells // 2)).to(torch.int64).clamp(0, cells - 1)


@pytest.mark.parametrize("crowded", [False, True])
def test_code_table_answers_are_exact_where_given(crowded):
    """Where the table gives a code it is bucketize's for every x the kernel maps to that cell,
    including x on and next to midpoints and cell edges; only cells near a midpoint defer."""
    cells = 8192
    levels = uniform_levels(8)
    if crowded:  # two levels closer than a cell, as a DP codebook may put them near zero
        levels = torch.sort(torch.cat([levels[:-2], torch.tensor([0.00001, 0.00003])]))[0]
    mids = codes.midpoints(levels)
    table = codes.code_table(mids, cells)
    assert table.dtype == torch.int32 and table.numel() == cells
    g = torch.Generator().manual_seed(0)
    edges = torch.linspace(-1.0, 1.0, cells + 1)
    probes = torch.cat([torch.rand(200_000, generator=g) * 2 - 1, mids, edges])
    up, down = torch.full_like(probes, 2.0), torch.full_like(probes, -2.0)
    x = torch.cat([probes, torch.nextafter(probes, up), torch.nextafter(probes, down)])
    x = x.clamp(-1.0, 1.0)
    t = table[_cell(x, cells)].long()
    given = t >= 0
    assert torch.equal(t[given], torch.bucketize(x[given], mids))
    # deferred cells are those with a midpoint within one cell width (closed): at most 4 each
    assert 0 < int((table < 0).sum()) <= 4 * mids.numel()
    # a deferred cell's start is the count below its widened left edge: never past the answer
    deferred = ~given
    assert bool((-1 - t[deferred] <= torch.bucketize(x[deferred], mids)).all())
    assert codes.code_table(mids, cells) is table  # cached while mids lives


def test_uniforms_are_a_deterministic_uniform_hash_of_step_and_index():
    idx = torch.arange(1 << 16)
    u = codes.uniforms(7, idx)
    assert u.dtype == torch.float32 and bool(((u >= 0) & (u < 1)).all())
    assert torch.equal(u, codes.uniforms(7, idx.clone()))  # a hash: same (step, index), same u
    assert torch.equal(u[100:200], codes.uniforms(7, idx[100:200]))  # any slice of the tensor
    assert not torch.equal(u, codes.uniforms(8, idx))  # a new draw every step
    counts = torch.histc(u, bins=16, min=0.0, max=1.0)
    assert float(counts.min()) > 0.9 * u.numel() / 16 and float(counts.max()) < 1.1 * u.numel() / 16
    assert abs(float(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1])) < 0.02


def test_step_key_is_the_tensor_hash_of_the_step():
    steps = [0, 1, 2, 1000, 2**31 + 5, 2**32 + 3]
    want = codes._mix32(torch.tensor([s & 0xFFFFFFFF for s in steps], dtype=torch.int64))
    assert [codes.step_key(s) for s in steps] == want.tolist()


def test_stochastic_quantize_is_unbiased_between_neighbouring_levels():
    levels = uniform_levels(4)
    x = torch.linspace(-1.0, 1.0, 37)
    n = 4000
    draws = torch.stack(
        [
            codes.stochastic_quantize(x, levels, codes.uniforms(s, torch.arange(37)))
            for s in range(n)
        ]
    ).long()
    low = torch.bucketize(x, levels[1:-1], right=True)
    assert bool(((draws == low) | (draws == low + 1)).all())  # only the two neighbours
    assert torch.allclose(levels[draws].mean(dim=0), x, atol=0.01)  # E[level] = x
    on_level = codes.stochastic_quantize(levels, levels, torch.rand(16))
    assert torch.equal(on_level.long(), torch.arange(16))  # a level stays itself


def test_stochastic_rounding_lets_a_quiet_first_moment_decay():
    """The dead zone that 4-bit codes round stochastically to avoid: one entry keeps the block's
    absmax up, the others' gradients stop. Nearest rounding keeps their m where it was; the
    stochastic codes decay it on average as AdamW's m does (0.9^t)."""
    levels = uniform_levels(4)
    mids = codes.midpoints(levels)
    n = 4096
    idx = torch.arange(n)

    def run(stochastic: bool) -> float:
        m = torch.zeros(n)
        for step in range(1, 61):
            g = torch.full((n,), 0.3 if step <= 10 else 0.0)
            g[0] = 1.0  # the loud entry: absmax stays ~1
            m = 0.9 * m + 0.1 * g
            amax = m.abs().max()
            x = m / amax
            q = (
                codes.stochastic_quantize(x, levels, codes.uniforms(step, idx))
                if stochastic
                else codes.quantize(x, mids)
            )
            m = levels[q.long()] * amax
        return float(m[1:].mean())

    exact = 0.3 * (1 - 0.9**10) * 0.9**50  # AdamW's m of a quiet entry
    assert run(stochastic=False) > 0.1  # stuck
    assert abs(run(stochastic=True) - exact) < 0.01


def test_round_bf16_is_unbiased_between_neighbouring_bf16_values():
    x = torch.tensor([1.0 + 2**-9, -3.3, 3e-30, 0.7, 1e30])
    lo = x.to(torch.bfloat16).float()  # a neighbour; the other is one spacing away
    n = 20000
    r = codes.hash_bits(7, torch.arange(n * x.numel())).view(n, -1)
    out = torch.stack([codes.round_bf16(x, r[i] & 0xFFFF) for i in range(n)]).float()
    spacing = (x.abs() * 2**-7).float()
    assert bool(((out - x).abs() < spacing * 1.01).all())  # only the two neighbours
    assert torch.allclose(out.mean(0), x, rtol=2e-4)  # E = x
    assert len(set(out[:, 0].tolist())) == 2 and lo[0] in out[:, 0]
    exact = torch.tensor([1.0, -2.5, 0.0, -0.0, float("inf")])
    for bits in (0, 0xFFFF):
        same = codes.round_bf16(exact, torch.full((5,), bits))
        assert torch.equal(same.float(), exact)  # a bf16 value stays itself
    nan = codes.round_bf16(torch.tensor([float("nan")]), torch.tensor([0xFFFF]))
    assert bool(nan.isnan().all())


def test_round_bf16_uses_the_hash_that_uniforms_uses():
    idx = torch.arange(1000)
    h = codes.hash_bits(5, idx)
    assert torch.equal((h >> 8).float() * 2.0**-24, codes.uniforms(5, idx))
