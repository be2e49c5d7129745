"""``bf16_stochastic_round``: pure-bf16 weights written with stochastic rounding.

The write is ``codes.round_bf16`` of the step's fp32 parameter with r = ``codes.param_bits`` of
(step, the element's index in its tensor). So each backend's bf16 result must be exactly that
rounding of the fp32 value the same backend computes for an fp32 copy of the parameter (whose
arithmetic the backend tests hold to the reference), with the state untouched by the option;
the backends then agree bit for bit on a model; the mean of many writes of one small update
follows the fp32 value where nearest rounding never moves; DDP, FSDP2 (bf16 shards, no
MixedPrecisionPolicy) and a resumed run give the single-process bits (tests/dist/bf16_layouts.py).
Also issue 31's other host path: FSDP2's CPUOffloadPolicy, whose host shards take the C++
kernel (tests/dist/offload_fsdp.py; the rule itself in tests/test_dispatch.py).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import copy  # noqa: E402
import dataclasses  # noqa: E402
import io  # noqa: E402

import needs  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from dist_util import read_results, torchrun  # noqa: E402

from gefen_dist import Gefen  # noqa: E402
from gefen_dist.backends import native_cpu, triton_backend  # noqa: E402
from gefen_dist.backends.reference import block_update, column_update, dense_update  # noqa: E402
from gefen_dist.backends.work import SegmentWork  # noqa: E402
from gefen_dist.method import codebook, spec  # noqa: E402
from gefen_dist.method.codes import (  # noqa: E402
    hash_bits,
    midpoints,
    param_bits,
    param_key,
    round_bf16,
    step_key,
)
from gefen_dist.method.hyper import Hyper  # noqa: E402
from gefen_dist.method.segments import num_blocks  # noqa: E402
from gefen_dist.method.state import SegmentState, cross_length  # noqa: E402

pytestmark = pytest.mark.unit

FIELDS = ("codes", "absmax", "v", "v_cross", "exp_avg", "exp_avg_sq")


def _reference(p, g, st, h, levels, mids, bits):
    if st.block_size == 1:
        dense_update(p, g, st, h)
    elif st.block_size < 0:
        column_update(p, g, st, h, levels, mids, bits)
    else:
        block_update(p, g, st, h, levels, mids, bits)


def _native(*work):
    native_cpu.step([SegmentWork(*work)])


def _triton(*work):
    triton_backend.step([SegmentWork(*work)])


BACKENDS = {
    "reference": (_reference, None),
    "native": (_native, "native"),
    "triton": (_triton, "triton"),
}
BACKEND_PARAMS = [
    pytest.param(b, marks=pytest.mark.triton) if b == "triton" else b for b in BACKENDS
]


def _needs(name: str) -> None:
    if name == "native":
        needs.cpp_kernel()
    if name == "triton":
        needs.triton_interpreter()


def _levels(bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(bits)
    hist = codebook.histogram(torch.rand(4096, generator=gen) * 2 - 1)
    levels = codebook.learn_codebook(hist, bits)
    return levels, midpoints(levels)


def _state(start, numel, block, bits, gen) -> SegmentState:
    st = SegmentState(start, numel, block)
    if block == 1:
        st.exp_avg = (torch.randn(numel, generator=gen) * 0.1).bfloat16()
        st.exp_avg_sq = (torch.rand(numel, generator=gen) * 0.01).bfloat16()
        return st
    nb = num_blocks(start, numel, block)
    size = numel if bits == 8 else (numel + 1) // 2
    st.codes = torch.randint(0, 256, (size,), generator=gen, dtype=torch.uint8)
    st.absmax, st.v = torch.rand(nb, generator=gen) * 0.1, torch.rand(nb, generator=gen) * 0.01
    st.v_cross = torch.rand(cross_length(block, start + numel), generator=gen) * 0.01
    return st


def _copy(st: SegmentState) -> SegmentState:
    return dataclasses.replace(
        st, **{k: getattr(st, k).clone() for k in FIELDS if getattr(st, k) is not None}
    )


# (bits, g dtype, start, numel, block): contiguous blocks cut at both ends, whole blocks,
# columns from mid-row, B = 1 with indices past 2^31 (the hash takes them mod 2^32)
LAYOUTS = [
    (4, torch.float32, 37, 4001, 97),
    (8, torch.bfloat16, 0, 3000, 1000),
    (4, torch.bfloat16, 5, 1001, -97),
    (8, torch.float32, 3, 2003, -61),
    (4, torch.bfloat16, 2**31 - 1001, 2049, 1),
]


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"{x[0]}b-s{x[2]}-B{x[4]}")
def test_the_write_is_round_bf16_of_the_fp32_update(backend, layout):
    """Three free steps: on a bf16 parameter, the backend's bits are round_bf16 (r = the
    parameter stream of the step's hash) of what it computes for an fp32 copy, and the state is
    the fp32 copy's; without the option the write is the nearest bf16, as before."""
    _needs(backend)
    run = BACKENDS[backend][0]
    bits, gt, start, numel, block = layout
    gen = torch.Generator().manual_seed(numel)
    levels, mids = _levels(bits)
    st = _state(start, numel, block, bits, gen)
    p = torch.randn(numel, generator=gen).bfloat16()
    index = torch.arange(start, start + numel)
    moved = 0
    for t in range(1, 4):
        g = torch.randn(numel, generator=gen).to(gt)
        h = Hyper(0.05, 0.9, 0.99, 1e-8, 0.1, t, bf16_stochastic_round=True)
        off = dataclasses.replace(h, bf16_stochastic_round=False)
        st32, x = _copy(st), p.float()
        run(x, g, st32, off, levels, mids, bits)
        st_near, near = _copy(st), p.clone()
        run(near, g, st_near, off, levels, mids, bits)
        run(p, g, st, h, levels, mids, bits)
        assert torch.equal(near, x.bfloat16()), f"nearest write changed (step {t})"
        expect = round_bf16(x, param_bits(t, index))
        assert torch.equal(p.view(torch.int16), expect.view(torch.int16)), f"step {t}"
        for k in FIELDS:
            if getattr(st, k) is not None:
                assert torch.equal(getattr(st, k), getattr(st32, k)), f"{k} (step {t})"
        moved += int((p != near).sum())
    assert moved > numel // 10  # the draw did move writes off the nearest value


def test_param_stream_is_its_own_and_the_kernels_derive_it():
    """The parameter's r is not the codes' or m/v's bits, and the kernels' key (mix of the step
    key with the stream constant) is codes.param_key."""
    idx = torch.arange(10_000)
    for t in (1, 2, 1000):
        assert not torch.equal(param_bits(t, idx), hash_bits(t, idx) & 0xFFFF)
        assert not torch.equal(param_bits(t, idx), hash_bits(t, idx) >> 16)
        assert param_key(t) != step_key(t)
    assert not torch.equal(param_bits(1, idx), param_bits(2, idx))


def test_spec_rounds_the_same_way():
    """The spec's one line gives the reference's rounding: a whole bf16 tensor, several steps."""
    gen = torch.Generator().manual_seed(3)
    levels, mids = _levels(4)
    p0 = torch.randn(64 * 96, generator=gen).bfloat16()
    grads = [torch.randn(64 * 96, generator=gen) for _ in range(3)]
    out = spec.gefen(
        p0.float(), grads, 1e-2, (0.9, 0.99), 1e-8, 0.1, 96, levels, bf16_stochastic_round=True
    )
    p = p0.clone()
    st = _state(0, 64 * 96, 96, 4, gen)
    for k in FIELDS:
        if getattr(st, k) is not None:
            getattr(st, k).zero_()
    for t, g in enumerate(grads, 1):
        block_update(p, g, st, Hyper(1e-2, 0.9, 0.99, 1e-8, 0.1, t, True), levels, mids, 4)
    # the spec's fp32 order differs from the chunked reference's by an ulp at most, which
    # changes a stochastic write with probability ~2^-16 per ulp
    assert (out.bfloat16() != p).float().mean() < 1e-3
    assert torch.equal(out, out.bfloat16().float())  # the spec's p is bf16-valued


class _Lm(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(64, 96).to(dtype))
        self.b = torch.nn.Parameter(torch.randn(96).to(dtype))


def _train(backend, bits, steps=3, dtype=torch.bfloat16, sr=True, start=0, opt=None, m=None):
    m = m or _Lm(dtype)
    if opt is None:
        opt = Gefen(m.parameters(), lr=1e-2, bits=bits, bf16_stochastic_round=sr)
        opt.backend = backend
    for t in range(start, start + steps):
        gen = torch.Generator().manual_seed(t)
        m.w.grad = torch.randn(m.w.shape, generator=gen).to(dtype)
        m.b.grad = torch.randn(m.b.shape, generator=gen).to(dtype)
        opt.step()
    return m, opt


@pytest.mark.parametrize("name", ["native", pytest.param("triton", marks=pytest.mark.triton)])
@pytest.mark.parametrize("bits", [4, 8])
def test_backends_agree_bit_for_bit_on_a_bf16_model(bits, name):
    """A shared-block matrix and a B = 1 bias, three steps from the same start."""
    _needs(name)
    ref, _ = _train("reference", bits)
    m, opt = _train(name, bits)
    assert opt.memory_report()["backend"] == {"native": "native-cpu"}.get(name, name)
    for a, b in ((m.w, ref.w), (m.b, ref.b)):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), name


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_small_updates_move_on_average_where_nearest_never_does(backend):
    """4096 bf16 ones, constant g, no decay, lr 1e-3: each step moves the fp32 value by ~lr,
    under half the bf16 spacing below 1 (2^-9), so nearest rounding keeps every weight at 1.0
    for ever; stochastic writes are unbiased, so their mean follows the fp32 run: after 10 steps
    measured 6e-5 off a drift of 1e-2 (the standard deviation of the mean of 4096 writes is
    8e-5); held to 6e-4."""
    _needs(backend)
    name = BACKENDS[backend][1] or "reference"
    kinds = (("fp32", torch.float32), ("near", torch.bfloat16), ("sr", torch.bfloat16))
    ps = {k: torch.ones(64, 64, dtype=dt, requires_grad=True) for k, dt in kinds}
    opts = {}
    for k, p in ps.items():
        opts[k] = Gefen([p], lr=1e-3, weight_decay=0.0, bf16_stochastic_round=k == "sr")
        opts[k].backend = name
    for _ in range(10):
        for k, p in ps.items():
            p.grad = torch.ones(64, 64, dtype=p.dtype)
            opts[k].step()
    fp32 = ps["fp32"].detach().double().mean().item()
    assert 1.0 - fp32 > 9e-3
    assert torch.all(ps["near"] == 1.0)
    sr = ps["sr"].detach().double()
    assert abs(sr.mean().item() - fp32) < 6e-4, sr.mean().item() - fp32
    assert len(torch.unique(sr)) >= 2  # the draws differ between elements


def test_fp32_and_fp16_parameters_are_written_as_without_it():
    for dtype in (torch.float32, torch.float16):
        a, _ = _train("auto", 4, dtype=dtype, sr=True)
        b, _ = _train("auto", 4, dtype=dtype, sr=False)
        assert torch.equal(a.w, b.w) and torch.equal(a.b, b.b)


def test_bad_values_are_refused_by_name():
    p = torch.zeros(3, requires_grad=True)
    for bad in (1, "yes", None):
        with pytest.raises(ValueError, match="Invalid bf16_stochastic_round"):
            Gefen([p], bf16_stochastic_round=bad)
    opt = Gefen([p])
    with pytest.raises(ValueError, match="Invalid bf16_stochastic_round: 0"):
        opt.add_param_group(
            {"params": [torch.zeros(2, requires_grad=True)], "bf16_stochastic_round": 0}
        )
    sd = opt.state_dict()
    sd["param_groups"][0]["bf16_stochastic_round"] = "on"
    with pytest.raises(ValueError, match="saved param group 0: Invalid bf16_stochastic_round"):
        opt.load_state_dict(sd)


def test_resume_is_bit_exact_and_the_setting_travels_in_the_state_dict():
    whole, _ = _train("auto", 4, steps=6)
    m, opt = _train("auto", 4, steps=3)
    buf = io.BytesIO()
    torch.save({"m": m.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    assert all(g["bf16_stochastic_round"] is True for g in ck["opt"]["param_groups"])
    fresh = _Lm(torch.bfloat16)
    fresh.load_state_dict(ck["m"])
    fopt = Gefen(fresh.parameters(), lr=1e-2, bf16_stochastic_round=False)
    fopt.load_state_dict(ck["opt"])
    assert fopt.param_groups[0]["bf16_stochastic_round"] is True  # as saved
    _train("auto", 4, steps=3, start=3, opt=fopt, m=fresh)
    assert torch.equal(fresh.w, whole.w) and torch.equal(fresh.b, whole.b)
    # a state dict saved before the setting existed takes the optimizer's
    del ck["opt"]["param_groups"][0]["bf16_stochastic_round"]
    old = Gefen(_Lm(torch.bfloat16).parameters(), lr=1e-2, bf16_stochastic_round=True)
    old.load_state_dict(ck["opt"])
    assert old.param_groups[0]["bf16_stochastic_round"] is True


def test_turning_it_off_mid_run_takes_effect_on_the_kept_tables():
    """After a step the C++ backend keeps its tables (the write's rounding among them); a change
    of the setting must rebuild them: the next step equals a fresh optimizer's."""
    needs.cpp_kernel()
    m, opt = _train("auto", 4, steps=3)
    assert opt._plan is not None
    sd = copy.deepcopy(opt.state_dict())  # its tensors are the optimizer's own
    twin = _Lm(torch.bfloat16)
    twin.load_state_dict(m.state_dict())
    topt = Gefen(twin.parameters(), lr=1e-2)
    topt.load_state_dict(sd)
    opt.param_groups[0]["bf16_stochastic_round"] = False
    topt.param_groups[0]["bf16_stochastic_round"] = False
    _train("auto", 4, steps=1, start=3, opt=opt, m=m)
    _train("auto", 4, steps=1, start=3, opt=topt, m=twin)
    assert torch.equal(m.w, twin.w) and torch.equal(m.b, twin.b)
    on, _ = _train("auto", 4, steps=4)
    assert not torch.equal(on.w, m.w)


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    out = tmp_path_factory.mktemp("bf16_layouts")
    torchrun("bf16_layouts.py", str(out), "4")
    return read_results(out, ranks=2)


@pytest.mark.dist
@pytest.mark.parametrize("setup", ["ddp", "fsdp2"])
def test_ddp_and_fsdp2_give_the_single_process_bits(layouts, setup):
    for r in layouts:
        run = r[setup]
        assert run["backend"] == "native-cpu"
        assert run["rounding_changed"] > 1000  # the option reached this layout's path
        uncut = [n for n, c in run["cut"].items() if not c]
        assert uncut and any(b > 1 for b in run["blocks"])
        assert all(run["first_equal"][n] for n in uncut), run["first_equal"]
        if not any(run["cut"].values()):  # then every later step is comparable too
            assert all(run["equal"].values()), run["equal"]
            assert all(run["nearest_equal"].values()), run["nearest_equal"]


@pytest.fixture(scope="module")
def offload(tmp_path_factory):
    out = tmp_path_factory.mktemp("offload")
    torchrun("offload_fsdp.py", str(out), "3")
    return read_results(out, ranks=2)


@pytest.mark.dist
def test_fsdp2_cpu_offload_steps_host_shards_with_the_cpp_kernel(offload):
    """FSDP2 with CPUOffloadPolicy (tests/dist/offload_fsdp.py): every parameter a DTensor whose
    shard lives on the host, each stepped by the C++ kernel, and the run equal to the one without
    offload bit for bit (losses, parameters, optimizer state)."""
    needs.cpp_kernel()
    for r in offload:
        off, plain = r["offload"], r["plain"]
        assert off["dtensor"] and set(off["local_devices"].values()) == {"cpu"}
        assert set(off["backends"].values()) == {"native-cpu"}
        assert off["report_backend"] == "native-cpu"
        assert off["losses"] == plain["losses"]
        assert all(r["params_equal"].values()) and off["digest"] == plain["digest"]
    assert offload[0]["offload"]["digest"] != offload[1]["offload"]["digest"]  # own shards
