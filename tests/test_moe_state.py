"""Gefen's state on mixture-of-experts weights: a batch of matrices is partitioned per matrix.

Why these tests: grouped expert weights (E, F, D) / (E, D, F) fell back to per-element state
(1-2.7 bytes/param at 4 bits) because the partition read them as E rows of whole experts
(research/moe_partition.md). Each expert's matrix is now blocked as a 2-D weight, one choice per
tensor by vote; an expert no token reached abstains. The bytes must be those of the same experts
stored as ``nn.Linear`` modules, whatever the storage.
"""

from __future__ import annotations

import copy

import pytest
import torch

from gefen_dist import Gefen
from gefen_dist.bench.moe import STORAGES, MoEConfig, MoELM
from gefen_dist.method import partition as pt
from gefen_dist.method.segments import Segment, by_matrix, tensor_keys, whole_tensor
from gefen_dist.method.state import segment_views

pytestmark = pytest.mark.unit

E, R, C = 8, 64, 96


def _experts_by_column(seed: int = 0, zero: tuple[int, ...] = ()) -> torch.Tensor:
    """g0 of an (E, R, C) weight whose experts vary along their input axis (columns), each
    expert at its own scale, as a down projection's first gradient does; ``zero`` experts got
    no token."""
    g = torch.Generator().manual_seed(seed)
    col = torch.logspace(-1, 1, C)[torch.randperm(C, generator=g)]
    scale = torch.logspace(-2, 2, E)[torch.randperm(E, generator=g)]
    x = torch.randn(E, R, C, generator=g) * col * scale[:, None, None]
    x[list(zero)] = 0
    return x


def _experts_by_row(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    row = torch.logspace(-1, 1, R)[torch.randperm(R, generator=g)]
    scale = torch.logspace(-2, 2, E)[torch.randperm(E, generator=g)]
    return torch.randn(E, R, C, generator=g) * row[:, None] * scale[:, None, None]


def test_which_tensors_are_batches_of_matrices():
    assert pt.matrix_batch((8, 64, 96)) == pt.MatrixBatch(8, 64, 96)
    assert pt.matrix_batch((2, 4, 64, 96)) == pt.MatrixBatch(8, 64, 96)  # stacked leading dims
    assert pt.matrix_batch((64, 96)) is None  # a matrix: today's 2-D rule
    assert pt.matrix_batch((48, 48, 3, 3)) is None  # a 3x3 convolution: its kernel is no matrix
    assert pt.matrix_batch((8, 32, 64)) is None  # 2048-element matrices: under MIN_SHARED_NUMEL


def test_experts_that_vary_by_column_get_columns_inside_each_expert():
    assert pt.block_size_for(_experts_by_column()) == -C
    # the same experts, stored transposed (x @ w): their rows vary, a row of one expert
    assert pt.block_size_for(_experts_by_column().transpose(1, 2).contiguous()) == R
    assert pt.block_size_for(_experts_by_row()) == C


def test_unrouted_experts_abstain():
    full = pt.block_size_for(_experts_by_column())
    assert pt.block_size_for(_experts_by_column(zero=(1, 5, 6))) == full
    # all eight unrouted: nothing to read, every element alike; a row of one expert
    assert pt.block_size_for(torch.zeros(E, R, C)) == C


def test_the_vote_breaks_ties_by_the_larger_block():
    stats = {}
    cols = _experts_by_column()
    rows = _experts_by_row()
    batch = pt.MatrixBatch(E, R, C)
    for k in range(E):
        g = cols[k] if k < E // 2 else rows[k]
        (piece,) = pt.stats_requests(g.reshape(-1), 0, (R, C))
        stats[k] = pt.stats_of([piece.request])[0]
    assert pt.choose_batched(stats, batch) == C  # 4 votes each; a row (96) beats a column (64)


def test_segments_are_cut_at_each_matrix_and_keep_one_tensor_key():
    shape = (4, 64, 96)
    size = 64 * 96
    segs = by_matrix([Segment(10, 2 * size + 100, size - 50, shape, "")])
    assert [(s.offset, s.numel, s.start) for s in segs] == [
        (10, 50, size - 50),
        (60, size, size),
        (60 + size, size, 2 * size),
        (60 + 2 * size, 50, 3 * size),
    ]
    assert len(set(tensor_keys(segs))) == 1  # unnamed, still one tensor
    two = whole_tensor(shape) + [Segment(4 * size, 64 * 96, 0, (64, 96))]
    assert len(set(tensor_keys(two))) == 2
    assert by_matrix([Segment(0, 4096, 0, (64, 64), "w")]) == [Segment(0, 4096, 0, (64, 64), "w")]


def _model(storage: str, seed: int = 0, **kw) -> MoELM:
    torch.manual_seed(seed)
    cfg = dict(dim=64, n_layers=1, n_heads=2, n_experts=8, top_k=2, hidden=80, seq=32)
    cfg.update(kw)
    return MoELM(MoEConfig(storage=storage, **cfg))


def _step(model: MoELM, opt: Gefen, tokens: torch.Tensor) -> None:
    opt.zero_grad()
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1))
    loss.backward()
    opt.step()


def _tokens(batch: int, seq: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("bits", [4, 8])
def test_every_storage_keeps_what_per_expert_linear_layers_keep(bits):
    """No expert tensor falls back to B = 1 in any storage, and the bytes per parameter of the
    grouped storages are within 0.01 of the same experts as nn.Linear modules."""
    per_param = {}
    for storage in STORAGES:
        model = _model(storage)
        opt = Gefen(model.parameters(), lr=1e-3, bits=bits)
        _step(model, opt, _tokens(8, 33))
        for name, p in model.expert_parameters():
            blocks = set(opt.state[p]["layout"][:, 3].tolist())
            assert 1 not in blocks, f"{storage}: {name} keeps per-element state"
        rep = opt.memory_report()
        per_param[storage] = rep["state_bytes"] / rep["params"]
    for storage in ("grouped", "transposed", "fused"):
        assert per_param[storage] <= per_param["linear"] + 0.01, per_param


def test_an_expert_unrouted_at_the_first_step_takes_the_tensors_blocks_and_trains_later():
    """Expert k receives no token at step 1: its matrix has the others' block size, its v and
    absmax are zero (AdamW's m and v of a zero gradient), and once routed it trains."""
    model = _model("grouped")
    opt = Gefen(model.parameters(), lr=1e-2, bits=4, weight_decay=0.0)
    moe = model.layers[0].moe
    first = _tokens(1, 4)
    with torch.no_grad():
        model(first[:, :-1])
    idle = [k for k, n in enumerate(moe.last_counts.tolist()) if n == 0]
    assert idle, "the first batch must leave an expert unrouted"
    k = idle[0]
    before = moe.w2.detach()[k].clone()
    _step(model, opt, first)
    st = opt.state[moe.w2]
    layout = st["layout"].tolist()
    assert len(layout) == 8 and len({row[3] for row in layout}) == 1 and layout[0][3] != 1
    view = segment_views(st)[k].seg
    assert torch.count_nonzero(view.v) == 0 and torch.count_nonzero(view.absmax) == 0
    assert torch.equal(moe.w2.detach()[k], before)  # no gradient, no decay: unchanged
    busy = next(j for j in range(8) if j not in idle)
    assert torch.count_nonzero(segment_views(st)[busy].seg.v) > 0
    for seed in range(4, 40):
        _step(model, opt, _tokens(8, 33, seed))
        if moe.last_counts[k] > 0:
            break
    assert torch.count_nonzero(segment_views(opt.state[moe.w2])[k].seg.v) > 0
    assert not torch.equal(moe.w2.detach()[k], before)


def test_a_grouped_state_reloads_and_steps_bit_for_bit():
    model = _model("grouped")
    opt = Gefen(model.parameters(), lr=1e-3, bits=4)
    _step(model, opt, _tokens(8, 33))
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    osd = copy.deepcopy(opt.state_dict())  # load_state_dict may keep the tensors it is given
    twin = _model("grouped", seed=1)
    twin.load_state_dict(saved)
    opt2 = Gefen(twin.parameters(), lr=1e-3, bits=4)
    opt2.load_state_dict(osd)
    for s in range(3):
        _step(model, opt, _tokens(8, 33, 10 + s))
        _step(twin, opt2, _tokens(8, 33, 10 + s))
    for (n, a), b in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b), n


def test_a_state_saved_before_matrices_were_cut_loads_and_steps_bit_for_bit():
    """A checkpoint from before ``by_matrix`` holds one segment for a grouped weight; loaded, it
    is re-cut at each matrix (``portable.saved_whole``) and steps as the state it was made from.
    Made here from a contiguous-blocked tensor (the old rule's choices were contiguous or B = 1
    on the rows-last experts), by installing its exported state into one whole segment."""
    from gefen_dist.method import portable

    model = _model("grouped")
    opt = Gefen(model.parameters(), lr=1e-3, bits=4)
    _step(model, opt, _tokens(8, 33))
    w1 = model.layers[0].moe.w1
    st = opt.state[w1]
    assert int(st["layout"][0, 3]) > 1 and len(st["layout"]) == 8
    osd = copy.deepcopy(opt.state_dict())
    pid = next(i for i, p in enumerate(model.parameters()) if p is w1)
    segs = opt.segments_of(w1)
    named = [Segment(s.offset, s.numel, s.start, s.shape, "w1") for s in segs]
    tensors = portable.merge(portable.export(st, named))
    old = portable.install(tensors, [Segment(0, w1.numel(), 0, tuple(w1.shape), "w1")], "cpu")
    assert len(old["layout"]) == 1
    osd["state"][pid] = old
    twin = _model("grouped", seed=1)
    twin.load_state_dict(model.state_dict())
    opt2 = Gefen(twin.parameters(), lr=1e-3, bits=4)
    opt2.load_state_dict(osd)
    assert torch.equal(opt2.state[twin.layers[0].moe.w1]["layout"], st["layout"])
    for s in range(3):
        _step(model, opt, _tokens(8, 33, 20 + s))
        _step(twin, opt2, _tokens(8, 33, 20 + s))
    for (n, a), b in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b), n


def _needs_backend(backend: str) -> None:
    from needs import cpp_kernel, triton_interpreter

    if backend == "native":
        cpp_kernel()
    if backend == "triton":
        triton_interpreter()


@pytest.mark.parametrize(
    "backend", ["reference", "native", pytest.param("triton", marks=pytest.mark.triton)]
)
def test_experts_at_different_gradient_scales_take_steps_of_one_size(backend):
    # Column blocks of a batch keep a v per column of each expert and a v_cross entry per row.
    # A row's mean g^2 carries its expert's scale, which the expert's column v already hold:
    # normalised over the whole tensor, an expert of small gradients is divided by its scale
    # twice, its factor floored and its step up to 1 / sqrt(CROSS_FLOOR) = 10 times AdamW's.
    # Per expert, each takes about AdamW's step (lr at the first step), as AdamW does.
    _needs_backend(backend)
    g0 = _experts_by_column(seed=1)
    lr = 1e-3
    w = torch.nn.Parameter(torch.zeros(E, R, C))
    opt = Gefen([w], lr=lr, weight_decay=0.0)
    opt.backend = backend
    moves = []
    for t in range(3):
        before = w.detach().clone()
        w.grad = g0 * (1.0 + 0.1 * t)
        opt.step()
        moves.append((w.detach() - before).pow(2).mean(dim=(1, 2)).sqrt() / lr)
    assert pt.matrix_batch(tuple(w.shape)) is not None
    assert int(opt.state[w]["layout"][0, 3]) == -C  # columns inside each expert
    assert opt.state[w]["v_cross"].numel() > 0  # the factor is on
    for rms in moves:
        assert rms.min() > 0.5 and rms.max() < 2.0, rms


@pytest.mark.parametrize("backend", ["native", pytest.param("triton", marks=pytest.mark.triton)])
def test_the_fused_backends_step_a_batch_factored_per_matrix_as_the_reference(backend):
    # the factor's slices (cross._slices) go to each kernel one matrix at a time
    _needs_backend(backend)
    g0 = _experts_by_column(seed=2)
    runs = {}
    for b in ("reference", backend):
        w = torch.nn.Parameter(torch.zeros(E, R, C))
        opt = Gefen([w], lr=1e-3, weight_decay=0.1)
        opt.backend = b
        for t in range(3):
            w.grad = g0 * (1.0 + 0.1 * t)
            opt.step()
        runs[b] = (w.detach(), opt.state[w]["v_cross"])
    assert int(opt.state[w]["layout"][0, 3]) == -C and runs[backend][1].numel() > 0
    torch.testing.assert_close(runs[backend][1], runs["reference"][1], atol=0, rtol=1e-6)
    torch.testing.assert_close(runs[backend][0], runs["reference"][0], atol=2e-6, rtol=1e-5)
