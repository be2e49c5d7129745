"""The Triton backend (``backends/triton_backend.py``) run for real on CPU tensors under
Triton's interpreter: the GPU kernels' own code, program by program, on this machine.

Two references. ``reference.py`` run by torch, within ``agree``'s bounds: torch's CPU kernels
contract lerp and add-with-alpha into FMAs and this torch's vectorised sqrt is not correctly
rounded, so bit equality with it is not to be had. And ``Twin`` below, an IEEE emulation in
numpy of the kernels' own fp32 order of operations (the CUDA C++ kernels'), which they must equal
bit for bit: parameters, v, absmax, codes, bf16 m and v, v_cross and the factors. Each layout
steps several times from the reference's own state (the self-check's way), and runs free for
several steps, and a gradient that turns shows the overshoot rule at work; the rest: several
tensors cut like FSDP shards in one call, the factor pass with ``dest`` and ``factors``,
determinism and resumption, the hash against ``codes.hash_bits``, no new compiled variant over
an lr schedule, and (in a subprocess, without the interpreter) a compile of every kernel for
sm_90 whose PTX must hold no FMA, approximate division or sqrt.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton (decided at decoration)

import dataclasses  # noqa: E402
import importlib  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from needs import extra, triton_interpreter  # noqa: E402

from gefen_dist.backends import segment_table  # noqa: E402
from gefen_dist.backends import triton_backend as tb  # noqa: E402
from gefen_dist.backends import triton_checks as checks  # noqa: E402
from gefen_dist.backends.reference import (  # noqa: E402
    block_update,
    column_update,
    cross_factor,
    cross_mean,
    cross_sums,
    dense_update,
)
from gefen_dist.backends.segment_table import CrossHyp, Hyp  # noqa: E402
from gefen_dist.backends.work import CrossDest, CrossWork, FactorWork, SegmentWork  # noqa: E402
from gefen_dist.method import codebook  # noqa: E402
from gefen_dist.method.codes import (  # noqa: E402
    hash_bits,
    midpoints,
    round_bf16,
    step_key,
    stochastic_quantize,
    uniforms,
)
from gefen_dist.method.hyper import Hyper  # noqa: E402
from gefen_dist.method.segments import num_blocks  # noqa: E402
from gefen_dist.method.state import SegmentState, cross_length  # noqa: E402

pytestmark = pytest.mark.triton


@pytest.fixture(autouse=True, scope="module")
def _interpreter():
    triton_interpreter()


@pytest.fixture(autouse=True, scope="module")
def _interpreted_kernels():
    """The kernels as the interpreter runs them, even where they were imported compiled while
    the variable was unset (triton itself interpreted: checked above)."""
    k = tb._kernels()
    assert k is not None, tb.build_error()
    if not tb._interpreted(k):
        tb._kern = importlib.reload(k)
        tb._device_error.clear()
    assert tb.available(torch.device("cpu")), tb.build_error(torch.device("cpu"))
    yield


# ------------------------------------------------------------------ the IEEE twin (numpy)

F32 = np.float32


def _np(x: torch.Tensor) -> np.ndarray:
    return x.detach().float().numpy().copy()


def _lerp(a, b, w):
    d = b - a
    return np.where(w < F32(0.5), a + w * d, b - d * (F32(1.0) - w))


def _store(p: torch.Tensor, x: np.ndarray) -> None:
    p.copy_(torch.from_numpy(x))  # torch rounds fp32 to bf16 / fp16 to nearest even


_HYP_REST = (Hyp.DECAY, Hyp.NEG_STEP, Hyp.BC2, Hyp.EPS)


def _hyp(h, *columns):
    """The kernels' fp32 hyperparameters (``segment_table.hyper_row``) at ``columns``."""
    row = np.array(segment_table.hyper_row(h), dtype=F32)
    return tuple(row[c] for c in columns)


class Twin:
    """The kernels' arithmetic, one segment at a time, in numpy fp32 (every operation
    correctly rounded, none fused), sums of g^2 in fp64."""

    @staticmethod
    def dense(p, g, st, h):
        w, b2, a2, decay, neg, bc2, eps = _hyp(h, Hyp.W, Hyp.BETA2, Hyp.A2, *_HYP_REST)
        gi, pi = _np(g), _np(p) * decay
        mi = _lerp(_np(st.exp_avg), gi, w)
        vi = _np(st.exp_avg_sq) * b2 + (a2 * gi) * gi
        r = hash_bits(h.step, torch.arange(st.start, st.start + st.numel))
        st.exp_avg.copy_(round_bf16(torch.from_numpy(mi), r & 0xFFFF))
        st.exp_avg_sq.copy_(round_bf16(torch.from_numpy(vi), r >> 16))
        denom = np.sqrt(vi) / bc2 + eps
        _store(p, pi + neg * (mi / denom))

    @staticmethod
    def denominator(gi, mi, sv, j, count, h, fe, rule=True):
        """The blocked update's denominator with eps, per element: the shared s (sqrt(v) / bc2,
        or sqrt(v) times the element's factor entry ``fe``) and, where g opposes m (unless
        ``rule`` is False), at least sqrt(s^2 keep + m_hat^2), keep from the block's fp64 sums
        of m_hat^2 and f^2 (``_new_block``, ``_element``); everywhere at least |g| g_floor."""
        bc1, bc2, eps, gf = _hyp(h, Hyp.BC1, Hyp.BC2, Hyp.EPS, Hyp.G_FLOOR)
        nb = sv.size
        mh = mi / bc1
        mean_m2 = np.bincount(j, weights=mh.astype(np.float64) ** 2, minlength=nb) / count
        mean_m2 = mean_m2.astype(F32)
        if fe is None:
            den = sv / bc2
            ss, s = den * den, den[j]
        else:
            f2 = np.bincount(j, weights=fe.astype(np.float64) ** 2, minlength=nb) / count
            ss, s = (sv * sv) * f2.astype(F32), sv[j] * fe
        pos = ss > 0
        keep = np.where(pos, np.maximum(F32(1.0) - mean_m2 / np.where(pos, ss, F32(1.0)), 0), 0)
        keep = keep.astype(F32)
        split = np.sqrt(s * s * keep[j] + mh * mh)
        turned = (gi * mi < 0) if rule else np.zeros(mi.shape, bool)
        return np.maximum(np.where(turned, np.maximum(s, split), s), np.abs(gi) * gf) + eps

    @classmethod
    def blocks(cls, p, g, st, h, levels, mids, bits, f):
        """block_update (B > 1) and column_update (B < 0) with factor ``f`` (or None)."""
        w, b2, a2, decay, neg, bc2, eps = _hyp(h, Hyp.W, Hyp.BETA2, Hyp.A2, *_HYP_REST)
        n, B, start = st.numel, st.block_size, st.start
        i = np.arange(n)
        if B > 0:
            j, fi = (start + i) // B - start // B, (start + i) % B
        else:
            j, fi = i % -B, (start + i) // -B
        nb = st.v.numel()
        gi = _np(g)
        lev = _np(levels)
        codes = st.codes.numpy()
        code = codes.astype(np.int64) if bits == 8 else _nibbles(codes, n)
        mi = _lerp(lev[code] * _np(st.absmax)[j], gi, w)
        x64 = gi.astype(np.float64)
        total = np.bincount(j, weights=x64 * x64, minlength=nb)
        count = np.bincount(j, minlength=nb)
        mean = (total / count).astype(F32)
        v = _np(st.v) * b2 + a2 * mean
        sv = np.sqrt(v)
        amax = np.zeros(nb, dtype=F32)
        np.maximum.at(amax, j, np.abs(mi))
        d = cls.denominator(gi, mi, sv, j, count, h, None if f is None else _np(f)[fi])
        _store(p, _np(p) * decay + neg * (mi / d))
        x = mi / np.where(amax > 0, amax, F32(1.0))[j]
        if bits == 8:
            new = np.searchsorted(_np(mids), x, side="left")  # first midpoint >= x
        else:
            u = uniforms(h.step, torch.arange(start, start + n))
            new = stochastic_quantize(torch.from_numpy(x), levels, u).numpy()
        if bits == 8:
            st.codes.copy_(torch.from_numpy(new.astype(np.uint8)))
        else:
            out = codes.copy()
            lo, hi = new[0::2], new[1::2]
            pad = out[n // 2 :] >> 4 if n % 2 else np.zeros(0, np.uint8)
            hi = np.concatenate([hi, pad]).astype(np.uint8)
            st.codes.copy_(torch.from_numpy((lo.astype(np.uint8) | (hi << 4)).astype(np.uint8)))
        st.v.copy_(torch.from_numpy(v))
        st.absmax.copy_(torch.from_numpy(amax))

    @staticmethod
    def factor(st, h, sums, counts):
        """cross_factor_kernel: fp64 means, fold, the factor from the lagged or folded v."""
        hyp = np.array(segment_table.cross_hyper_row(h), dtype=F32)
        b2, a2, bc2, floor = (
            hyp[c] for c in (CrossHyp.BETA2, CrossHyp.A2, CrossHyp.BC2, CrossHyp.FLOOR)
        )
        v = _np(st.v_cross)
        n = v.size
        before = F32(v.astype(np.float64).sum() / n)
        s, c = sums.double().numpy(), counts.double().numpy()
        mean = np.where(c > 0, s / np.maximum(c, 1.0), 0.0).astype(F32)
        nv = v * b2 + a2 * mean
        if before > 0:
            base, over = v, before
        else:
            total = F32(nv.astype(np.float64).sum() / n)
            base, over = nv, total if total > 0 else F32(1.0)
        st.v_cross.copy_(torch.from_numpy(nv))
        return torch.from_numpy(np.sqrt(np.maximum(base / over, floor)) / bc2)

    @classmethod
    def step(cls, p, g, st, h, levels, mids, bits, f="own"):
        if st.block_size == 1:
            return cls.dense(p, g, st, h)
        if isinstance(f, str):
            f = None
            if st.v_cross is not None and st.v_cross.numel():
                f = cls.factor(st, h, *cross_sums(g, st.start, st.block_size, st.v_cross.numel()))
        cls.blocks(p, g, st, h, levels, mids, bits, f)


def _nibbles(codes: np.ndarray, n: int) -> np.ndarray:
    return np.stack([codes & 15, codes >> 4], axis=1).reshape(-1)[:n].astype(np.int64)


# ------------------------------------------------------------------------------- fixtures


def _levels(bits: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    levels = codebook.learn_codebook(
        codebook.histogram(torch.rand(4096, generator=gen) * 2 - 1), bits
    )
    return levels, midpoints(levels)


def _state(start, numel, block, bits, tensor_numel=None, gen=None) -> SegmentState:
    """A segment's state; random (codes, absmax, v, v_cross or bf16 m, v) with ``gen``."""
    st = SegmentState(start, numel, block)
    if block == 1:
        st.exp_avg = torch.zeros(numel, dtype=torch.bfloat16)
        st.exp_avg_sq = torch.zeros(numel, dtype=torch.bfloat16)
        if gen is not None:
            st.exp_avg.copy_(torch.randn(numel, generator=gen) * 0.1)
            st.exp_avg_sq.copy_(torch.rand(numel, generator=gen) * 0.01)
        return st
    nb = num_blocks(start, numel, block)
    st.codes = torch.zeros(numel if bits == 8 else (numel + 1) // 2, dtype=torch.uint8)
    st.absmax, st.v = torch.zeros(nb), torch.zeros(nb)
    st.v_cross = torch.zeros(cross_length(block, tensor_numel or start + numel))
    if gen is not None:
        st.codes.copy_(torch.randint(0, 256, st.codes.shape, generator=gen, dtype=torch.uint8))
        st.absmax.copy_(torch.rand(nb, generator=gen) * 0.1)
        st.v.copy_(torch.rand(nb, generator=gen) * 0.01)
        st.v_cross.copy_(torch.rand(st.v_cross.numel(), generator=gen) * 0.01)
    return st


def _copy(st: SegmentState) -> SegmentState:
    return dataclasses.replace(
        st, **{k: getattr(st, k).clone() for k in checks.STATE_FIELDS if getattr(st, k) is not None}
    )


def _assign(dst: SegmentState, src: SegmentState) -> None:
    for k in checks.STATE_FIELDS:
        if getattr(src, k) is not None:
            getattr(dst, k).copy_(getattr(src, k))


def _equal(st: SegmentState, twin: SegmentState, what: str) -> None:
    for k in checks.STATE_FIELDS:
        a, b = getattr(st, k), getattr(twin, k)
        if a is not None:
            assert torch.equal(a, b), f"{k} differs from the twin ({what})"


def _reference(p, g, st, h, levels, mids, bits):
    if st.block_size == 1:
        dense_update(p, g, st, h)
    elif st.block_size < 0:
        column_update(p, g, st, h, levels, mids, bits)
    else:
        block_update(p, g, st, h, levels, mids, bits)


def _hyper(t: int, lr: float = 1e-2, beta1: float = 0.9) -> Hyper:
    return Hyper(lr=lr, beta1=beta1, beta2=0.99, eps=1e-8, weight_decay=0.1, step=t)


# (bits, p dtype, g dtype, start, numel, block): prime sizes, odd starts (4-bit bytes shared by
# two blocks), every width class, a block of 5 tiles, B = 1 past 2^31, columns from mid-row
LAYOUTS = [
    (4, torch.float32, torch.float32, 37, 4001, 97),  # factored (42 blocks), shared bytes
    (4, torch.float16, torch.bfloat16, 5, 1001, 13),  # 16-wide class, factored
    (8, torch.float32, torch.float32, 3, 2003, 61),  # 64-wide class, factored
    (8, torch.bfloat16, torch.bfloat16, 0, 3000, 1000),  # 1024-wide, unfactored
    (8, torch.float32, torch.float16, 123, 4999 + 7, 4999),  # a cut block of 5 tiles
    (4, torch.bfloat16, torch.float32, 2**31 - 1001, 2049, 1),  # B = 1, indices >= 2^31
    (4, torch.float32, torch.float32, 37, 4001, -97),  # columns from mid-row, factored
    (8, torch.float16, torch.float16, 5, 9001, -300),  # columns, factored
    (4, torch.float32, torch.bfloat16, 251, 99, -300),  # a piece of two rows, fewer than P
]


def _ids(layout):
    bits, pt, gt, start, numel, block = layout
    return f"{bits}b-{str(pt)[6:]}-{str(gt)[6:]}-s{start}-n{numel}-B{block}"


@pytest.mark.parametrize("layout", LAYOUTS, ids=_ids)
def test_each_step_from_the_reference_state(layout):
    """Three steps, each from the reference's own state: the kernel equals the twin bit for
    bit and the reference within ``agree``. The second step takes beta1 = 0.3, so lerp's other
    branch (weight 1 - beta1 >= 0.5) runs too."""
    bits, pt, gt, start, numel, block = layout
    gen = torch.Generator().manual_seed(numel)
    levels, mids = _levels(bits)
    ref = _state(start, numel, block, bits, gen=gen)
    p_ref = torch.randn(numel, generator=gen).to(pt)
    for t in range(1, 4):
        g = torch.randn(numel, generator=gen).to(gt)
        h = _hyper(t, beta1=0.3 if t == 2 else 0.9)
        mine, twin = _copy(ref), _copy(ref)
        p, p_twin, before = p_ref.clone(), p_ref.clone(), p_ref.clone()
        tb.step([SegmentWork(p, g, mine, h, levels, mids, bits)])
        Twin.step(p_twin, g, twin, h, levels, mids, bits)
        assert torch.equal(p, p_twin), f"parameters differ from the twin (step {t})"
        _equal(mine, twin, f"step {t}")
        _reference(p_ref, g, ref, h, levels, mids, bits)
        checks.agree(p, mine, p_ref, ref, before, bits, f"step {t}")


def test_a_tie_goes_to_the_lower_level():
    """8-bit codes round to the nearest level, a tie to the lower one (torch.bucketize): with
    dyadic levels, beta1 = 0.5 and g one level above m, m lands exactly on a midpoint."""
    levels = torch.cat([torch.arange(-128, 127) / 128.0, torch.ones(1)])  # 256, dyadic
    mids = midpoints(levels)
    n, start, block = 300, 0, 300
    st = _state(start, n, block, 8)
    code = torch.arange(n) % 254 + 1
    code[0] = 0  # level -1, g -1: |m| = 1 = the block's absmax, so x = m exactly
    st.codes.copy_(code.to(torch.uint8))
    st.absmax.fill_(1.0)
    g = levels[code + 1]
    g[0] = -1.0
    h = Hyper(lr=1e-3, beta1=0.5, beta2=0.99, eps=1e-8, weight_decay=0.0, step=1)
    ref, twin = _copy(st), _copy(st)
    p = torch.zeros(n)
    tb.step([SegmentWork(p, g, st, h, levels, mids, 8)])
    _reference(torch.zeros(n), g, ref, h, levels, mids, 8)
    Twin.step(torch.zeros(n), g, twin, h, levels, mids, 8)
    assert torch.equal(st.codes[1:].long(), code[1:]), "ties must go to the lower level"
    assert torch.equal(st.codes, ref.codes) and torch.equal(st.codes, twin.codes)


def _near(p, st, p_ref, st_ref, p0, bits, lr, what):
    """``agree`` for a free run, where ulp-level differences compound and a code on a rounding
    threshold now and then flips and moves its element by a fraction of a step: the states
    within agree's bounds (p checked separately), and all but one parameter in 500 within
    agree's tolerance, those few within one lr."""
    tol = checks.PARAM_RTOL[p.dtype]
    scale = torch.maximum(p0.float().abs(), p_ref.float().abs()).clamp_min(1e-3)
    d = (p.float() - p_ref.float()).abs()
    off = d / scale > tol
    assert int(off.sum()) <= max(1, p.numel() // 500), f"{int(off.sum())} parameters off ({what})"
    assert bool((d[off] <= lr).all()), f"a parameter off by {float(d.max()):.3g} ({what})"
    checks.agree(p_ref.clone(), st, p_ref, st_ref, p0, bits, what)


@pytest.mark.parametrize("layout", [LAYOUTS[k] for k in (0, 2, 4, 5, 7)], ids=_ids)
def test_a_free_run(layout):
    """Six steps from zero state under an lr schedule: the kernel equals the twin bit for bit
    throughout, and stays near the reference's own run (``_near``) at every step."""
    bits, pt, gt, start, numel, block = layout
    gen = torch.Generator().manual_seed(7)
    levels, mids = _levels(bits, seed=1)
    mine, twin, ref = (_state(start, numel, block, bits) for _ in range(3))
    p0 = torch.randn(numel, generator=gen).to(pt)
    p, p_twin, p_ref = p0.clone(), p0.clone(), p0.clone()
    for t in range(1, 7):
        g = torch.randn(numel, generator=gen).to(gt)
        h = _hyper(t, lr=1e-2 * (1 - t / 10))
        tb.step([SegmentWork(p, g, mine, h, levels, mids, bits)])
        Twin.step(p_twin, g, twin, h, levels, mids, bits)
        _reference(p_ref, g, ref, h, levels, mids, bits)
        assert torch.equal(p, p_twin), f"parameters differ from the twin (step {t})"
        _equal(mine, twin, f"step {t}")
        _near(p, mine, p_ref, ref, p0, bits, h.lr, f"step {t}")


class _NoRule(Twin):
    """The twin without the overshoot rule: every denominator the block's shared one."""

    @staticmethod
    def denominator(*args):
        return Twin.denominator(*args, rule=False)


TURNS = [  # (bits, start, numel, block, factored)
    (8, 3, 1501, 200, False),  # contiguous, a cut first block
    (4, 37, 4001, 97, True),  # contiguous, factored
    (4, 3, 1001, -13, False),  # columns (P < MIN_CROSS_BLOCKS)
    (8, 37, 4001, -97, True),  # columns from mid-row, factored
]


@pytest.mark.parametrize("turn", TURNS, ids=lambda t: f"{t[0]}b-s{t[1]}-n{t[2]}-B{t[3]}")
def test_where_the_gradient_turns(turn):
    """The overshoot rule: four steps of one gradient, then its negation, so at step 5 g
    opposes m everywhere. The kernels equal the twin bit for bit and stay near the reference
    at every step; at step 5 the rule (denominator at least sqrt(s^2 keep + m_hat^2)) shortens
    many elements' steps against the rule-free twin (``_NoRule``), and never lengthens one."""
    bits, start, numel, block, factored = turn
    gen = torch.Generator().manual_seed(numel)
    levels, mids = _levels(bits, seed=2)
    mine, twin, ref = (_state(start, numel, block, bits) for _ in range(3))
    assert bool(mine.v_cross is not None and mine.v_cross.numel()) == factored
    p0 = torch.randn(numel, generator=gen)
    g0 = torch.randn(numel, generator=gen) * torch.rand(numel, generator=gen)
    p, p_twin, p_ref = p0.clone(), p0.clone(), p0.clone()
    for t in range(1, 6):
        g = g0 if t < 5 else -g0
        h = _hyper(t, lr=1e-2)
        if t == 5:
            p_free, free = p_twin.clone(), _copy(twin)
            _NoRule.step(p_free, g, free, h, levels, mids, bits)
            before = p_twin.clone()
        tb.step([SegmentWork(p, g, mine, h, levels, mids, bits)])
        Twin.step(p_twin, g, twin, h, levels, mids, bits)
        _reference(p_ref, g, ref, h, levels, mids, bits)
        assert torch.equal(p, p_twin), f"parameters differ from the twin (step {t})"
        _equal(mine, twin, f"step {t}")
        _near(p, mine, p_ref, ref, p0, bits, h.lr, f"step {t}")
    decay = float(np.float32(segment_table.hyper_row(h)[Hyp.DECAY]))
    moved, free_moved = (p - before * decay).abs(), (p_free - before * decay).abs()
    changed = p != p_free
    assert int(changed.sum()) >= numel // 10, f"the rule changed {int(changed.sum())} steps"
    assert bool((moved <= free_moved).all()), "the rule may only shorten a step"
    assert bool((moved[changed] < free_moved[changed]).all())
    _equal(free, twin, "the rule changes only the parameters")


# ------------------------------------------------------------ several tensors in one call


TENSORS = [  # (numel, block, bits, p dtype, g dtype): pieces of one flat buffer
    (24 * 97, 97, 4, torch.float32, torch.float32),  # factored rows
    (20 * 61, -61, 4, torch.bfloat16, torch.bfloat16),  # factored columns
    (777, 1, 4, torch.float32, torch.float32),  # B = 1
    (3001, 3001, 8, torch.float16, torch.float32),  # one long block, 8 bits
    (29 * 17, 17, 8, torch.float32, torch.float16),  # factored, 64-wide class
]


def _shards(cuts: list[int]) -> list[list[tuple[int, int, int]]]:
    """The tensors laid end to end in one flat buffer and cut at ``cuts`` (FSDP1 flat shards,
    ZeRO partitions): per rank, its pieces as (tensor, start in the tensor, numel)."""
    bounds = np.cumsum([0] + [t[0] for t in TENSORS])
    edges = [0, *cuts, int(bounds[-1])]
    ranks = []
    for a, b in zip(edges[:-1], edges[1:], strict=True):
        pieces = []
        for k in range(len(TENSORS)):
            lo, hi = max(a, bounds[k]), min(b, bounds[k + 1])
            if lo < hi:
                pieces.append((k, int(lo - bounds[k]), int(hi - lo)))
        ranks.append(pieces)
    return ranks


class Rank:
    """One rank's pieces: flat buffers of p and g (views into them per piece, as FSDP hands
    them), a state per piece."""

    def __init__(self, pieces, full_p, seed):
        self.pieces = pieces
        self.p = [full_p[k][s : s + n].clone() for k, s, n in pieces]
        self.st = [
            _state(s, n, TENSORS[k][1], TENSORS[k][2], tensor_numel=TENSORS[k][0])
            for k, s, n in pieces
        ]
        self.gen = torch.Generator().manual_seed(seed)

    def clone(self):
        other = object.__new__(Rank)
        other.pieces, other.gen = self.pieces, None
        other.p = [p.clone() for p in self.p]
        other.st = [_copy(st) for st in self.st]
        return other


def _spread(ranks: list[list[tuple]]) -> set[int]:
    count = {}
    for pieces in ranks:
        for k, _, _ in pieces:
            count[k] = count.get(k, 0) + 1
    return {k for k, c in count.items() if c > 1}


def _sharded_step(impl, ranks, grads, h, books):
    """One step of every rank: the spread tensors' factors from their pieces' sums added over
    the ranks (the all-reduce), then one step call per rank (``impl``: "triton", "twin",
    "reference"); tensors held whole get their factor inside the call."""
    spread = _spread([r.pieces for r in ranks])
    total = {}
    for r, rg in zip(ranks, grads, strict=True):
        mine = [
            (k, g, st)
            for (k, _, _), g, st in zip(r.pieces, rg, r.st, strict=True)
            if k in spread and st.v_cross is not None and st.v_cross.numel()
        ]
        if impl == "triton":
            work = [CrossWork(g, st, h, False) for _, g, st in mine]
            sums = [(v.sums, v.counts) for v in tb.cross_table(work).views]
        else:
            sums = [cross_sums(g, st.start, st.block_size, st.v_cross.numel()) for _, g, st in mine]
        for (k, _, _), (s, c) in zip(mine, sums, strict=True):
            a, b = total.get(k, (0.0, 0.0))
            total[k] = (a + s, b + c)
    for r, rg in zip(ranks, grads, strict=True):
        fac = {}
        todo = [
            (i, st)
            for i, ((k, _, _), st) in enumerate(zip(r.pieces, r.st, strict=True))
            if k in total
        ]
        if impl == "triton":
            made = tb.factors([FactorWork(st, h, *total[r.pieces[i][0]]) for i, st in todo])
        elif impl == "twin":
            made = [Twin.factor(st, h, *total[r.pieces[i][0]]) for i, st in todo]
        else:
            made = [cross_factor(st, h, cross_mean(*total[r.pieces[i][0]])) for i, st in todo]
        fac = {i: f for (i, _), f in zip(todo, made, strict=True)}
        work = []
        for i, ((k, _, _), p, g, st) in enumerate(zip(r.pieces, r.p, rg, r.st, strict=True)):
            levels, mids = books[TENSORS[k][2]]
            work.append(SegmentWork(p, g, st, h, levels, mids, TENSORS[k][2], fac.get(i)))
        if impl == "triton":
            tb.step(work)  # factor None: the tensor is held whole, the kernels take its own
            continue
        for w in work:
            f = [] if w.factor is None else [w.factor]
            if impl == "twin":
                Twin.step(w.p, w.g, w.seg, w.hyper, w.levels, w.mids, w.bits, *(f or ["own"]))
            elif w.seg.block_size == 1:
                dense_update(w.p, w.g, w.seg, w.hyper)
            else:
                update = column_update if w.seg.block_size < 0 else block_update
                update(w.p, w.g, w.seg, w.hyper, w.levels, w.mids, w.bits, *f)


def _grads(ranks, gen):
    out = []
    for r in ranks:
        out.append([torch.randn(n, generator=gen).to(TENSORS[k][4]) for k, _, n in r.pieces])
    return out


@pytest.mark.parametrize("cuts", [[1501], [1777, 3601, 4200]], ids=["2 ranks", "4 ranks"])
def test_pieces_of_several_tensors_in_one_call(cuts):
    """Each rank steps all its pieces in one call (several tensors, blocks cut by the shard
    boundaries, spread tensors' factors from sums over the ranks): equal to the twin bit for
    bit, and near the reference, over three steps; and at most 9 launches a call."""
    ranks_pieces = _shards(cuts)
    assert _spread(ranks_pieces), "the cuts must spread a factored tensor over ranks"
    gen = torch.Generator().manual_seed(3)
    full_p = [torch.randn(n, generator=gen).to(pt) for n, _, _, pt, _ in TENSORS]
    books = {4: _levels(4), 8: _levels(8)}
    mine = [Rank(pc, full_p, 0) for pc in ranks_pieces]
    twin, ref = [r.clone() for r in mine], [r.clone() for r in mine]
    p0 = [[p.clone() for p in r.p] for r in mine]
    for t in range(1, 4):
        grads = _grads(mine, gen)
        h = _hyper(t, lr=1e-2 / t)
        for impl, ranks in (("triton", mine), ("twin", twin), ("reference", ref)):
            _sharded_step(impl, ranks, grads, h, books)
        for r, rt, rr, r0 in zip(mine, twin, ref, p0, strict=True):
            for i, (k, s, n) in enumerate(r.pieces):
                what = f"step {t}, tensor {k} [{s}, {s + n})"
                assert torch.equal(r.p[i], rt.p[i]), what
                _equal(r.st[i], rt.st[i], what)
                _near(r.p[i], r.st[i], rr.p[i], rr.st[i], r0[i], TENSORS[k][2], h.lr, what)
    work = [
        SegmentWork(p, torch.zeros_like(p), st, _hyper(9), *books[TENSORS[k][2]], TENSORS[k][2])
        for r in mine
        for (k, _, _), p, st in zip(r.pieces, r.p, r.st, strict=True)
    ]
    plan = tb.step_plan(work, {})
    assert len(plan.launches) <= 9
    assert len(plan.rows) == len(work)


# ------------------------------------------------------------------------- the factor pass


def _cross_items(gen):
    """(g, state, whole) of factored pieces: rows and columns, odd starts, mid-row starts."""
    out = []
    for start, numel, block, tensor_numel in [
        (0, 40 * 97, 97, 40 * 97),  # a whole tensor
        (1000, 2001, 97, 40 * 97),  # a piece cut mid-block
        (37, 4001, -97, 4038),  # a whole tensor from a mid-row... (start 37: its piece)
        (250, 1500, -300, 300 * 20),  # columns, a piece across mid-rows
        (5, 20 * 1031, 1031, 21 * 1031),  # many positions (tiles of the finish pass)
    ]:
        st = _state(start, numel, block, 4, tensor_numel=tensor_numel, gen=gen)
        g = torch.randn(numel, generator=gen).to(torch.bfloat16 if block < 0 else torch.float32)
        out.append((g, st, start == 0 or block == -97))
    return out


@pytest.mark.parametrize("lagged", [True, False], ids=["lagged", "first step"])
def test_cross_table_sums_counts_and_factors(lagged):
    """Sums equal reference.cross_sums (fp64, another order: to 1e-12), counts exactly; a
    whole item's factor and folded v_cross equal the twin bit for bit and the reference's
    within 1e-5; pieces of spread tensors leave v_cross alone; ``dest`` receives the sums."""
    gen = torch.Generator().manual_seed(11)
    items = _cross_items(gen)
    h = _hyper(4)
    if not lagged:
        for _, st, _ in items:
            st.v_cross.zero_()
    twin = [_copy(st) for _, st, _ in items]
    ref = [_copy(st) for _, st, _ in items]
    dest = [None] * len(items)
    for k in (1, 3):
        n = items[k][1].v_cross.numel()
        dest[k] = CrossDest(*(torch.zeros(n, dtype=torch.float64) for _ in "sc"))
    v_before = [st.v_cross.clone() for _, st, _ in items]
    plan = tb.cross_table([CrossWork(g, st, h, whole) for g, st, whole in items], dest)
    for k, ((g, st, whole), (sums, counts, f)) in enumerate(zip(items, plan.views, strict=True)):
        want_s, want_c = cross_sums(g, st.start, st.block_size, st.v_cross.numel())
        torch.testing.assert_close(sums, want_s, rtol=1e-12, atol=0)
        assert torch.equal(counts, want_c), k
        if dest[k] is not None:
            assert sums.data_ptr() == dest[k].sums.data_ptr()
            assert counts.data_ptr() == dest[k].counts.data_ptr()
        if not whole:
            assert f is None and torch.equal(st.v_cross, v_before[k]), k
            continue
        assert torch.equal(f, Twin.factor(twin[k], h, want_s, want_c)), k
        assert torch.equal(st.v_cross, twin[k].v_cross), k
        want = cross_factor(ref[k], h, cross_mean(want_s, want_c))
        torch.testing.assert_close(f, want, rtol=1e-5, atol=0)
        torch.testing.assert_close(st.v_cross, ref[k].v_cross, rtol=1e-5, atol=0)


def test_factors_from_reduced_sums_and_an_empty_piece():
    """``factors`` (the spread tensors' factors from all-reduced sums) equals the twin bit for
    bit, v_cross folded; an entry no element reached (count 0) folds a zero; a whole item of
    no elements gets the reference's factor of zeros."""
    gen = torch.Generator().manual_seed(5)
    h = _hyper(3)
    work, twins = [], []
    for block, n, zero in [(97, 97, False), (-61, 33, True), (1031, 1031, False)]:
        st = _state(0, 1, block, 4, tensor_numel=n * abs(block), gen=gen)
        st.v_cross.copy_(torch.rand(n, generator=gen))
        if zero:
            st.v_cross.zero_()
        sums = torch.rand(n, dtype=torch.float64, generator=gen) * 10
        counts = torch.randint(0, 5, (n,), generator=gen).double()
        work.append(FactorWork(st, h, sums, counts))
        twins.append(_copy(st))
    made = tb.factors(work)
    for (st, _, sums, counts), twin, f in zip(work, twins, made, strict=True):
        assert torch.equal(f, Twin.factor(twin, h, sums, counts))
        assert torch.equal(st.v_cross, twin.v_cross)
    st = _state(64, 0, 97, 4, tensor_numel=40 * 97)
    st.v_cross.copy_(torch.rand(97, generator=gen))
    twin = _copy(st)
    (got,) = tb.cross_table([CrossWork(torch.zeros(0), st, h, True)]).views
    f = got.factor
    assert torch.equal(f, cross_factor(twin, h, torch.zeros(97)))


# ------------------------------------------------------------- determinism, resumption


def _mixed(gen, n_tensors=5):
    out = []
    for k in range(n_tensors):
        numel, block, bits, pt, gt = TENSORS[k % len(TENSORS)]
        start = 3 if block != 1 else 0
        p = torch.randn(numel - start, generator=gen).to(pt)
        st = _state(start, numel - start, block, bits, tensor_numel=numel)
        out.append((p, st, gt, bits))
    return out


def _run(items, books, steps, gen_seed, first=1):
    gen = torch.Generator().manual_seed(gen_seed)
    for t in range(first, first + steps):
        work = []
        for p, st, gt, bits in items:
            g = torch.randn(p.numel(), generator=gen).to(gt)
            work.append(SegmentWork(p, g, st, _hyper(t, lr=1e-2 * 0.9**t), *books[bits], bits))
        tb.step(work)


def test_same_inputs_same_bits_and_a_resumed_run_continues_exactly():
    """Two runs of the same four steps over several tensors give the same bits, the second
    one "saved and loaded" (every tensor copied into a fresh one) after step two."""
    books = {4: _levels(4), 8: _levels(8)}
    gen = torch.Generator().manual_seed(2)
    base = _mixed(gen)
    grads = [
        [torch.randn(p.numel(), generator=gen).to(gt) for p, _, gt, _ in base] for _ in range(4)
    ]
    runs = []
    for resume in (False, True):
        items = [(p.clone(), _copy(st), gt, bits) for p, st, gt, bits in base]
        for t, gs in enumerate(grads, start=1):
            if resume and t == 3:
                items = [(p.clone(), _copy(st), gt, bits) for p, st, gt, bits in items]
            work = [
                SegmentWork(p, g, st, _hyper(t, lr=1e-2 * 0.9**t), *books[bits], bits)
                for (p, st, gt, bits), g in zip(items, gs, strict=True)
            ]
            tb.step(work)
        runs.append(items)
    for (pa, sa, _, _), (pb, sb, _, _) in zip(*runs, strict=True):
        assert torch.equal(pa, pb)
        _equal(sa, sb, "a resumed run")
    assert any(st.v_cross is not None and st.v_cross.numel() for _, st, _, _ in base)


# --------------------------------------------------------------------- hash, compilation


@pytest.mark.parametrize("first", [0, 2**31 - 700, 2**32 - 300, 5 * 2**32 + 7])
def test_the_kernels_hash_is_codes_hash_bits(first):
    """The counter hash (stochastic 4-bit codes, bf16 rounding of B = 1) over indices past
    2^31 and 2^32 and step keys with the top bit set."""
    k = tb._kernels()
    steps = [1, 2, 977, 2**31 + 5, 2**32 + 3]
    assert any(step_key(s) >= 2**31 for s in steps) and any(step_key(s) < 2**31 for s in steps)
    for s in steps:
        out = torch.zeros(1500, dtype=torch.int64)
        k.hash_kernel[(2,)](out, torch.tensor([first, step_key(s)]), 1500, TILE=1024)
        assert torch.equal(out, hash_bits(s, torch.arange(first, first + 1500))), (first, s)


def _launches(items, books) -> int:
    work = [
        SegmentWork(p, torch.zeros_like(p), st, _hyper(1), *books[b], b) for p, st, _, b in items
    ]
    return len(tb.step_plan(work, {}).launches)


def test_an_lr_schedule_selects_no_new_variant():
    """Only tile shapes are constexpr and integer arguments are not specialised, so steps with
    another lr, step key, layout or number of tensors launch the same variants (the interpreter
    compiles nothing, so the launcher's record of them is what is counted); the launches per
    call do not grow with the tensors; and every variant launched is one ``compile_ptx``
    builds."""
    books = {4: _levels(4), 8: _levels(8)}
    gen = torch.Generator().manual_seed(4)
    items = _mixed(gen)
    tb.SIGNATURES.clear()
    _run(items, books, 1, gen_seed=1)
    seen = set(tb.SIGNATURES)
    launches = {_launches(items, books)}
    for t in range(2, 4):
        _run(items, books, 1, gen_seed=t, first=t)
        assert tb.SIGNATURES == seen, t
    more = _mixed(gen, n_tensors=12)
    _run(more, books, 1, gen_seed=8, first=4)
    assert tb.SIGNATURES == seen
    launches.add(_launches(more, books))
    assert len(launches) == 1 and launches.pop() <= 9
    keys = {(name, tuple(sorted(c.items()))) for name, _, c in checks.variants()}
    assert seen <= keys, seen - keys


COMPILE = r"""
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from gefen_dist.backends import triton_backend as tb
from gefen_dist.backends import triton_checks as checks

UNWANTED = r"\b(?:fma\.rn\.f32|div\.full\.f32|div\.approx\S*|sqrt\.approx\S*|\S+\.ftz\S*)"
out = checks.compile_ptx(90)
bad = {k: sorted(set(re.findall(UNWANTED, p))) for k, p in out.items()}
bad = {k: v for k, v in bad.items() if v}
assert not bad, bad
assert all("div.rn.f32" in p for k, p in out.items() if k[0] in ("dense_kernel", "apply_kernel"))
# with fusion allowed, the same element pass contracts: the check above can see it
name, sig, const = next(v for v in checks.variants() if v[0] == "apply_kernel")
sig = {**sig, **{c: "constexpr" for c in const}}
src = ASTSource(fn=tb._kernels().apply_kernel, signature=sig, constexprs=const)
fused = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": True})
assert "fma.rn.f32" in fused.asm["ptx"]
print(len(out), "variants compiled")
"""


@pytest.mark.slow
def test_every_variant_compiles_for_sm90_without_contraction():
    """In a subprocess without the interpreter, every kernel variant compiles for sm_90 with
    the launch options (no GPU needed: triton's own ptxas), and the PTX holds no FMA, no
    approximate division or square root, nothing flushing subnormals; with fusion allowed the
    same element pass does contract (so the check can see it)."""
    extra("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run(
        [sys.executable, "-c", COMPILE],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=root,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    assert "variants compiled" in done.stdout


# ------------------------------------------------------------------------- the rest of the API


def test_histogram_equals_the_torch_binning():
    """``histogram`` (codebook initialisation on the device) bins as codebook.histogram does,
    a cut first / last block normalised by the whole block's absmax where given."""
    gen = torch.Generator().manual_seed(6)
    for dtype, start, n, block, head, tail in [
        (torch.float32, 37, 4001, 97, -1.0, -1.0),
        (torch.bfloat16, 37, 4001, 97, 5.0, 7.0),
        (torch.float16, 10, 50, 97, -1.0, 4.0),
        (torch.float32, 0, 3000, 1000, -1.0, -1.0),
    ]:
        g = torch.randn(n, generator=gen).to(dtype)
        counts = torch.zeros(codebook.DEFAULT_BINS, dtype=torch.int64)
        tb.histogram(g, start, block, head, tail, counts)
        want = torch.zeros(codebook.DEFAULT_BINS, dtype=torch.float64)
        nb = num_blocks(start, n, block)
        for j in range(nb):
            lo = max((start // block + j) * block, start) - start
            hi = min((start // block + j + 1) * block, start + n) - start
            x = g[lo:hi].float()
            amax = x.abs().max()
            if hi - lo < block and j == 0 and head >= 0:
                amax = torch.tensor(head)
            elif hi - lo < block and j == nb - 1 and tail >= 0:
                amax = torch.tensor(tail)
            if amax > 0:
                codebook.histogram(x / torch.full_like(x, float(amax)), out=want)
        assert torch.equal(counts.double(), want), (dtype, start, n, block)


def test_supports_and_availability(monkeypatch):
    x = torch.zeros(4)
    assert tb.supports(x, x.bfloat16()) and tb.supports(x.half(), x)
    assert not tb.supports(x.double(), x) and not tb.supports(x, x.int())
    assert not tb.supports(torch.zeros(4, device="meta"), torch.zeros(4, device="meta"))
    assert tb.available() and tb.available(torch.device("cpu")) and tb.build_error() is None
    assert not tb.available(torch.device("cuda")) and "TRITON_INTERPRET" in tb.build_error("cuda")
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not tb.supports(x, x)  # the CPU only under the interpreter
    assert tb.step([]) is None and tb.factors([]) == [] and not tb.cross_table([]).views


def test_import_gefen_dist_does_not_import_triton():
    """No module of the package imports triton (or the kernels) at its top level: only
    ``triton_backend._kernels`` does, on first use."""
    import ast
    import pathlib

    import gefen_dist

    for path in pathlib.Path(gefen_dist.__file__).parent.rglob("*.py"):
        if path.name == "triton_kernels.py":
            continue
        for node in ast.parse(path.read_text()).body:
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [a.name for a in node.names]
            assert not any(n.split(".")[0] == "triton" or n == "triton_kernels" for n in names), (
                f"{path.name} imports {names} at its top level"
            )
