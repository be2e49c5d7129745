"""Gefen's state out of one layout and into another (``gefen_dist.method.portable``).

From a real state (the demo GPT after a few steps: row blocks, 64-row blocks, column blocks
and B = 1 tensors, at 4 and 8 bits): the same layout comes back bit for bit; a split keeps every
code and inherits v and absmax; split pieces merged again give the whole state back exactly;
pieces of different scales merge to the weighted mean of v and the max of absmax, with codes
requantised within half a level; and a whole-tensor state loads into an optimizer that holds a
piece of the tensor. What is missing, doubled or of another tensor is refused by name.
"""

import pytest
import torch

from gefen_dist import Gefen, Segment
from gefen_dist.demo.model import GPT, GPTConfig
from gefen_dist.method import partition, portable, state
from gefen_dist.method.codes import read_codes

pytestmark = pytest.mark.unit

TINY = GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=64)


def _trained(bits: int, steps: int = 3):
    """The tiny GPT's rows differ, so the partition gives it row and column blocks only; its
    fused q/k/v weight is given blocks of 64 rows (one of q, k, v: 4096 elements), the kind a
    weight of alike rows takes, so every kind of block is moved between layouts here."""
    torch.manual_seed(0)
    model = GPT(TINY)
    opt = Gefen(model.named_parameters(), lr=3e-3, weight_decay=0.1, bits=bits)
    x = torch.randint(0, 256, (4, 16))
    chosen = partition.choose_block_size

    def rows_of_qkv(stats, numel, row=0):
        return 4096 if numel == 192 * 64 else chosen(stats, numel, row)

    partition.choose_block_size = rows_of_qkv  # the first step reads it from the module
    try:
        for _ in range(steps):
            opt.zero_grad()
            model(x, x)[1].backward()
            opt.step()
    finally:
        partition.choose_block_size = chosen
    return model, opt


def _states_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) for k in a if isinstance(a[k], torch.Tensor)
    )


@pytest.fixture(scope="module", params=[4, 8], ids=["4bit", "8bit"])
def trained(request):
    return request.param, *_trained(request.param)


def test_the_model_has_every_kind_of_block(trained):
    _, _, opt = trained
    sizes = {t["block_sizes"][0] for t in opt.memory_report()["tensors"]}
    assert 1 in sizes and 64 in sizes and 4096 in sizes and -64 in sizes and -256 in sizes


def test_the_same_layout_comes_back_bit_for_bit(trained):
    _, _, opt = trained
    for i, p in enumerate(opt.param_groups[0]["params"]):
        segs = [Segment(0, p.numel(), 0, tuple(p.shape), f"t{i}")]
        got = portable.install(portable.merge(portable.export(opt.state[p], segs)), segs, p.device)
        assert _states_equal(got, opt.state[p]), f"t{i}"


@pytest.mark.parametrize("cut", [0.3, 0.5, 0.77])
def test_split_pieces_keep_every_code_and_merge_back_exactly(trained, cut):
    bits, _, opt = trained
    for i, p in enumerate(opt.param_groups[0]["params"]):
        n, shape = p.numel(), tuple(p.shape)
        whole = portable.merge(portable.export(opt.state[p], [Segment(0, n, 0, shape, "t")]))
        a = max(1, int(n * cut))
        pieces = [Segment(0, a, 0, shape, "t"), Segment(0, n - a, a, shape, "t")]
        parts = []
        for seg in pieces:  # two "ranks", each holding one piece
            st = portable.install(whole, [seg], p.device)
            got = portable.restore(whole["t"], seg.start, seg.numel)
            ts = whole["t"]
            if ts.block_size != 1:
                codes = state.segment_views(st)[0].seg.codes
                mine = whole["t"].pieces[0].codes[seg.start : seg.start + seg.numel]
                assert torch.equal(read_codes(codes, 0, seg.numel, bits), mine)
                assert torch.equal(got["codes"], mine)
            parts += portable.export(st, [seg])
        back = portable.install(portable.merge(parts), [Segment(0, n, 0, shape, "t")], p.device)
        assert _states_equal(back, opt.state[p]), f"parameter {i}"


def _blocked(opt):
    return [
        p
        for p in opt.param_groups[0]["params"]
        if int(opt.state[p]["layout"][0, 3]) not in (1,) and p.numel() > 1000
    ]


def test_pieces_of_different_scales_merge_to_weighted_v_max_absmax_and_near_codes(trained):
    bits, _, opt = trained
    for p in _blocked(opt):
        n, shape = p.numel(), tuple(p.shape)
        ts = portable.merge(portable.export(opt.state[p], [Segment(0, n, 0, shape, "t")]))["t"]
        bs = ts.block_size
        a = n // 2 + 7  # mid-block for every contiguous block size here
        left = portable.restore(ts, 0, a)
        right = portable.restore(ts, a, n - a)
        # give the right piece other statistics: a larger scale and another v
        right["absmax"] = right["absmax"] * 1.7
        right["v"] = right["v"] * 3.0
        pl = portable.Piece(0, a, left["codes"], left["absmax"], left["v"])
        pr = portable.Piece(a, n - a, right["codes"], right["absmax"], right["v"])
        mixed = portable.TensorState("t", shape, bs, ts.step, ts.codebook, ts.v_cross, [pl, pr])
        got = portable.restore(mixed, 0, n)
        # per element: the piece's v and absmax it came from, and the merged block's
        idx = torch.arange(n)
        old_l = portable._block_of(idx[:a], 0, bs)
        old_r = portable._block_of(idx[a:], a, bs)
        v_elem = torch.cat([pl.v[old_l], pr.v[old_r]]).double()
        a_elem = torch.cat([pl.absmax[old_l], pr.absmax[old_r]])
        new = portable._block_of(idx, 0, bs)
        nb = int(new.max()) + 1
        want_v = torch.zeros(nb, dtype=torch.float64).index_add_(0, new, v_elem)
        want_v /= torch.zeros(nb, dtype=torch.float64).index_add_(0, new, torch.ones(n).double())
        torch.testing.assert_close(got["v"], want_v.float(), rtol=0, atol=0)
        want_a = torch.zeros(nb).scatter_reduce(0, new, a_elem, "amax")
        assert torch.equal(got["absmax"], want_a)
        levels = ts.codebook
        m_before = levels[torch.cat([pl.codes, pr.codes]).long()] * a_elem
        m_after = levels[got["codes"].long()] * want_a[new]
        spacing = (levels[1:] - levels[:-1]).max()
        assert ((m_after - m_before).abs() <= 0.5 * spacing * want_a[new] + 1e-12).all()
        kept = a_elem == want_a[new]
        assert torch.equal(got["codes"][kept], torch.cat([pl.codes, pr.codes])[kept])
        assert (~kept).any()


def test_a_whole_tensor_state_loads_into_an_optimizer_holding_a_piece(trained):
    """What a single-process checkpoint loaded into FSDP2 does: each rank's parameter is a
    piece (here a 1-D tensor given its place with set_segments) and takes its cut of the
    saved state, then steps on."""
    bits, model, opt = trained
    sd = opt.state_dict()
    names = [n for n, _ in model.named_parameters()]
    i = names.index("transformer.h.0.mlp.c_fc.weight")
    p = opt.param_groups[0]["params"][i]
    n, shape = p.numel(), tuple(p.shape)
    start, numel = 64 * 100 + 5, 64 * 80
    piece = torch.nn.Parameter(p.detach().reshape(-1)[start : start + numel].clone())
    solo = Gefen([piece], lr=3e-3, weight_decay=0.1, bits=bits)
    solo.set_segments(piece, [Segment(0, numel, start, shape, "fc")])
    one = {
        "state": {0: sd["state"][i]},
        "param_groups": [{**sd["param_groups"][0], "params": [0]}],
    }
    solo.load_state_dict(one)
    whole = portable.merge(portable.export(opt.state[p], [Segment(0, n, 0, shape, "fc")]))
    want = portable.install(whole, [Segment(0, numel, start, shape, "fc")], p.device)
    assert _states_equal(solo.state[piece], want)
    piece.grad = torch.randn(numel)
    solo.step()
    assert int(solo.state[piece]["step"]) == int(opt.state[p]["step"]) + 1


def test_a_missing_or_doubled_piece_or_another_tensor_is_refused_by_name():
    _, opt = _trained(4, steps=1)
    p = max(opt.param_groups[0]["params"], key=lambda t: t.numel())
    n, shape = p.numel(), tuple(p.shape)
    ts = portable.merge(portable.export(opt.state[p], [Segment(0, n, 0, shape, "w")]))["w"]
    half = portable.restore(ts, 0, n // 2)
    lone = portable.TensorState(
        "w", shape, ts.block_size, ts.step, ts.codebook, ts.v_cross,
        [portable.Piece(0, n // 2, half["codes"], half["absmax"], half["v"])],
    )  # fmt: skip
    assert lone.missing() == [(n // 2, n)]
    with pytest.raises(ValueError, match=rf"w: .*no state for elements \[{n // 2}, {n}\)"):
        portable.restore(lone, 0, n)
    with pytest.raises(ValueError, match="w: two pieces hold elements from 0"):
        portable.merge([lone, lone])
    with pytest.raises(ValueError, match="another model"):
        portable.install({"w": ts}, [Segment(0, n, 0, (n,), "w")], p.device)
    with pytest.raises(ValueError, match="no state for x"):
        portable.install({"w": ts}, [Segment(0, n, 0, shape, "x")], p.device)
    other_bs = 8 if ts.block_size != 8 else 16
    other = portable.TensorState("w", shape, other_bs, ts.step, ts.codebook, ts.v_cross, [])
    with pytest.raises(ValueError, match="w: its pieces disagree on the block size"):
        portable.merge([ts, other])


def test_describe_counts_exact_split_and_merged_pieces():
    _, opt = _trained(8, steps=1)
    p = max(
        (q for q in opt.param_groups[0]["params"] if int(opt.state[q]["layout"][0, 3]) == 64),
        key=lambda t: t.numel(),
    )
    n, shape = p.numel(), tuple(p.shape)
    ts = portable.merge(portable.export(opt.state[p], [Segment(0, n, 0, shape, "w")]))
    assert portable.describe(ts, [Segment(0, n, 0, shape, "w")]) == {
        "exact": n // 64,
        "split": 0,
        "merged": 0,
    }
    cut = [Segment(0, 100, 0, shape, "w"), Segment(0, n - 100, 100, shape, "w")]
    assert portable.describe(ts, cut) == {"exact": n // 64 - 1, "split": 2, "merged": 0}
    parts = portable.merge(
        [t for s in cut for t in portable.export(portable.install(ts, [s], p.device), [s])]
    )
    assert portable.describe(parts, [Segment(0, n, 0, shape, "w")]) == {
        "exact": n // 64 - 1,
        "split": 0,
        "merged": 1,
    }


# -- a DTensor piece as segments (distributed/sharding.runs_of) ----------------------------------
def _held(shape, indices):
    """Global flattened indices of a local piece's elements, in local order."""
    g = torch.arange(int(torch.tensor(shape).prod())).view(shape)
    for d, ix in enumerate(indices):
        if ix is not None:
            g = g.index_select(d, ix)
    return g.reshape(-1)


@pytest.mark.parametrize(
    "shape,indices,count",
    [
        ((8, 6), [torch.arange(2, 6), None], 1),  # FSDP2's dim-0 shard: one run
        ((8, 6), [torch.arange(4, 8), torch.arange(0, 3)], 4),  # rowwise: a run per row
        ((8, 6), [torch.tensor([0, 1, 4, 5]), None], 2),  # strided rows: two runs
        ((8, 6), [None, torch.arange(3, 6)], 8),
        ((4, 3, 5), [torch.arange(1, 3), torch.arange(0, 2), None], 2),
        ((4, 3, 5), [None, None, torch.arange(0, 5)], 1),
        ((5,), [torch.arange(0, 0)], 1),  # an empty piece
    ],
)
def test_a_piece_becomes_the_runs_of_the_tensor_it_holds(shape, indices, count):
    from gefen_dist.distributed.sharding import runs_of

    segs = runs_of(shape, indices, "w")
    held = _held(shape, indices)
    assert len(segs) == count
    assert sum(s.numel for s in segs) == held.numel()
    for s in segs:
        assert s.shape == shape and s.name == "w"
        want = torch.arange(s.start, s.start + s.numel)
        assert torch.equal(held[s.offset : s.offset + s.numel], want)
    assert [s.offset for s in segs] == sorted(s.offset for s in segs)
