import math

import numpy as np
import pytest
import torch

from gefen_dist import Gefen, Segment
from gefen_dist.backends import reference
from gefen_dist.method import spec
from gefen_dist.method.codes import unpack4

pytestmark = pytest.mark.unit

torch.set_num_threads(1)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _row_grad(shape, seed):
    g = _gen(seed)
    return torch.exp(torch.randn(shape[0], 1, generator=g)) * torch.randn(*shape, generator=g)


# ---------------------------------------------------------------------------------------------
# B = 1: AdamW's operations on bf16 m and v, stochastically rounded


@pytest.mark.parametrize("dtype_wd", [(0.0, (0.9, 0.999)), (0.1, (0.8, 0.95))])
def test_no_sharing_follows_adamw_within_bf16_state(dtype_wd):
    """Each step is AdamW's fp32 step from m and v that were stored in bf16: a relative error of
    at most 2^-8 in m and v, so at most ~2^-7 in a step of size lr * |m / sqrt(v)|, summed over
    the steps. The state is 4 bytes per element, bf16."""
    wd, betas = dtype_wd
    lr, steps = 3e-3, 6
    # small, or elements of varied scales in no pattern below (i.i.d. lognormal scales): B = 1
    shapes = [(7,), (1,), (33, 5), (64, 64), (5000,)]
    ps = [torch.randn(s, generator=_gen(i)) for i, s in enumerate(shapes)]
    a = [p.clone().requires_grad_() for p in ps]
    b = [p.clone().requires_grad_() for p in ps]
    ga = Gefen(a, lr=lr, betas=betas, weight_decay=wd)
    ref = torch.optim.AdamW(b, lr=lr, betas=betas, weight_decay=wd, foreach=False)
    bound = [torch.zeros(s) for s in shapes]
    for step in range(steps):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            gen = _gen(100 * step + i)
            g = torch.exp(torch.randn(x.shape, generator=gen)) * torch.randn(x.shape, generator=gen)
            x.grad, y.grad = g.clone(), g.clone()
        before = [y.detach().clone() for y in b]
        ga.step()
        ref.step()
        for i, y in enumerate(b):  # AdamW's own step, weight decay aside
            bound[i] += (y.detach() - before[i] * (1 - lr * wd)).abs() * 2**-6
    report = ga.memory_report()
    numel = sum(p.numel() for p in ps)
    assert report["fallback_numel"] == numel
    assert report["state_bytes"] == 4 * numel
    for x, y, bd in zip(a, b, bound, strict=True):
        st = ga.state[x]
        assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.bfloat16
        assert bool(((x - y).abs() <= bd + 1e-7).all())
        assert not torch.equal(x, y) or x.numel() == 1  # bf16 state is not fp32 state


def test_bf16_second_moment_does_not_freeze():
    """With b2 = 0.999 and |g| = 1, v's change per step, 0.001 (1 - v), falls under half a bf16
    spacing (2^-10) once v reaches 0.25: nearest rounding would stop v there. Stochastic rounding
    keeps it on AdamW's fp32 EMA, 1 - b2^t, on average over elements."""
    n, steps, b2 = 512, 1000, 0.999
    p = torch.zeros(n, requires_grad=True)
    opt = Gefen([p], lr=0.0, betas=(0.9, b2), weight_decay=0.0)
    signs = torch.randint(0, 2, (steps, n), generator=_gen(3)).float() * 2 - 1
    for t in range(steps):
        p.grad = signs[t].clone()
        opt.step()
    v = opt.state[p]["exp_avg_sq"].float()
    exact = 1 - b2**steps
    assert int(opt.state[p]["layout"][0, 3]) == 1
    assert abs(v.mean().item() / exact - 1) < 0.01
    nearest = 0.0
    for _ in range(steps):
        nearest = float(torch.tensor(nearest * b2 + (1 - b2)).to(torch.bfloat16))
    assert nearest < 0.5 * exact  # what the test guards against


def test_native_b1_state_matches_the_reference():
    shapes = [(7,), (33, 5), (5000,), (40000,)]  # the last spans several C++ tiles
    ps = [torch.randn(s, generator=_gen(i)) for i, s in enumerate(shapes)]
    runs = []
    for backend in ("reference", "native"):
        xs = [p.clone().requires_grad_() for p in ps]
        o = Gefen(xs, lr=1e-2, weight_decay=0.1)
        o.backend = backend
        for step in range(4):
            for i, x in enumerate(xs):
                x.grad = torch.randn(x.shape, generator=_gen(10 * step + i)) * (i + 1)
            o.step()
        runs.append((xs, o))
    (xr, orf), (xn, onb) = runs
    assert onb.memory_report()["backend"] == "native-cpu"
    for x, y in zip(xr, xn, strict=True):
        for k in ("exp_avg", "exp_avg_sq"):
            a, b = onb.state[y][k].float(), orf.state[x][k].float()
            diff = (a - b).abs()
            # the same bf16 but where fp32 results an ulp apart (torch's lerp and the kernel's
            # differ so where m + w (g - m) cancels) round to neighbouring bf16 values
            assert (diff > 0).float().mean() < 1e-3, k
            assert bool((diff <= 2**-7 * b.abs() + 1e-6 * b.abs().max()).all()), k
        torch.testing.assert_close(y, x, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# The block update against the spec's naive, unchunked statement (gefen_dist.method.spec)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(
    "start,numel,block",
    [
        (0, 96 * 64, 96),
        (37, 4001, 96),
        (5, 3 * 17, 17),
        (0, 96 * 64, -96),
        (37, 4001, -96),
        (5, 3 * 17 + 4, -17),
        (40, 60, -96),
    ],
)
def test_block_update_matches_naive_spec(bits, start, numel, block, monkeypatch):
    """A segment cut at both ends of its blocks (or a piece of its columns), chunked finely,
    equals the naive update."""
    monkeypatch.setattr(reference, "CHUNK", 200)
    width = abs(block)
    shape = ((start + numel) // width + 2, width) if block < 0 else (start + numel + 50,)
    g0 = torch.randn(numel, generator=_gen(1))
    p0 = torch.randn(numel, generator=_gen(2))
    p = p0.clone().requires_grad_()
    opt = Gefen([p], lr=1e-2, weight_decay=0.1, bits=bits)
    opt.backend = "reference"  # the spec checks the reference; the kernels are checked against it
    opt.set_segments(p, [Segment(0, numel, start, shape)])
    grads = [g0] + [torch.randn(numel, generator=_gen(10 + t)) for t in range(4)]
    # the block size is the partition's to choose; force it for the spec comparison
    opt.state[p] = _state_with_block(opt, p, g0, block, start, shape)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    levels = opt.state[p]["codebook"]
    total = math.prod(shape)
    want = spec.gefen(p0, grads, 1e-2, (0.9, 0.999), 1e-8, 0.1, block, levels, start, total)
    torch.testing.assert_close(p.detach(), want, atol=2e-6, rtol=1e-5)


def _state_with_block(opt, p, g0, block, start, shape):
    from gefen_dist.method import codebook as cb
    from gefen_dist.method import state

    x = torch.rand(1000, generator=_gen(7)) * 2 - 1
    levels = cb.learn_codebook(cb.histogram(x), opt.param_groups[0]["bits"])
    return state.allocate([Segment(0, p.numel(), start, shape)], [block], levels, p.device)


def test_chunking_does_not_change_results(monkeypatch):
    def run():
        torch.manual_seed(0)
        p = torch.randn(300, 96).requires_grad_()
        opt = Gefen([p], lr=1e-2, bits=4)
        opt.backend = "reference"  # the chunked one
        for t in range(4):
            p.grad = _row_grad((300, 96), t)
            opt.step()
        assert opt.state[p]["layout"][0, 3] == 96
        return p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}

    p1, s1 = run()
    monkeypatch.setattr(reference, "CHUNK", 1000)  # 10 rows of 96 per chunk, odd row counts
    p2, s2 = run()
    assert torch.equal(p1, p2)
    for k in s1:
        assert torch.equal(s1[k], s2[k]), k


# ---------------------------------------------------------------------------------------------
# torch.optim behaviour


def _mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(96, 128), torch.nn.Tanh(), torch.nn.Linear(128, 10))


def _loss(model, seed=0):
    g = _gen(seed)
    x = torch.randn(64, 96, generator=g)
    y = torch.randint(0, 10, (64,), generator=g)
    return torch.nn.functional.cross_entropy(model(x), y)


def test_trains_and_reports_memory():
    model = _mlp()
    opt = Gefen(model.parameters(), lr=1e-2, bits=8)
    first = None
    for t in range(30):
        opt.zero_grad()
        loss = _loss(model, t % 3)
        loss.backward()
        opt.step()
        first = first if first is not None else loss.item()
    assert loss.item() < 0.7 * first
    rep = opt.memory_report()
    numel = sum(p.numel() for p in model.parameters())
    assert rep["params"] == numel and rep["adamw_bytes"] == 8 * numel
    assert rep["state_bytes"] == sum(r["state_bytes"] for r in rep["tensors"])
    assert rep["bytes_per_param"] == pytest.approx(rep["state_bytes"] / numel)


def test_param_groups_lr_scheduler_closure_and_clipping():
    model = _mlp()
    opt = Gefen(
        [{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.0}], lr=1e-2
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)
    frozen = [p.detach().clone() for p in model[2].parameters()]

    def closure():
        opt.zero_grad()
        loss = _loss(model)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        return loss

    losses = [opt.step(closure).item() for _ in range(3)]
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(5e-3)
    assert losses[-1] < losses[0]
    for p, q in zip(model[2].parameters(), frozen, strict=True):
        assert torch.equal(p, q)  # lr 0, no weight decay effect either
    assert int(opt.state[model[0].weight]["step"]) == 3


def test_frozen_params_and_params_without_grad_keep_state_untouched():
    model = _mlp()
    model[2].bias.requires_grad_(False)
    opt = Gefen(model.parameters(), lr=1e-2)
    _loss(model).backward()
    opt.step()
    assert model[2].bias not in opt.state or not opt.state[model[2].bias]
    before = {k: v.clone() for k, v in opt.state[model[0].weight].items()}
    w = model[0].weight.detach().clone()
    model[0].weight.grad = None
    model[2].weight.grad = torch.ones_like(model[2].weight)
    opt.step()
    assert torch.equal(model[0].weight, w)
    for k, v in opt.state[model[0].weight].items():
        assert torch.equal(v, before[k]), k


def test_late_params_are_partitioned_then_and_reuse_the_codebook():
    a = torch.zeros(200, 96, requires_grad=True)
    b = torch.zeros(100, 96, requires_grad=True)
    opt = Gefen([a, b], lr=1e-2, bits=4)
    a.grad = _row_grad((200, 96), 0)
    opt.step()
    assert not opt.state.get(b)
    codebook = opt.state[a]["codebook"].clone()
    for t in range(2):
        a.grad = _row_grad((200, 96), t + 1)
        b.grad = _row_grad((100, 96), t + 5)
        opt.step()
    assert torch.equal(opt.state[b]["codebook"], codebook)
    assert opt.state[b]["codebook"] is opt.state[a]["codebook"]  # one tensor, not a copy each
    assert int(opt.state[b]["step"]) == 2 and int(opt.state[a]["step"]) == 3
    assert int(opt.state[b]["layout"][0, 3]) == 96


def test_grad_scaler_skipped_step_does_not_count():
    model = _mlp()
    opt = Gefen(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    opt.zero_grad()
    scaler.scale(_loss(model)).backward()
    model[0].weight.grad[0, 0] = float("inf")
    scaler.step(opt)
    scaler.update()
    assert not any(opt.state.get(p) for p in model.parameters())
    opt.zero_grad()
    scaler.scale(_loss(model)).backward()
    scaler.step(opt)
    scaler.update()
    assert all(int(opt.state[p]["step"]) == 1 for p in model.parameters())
    assert torch.isfinite(opt.state[model[0].weight]["codebook"]).all()


def test_non_finite_first_gradient_names_the_parameter():
    model = _mlp()
    opt = Gefen(list(model.named_parameters()), lr=1e-2)
    _loss(model).backward()
    model[2].weight.grad[3, 3] = float("nan")
    with pytest.raises(ValueError, match=r"'2.weight'.*non-finite|non-finite.*'2.weight'"):
        opt.step()
    assert not any(opt.state.get(p) for p in model.parameters())


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"bits": 3}, "bits"),
        ({"bits": True}, "bits"),
        ({"lr": -1.0}, "lr"),
        ({"betas": (1.0, 0.9)}, r"betas\[0\]"),
        ({"betas": (0.9, -0.1)}, r"betas\[1\]"),
        ({"eps": -1e-8}, "eps"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"amsgrad": True}, "amsgrad"),
        ({"bits": 4.0}, "bits"),
        ({"betas": (0.9,)}, "betas"),
        ({"betas": "ab"}, "betas"),
        ({"lr": torch.zeros(2)}, "lr"),
    ],
)
def test_bad_hyperparameters_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Gefen([torch.zeros(3, requires_grad=True)], **kwargs)


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"lr": "3e-4"}, "lr"),
        ({"eps": None}, "eps"),
        ({"betas": (0.9, "0.99")}, r"betas\[1\]"),
        ({"weight_decay": [0.1]}, "weight_decay"),
    ],
)
def test_values_of_the_wrong_type_are_refused_by_name(kwargs, name):
    """Refused at construction: a string lr stepped and only broke the first scheduler."""
    with pytest.raises(TypeError, match=f"^{name} must be a number"):
        Gefen([torch.zeros(3, requires_grad=True)], **kwargs)


def test_numbers_of_other_types_are_taken():
    """numpy scalars and one-element tensors, as configs and schedulers hand them over."""
    p = torch.zeros(3, requires_grad=True)
    opt = Gefen([p], lr=np.float32(1e-3), betas=(torch.tensor(0.9), 0.99), bits=np.int64(8))
    p.grad = torch.ones(3)
    opt.step()
    assert opt.state[p]["step"] == 1


def test_bad_group_added_later_is_refused():
    opt = Gefen([torch.zeros(3, requires_grad=True)])
    with pytest.raises(ValueError, match="bits"):
        opt.add_param_group({"params": [torch.zeros(2, requires_grad=True)], "bits": 2})
    with pytest.raises(TypeError, match="complex"):
        opt.add_param_group({"params": [torch.zeros(2, dtype=torch.complex64)]})
    assert len(opt.param_groups) == 1


def test_sparse_and_complex_are_refused():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = Gefen(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(TypeError, match="sparse"):
        opt.step()
    with pytest.raises(TypeError, match="complex"):
        Gefen([torch.zeros(3, dtype=torch.complex64, requires_grad=True)])


def test_zero_one_prime_and_empty_tensors_work():
    ps = [torch.zeros(0), torch.ones(1), torch.randn(7919), torch.randn(64, 128), torch.randn(5)]
    ps = [p.requires_grad_() for p in ps]
    opt = Gefen(ps, lr=1e-2, bits=4)
    for t in range(3):
        for i, p in enumerate(ps):
            p.grad = torch.zeros_like(p) if i == 3 else torch.randn(p.shape, generator=_gen(t))
        opt.step()
    assert all(torch.isfinite(p).all() for p in ps)
    # an all-zero g0 (a LoRA A whose B starts at zero) reads as alike: rows, not B = 1
    assert int(opt.state[ps[3]]["layout"][0, 3]) == 128


@pytest.mark.parametrize("backend", ["reference", "native"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_params_keep_fp32_state_and_round_once(dtype, backend):
    """A step on a bf16/fp16 parameter is the fp32 step rounded once, not low-precision maths."""
    torch.manual_seed(0)
    lo = torch.randn(128, 96).to(dtype).requires_grad_()
    hi = lo.detach().float().requires_grad_()
    o_lo, o_hi = Gefen([lo], lr=1e-2, bits=4), Gefen([hi], lr=1e-2, bits=4)
    o_lo.backend = o_hi.backend = backend
    g = _row_grad((128, 96), 0).to(dtype)
    lo.grad, hi.grad = g, g.float()
    o_lo.step()
    o_hi.step()
    assert lo.dtype == dtype
    assert torch.equal(lo, hi.detach().to(dtype))
    st = o_lo.state[lo]
    assert st["v"].dtype == st["absmax"].dtype == torch.float32 and st["codes"].dtype == torch.uint8
    assert torch.equal(st["v"], o_hi.state[hi]["v"])
    assert torch.equal(st["codes"], o_hi.state[hi]["codes"])


def test_maximize_ascends():
    p = torch.zeros(3, requires_grad=True)
    opt = Gefen([p], lr=0.1, maximize=True, weight_decay=0.0)
    p.grad = torch.ones(3)
    opt.step()
    assert (p > 0).all()


def test_set_segments_must_tile_the_buffer():
    p = torch.zeros(100, requires_grad=True)
    opt = Gefen([p])
    with pytest.raises(ValueError, match="cover 60 of 100"):
        opt.set_segments(p, [Segment(0, 60, 0, (60,))])
    with pytest.raises(ValueError, match="gap or overlap"):
        opt.set_segments(p, [Segment(0, 60, 0, (60,)), Segment(50, 50, 0, (50,))])


def test_four_bit_state_is_packed():
    p = torch.zeros(301, 96, requires_grad=True)
    opt = Gefen([p], bits=4)
    p.grad = _row_grad((301, 96), 0)
    opt.step()
    st = opt.state[p]
    assert st["codes"].numel() == math.ceil(p.numel() / 2)
    assert st["absmax"].numel() == st["v"].numel() == 301
    assert st["v_cross"].numel() == 96  # one per column across the row blocks
    assert opt.memory_report()["bytes_per_param"] == pytest.approx(
        (math.ceil(p.numel() / 2) + 8 * 301 + 4 * 96) / p.numel()
    )
    assert unpack4(st["codes"], p.numel()).max() < 16


def test_unfrozen_param_is_initialised_when_it_first_gets_a_gradient():
    model = _mlp()
    model[0].weight.requires_grad_(False)
    opt = Gefen(model.parameters(), lr=1e-2)
    _loss(model).backward()
    opt.step()
    assert not opt.state.get(model[0].weight)
    model[0].weight.requires_grad_(True)
    opt.zero_grad()
    _loss(model).backward()
    opt.step()
    assert int(opt.state[model[0].weight]["step"]) == 1


# ---------------------------------------------------------------------------------------------
# Column blocks end to end: a layer whose inputs differ in scale per feature


def _scaled_inputs(step):
    g = _gen(100 + step)
    feature_scale = torch.exp(torch.randn(192, generator=_gen(99)))
    return torch.randn(32, 192, generator=g) * feature_scale, torch.randn(32, 64, generator=g)


def _column_run(steps, opt_state=None, model_state=None, bits=4):
    torch.manual_seed(0)
    layer = torch.nn.Linear(192, 64, bias=False)
    if model_state is not None:
        layer.load_state_dict(model_state)
    opt = Gefen(layer.parameters(), lr=1e-2, bits=bits)
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    first = 0 if opt_state is None else int(opt_state["state"][0]["step"])
    for t in range(first, first + steps):
        x, y = _scaled_inputs(t)
        opt.zero_grad()
        torch.nn.functional.mse_loss(layer(x), y).backward()
        opt.step()
    return layer, opt


@pytest.mark.parametrize("bits", [4, 8])
def test_columns_are_chosen_reported_and_resume_exactly(bits):
    from gefen_dist import format_memory_report

    layer, opt = _column_run(3, bits=bits)
    rep = opt.memory_report()
    assert rep["tensors"][0]["block_sizes"] == [-192]
    assert rep["fallback_numel"] == 0
    code = 0.5 if bits == 4 else 1.0
    assert rep["bytes_per_param"] == pytest.approx(code + 8 / 64 + 4 / 192)  # v_cross: per row
    assert "col192" in format_memory_report(rep)

    sd = {k: v for k, v in opt.state_dict().items()}
    resumed, _ = _column_run(3, opt_state=sd, model_state=layer.state_dict(), bits=bits)
    straight, _ = _column_run(6, bits=bits)
    assert torch.equal(resumed.weight, straight.weight)


def test_a_column_state_for_another_row_length_is_refused():
    _, opt = _column_run(1)
    sd = opt.state_dict()
    layout = sd["state"][0]["layout"].clone()
    layout[0, 3] = -191
    sd["state"][0] = dict(sd["state"][0], layout=layout)
    fresh = Gefen(torch.nn.Linear(192, 64, bias=False).parameters())
    with pytest.raises(ValueError, match=r"block size -191 .*\(64, 192\).*-192"):
        fresh.load_state_dict(sd)


def test_alike_weights_share_per_row_and_gains_do_not():
    """Partition step 6 through the optimizer: a 3x3 convolution whose first gradient is noise
    of one variance shares v per row (432 elements); a 1-D tensor of the same kind does not."""
    conv = torch.zeros(48, 48, 3, 3, requires_grad=True)
    gain = torch.zeros(5000, requires_grad=True)
    opt = Gefen([conv, gain], bits=4)
    conv.grad = torch.randn(conv.shape, generator=_gen(1))
    gain.grad = torch.randn(gain.shape, generator=_gen(2))
    opt.step()
    rows = {r["shape"]: r for r in opt.memory_report()["tensors"]}
    assert rows[(48, 48, 3, 3)]["block_sizes"] == [432]
    # 4-bit codes, v and absmax per row, v_cross per position in a row
    assert rows[(48, 48, 3, 3)]["state_bytes"] == conv.numel() // 2 + 8 * 48 + 4 * 432
    assert rows[(5000,)]["block_sizes"] == [1]


def test_a_named_piece_without_a_process_group_is_factored_from_its_own_gradient():
    """Names mark pieces whose v_cross sums are all-reduced; without a group there is no one to
    reduce with, so the piece is factored from its own g, as the reference does."""
    shape, start, numel = (64, 96), 96 * 10 + 5, 96 * 40
    ps = []
    for name in ("fc.weight", ""):
        p = torch.randn(numel, generator=_gen(0)).requires_grad_()
        opt = Gefen([p], lr=1e-2)
        opt.backend = "reference"
        opt.set_segments(p, [Segment(0, numel, start, shape, name)])
        # a piece alone cannot choose its block size (the partition needs the whole tensor)
        opt.state[p] = _state_with_block(opt, p, None, 96, start, shape)
        for t in range(3):
            p.grad = _row_grad((40, 96), t).view(-1)
            opt.step()
        assert opt.state[p]["v_cross"].numel() == 96
        ps.append(p)
    assert torch.equal(ps[0], ps[1])
