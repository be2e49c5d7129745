import pytest
import torch

from gefen_dist import codes
from gefen_dist.codebook import uniform_levels


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
