"""``native_cuda.agree``, the CUDA self-check's verdict on one step, on the CPU: the reference
step against copies of its own result, altered as a kernel a few ulps off (which must pass) or
a wrong kernel (which must not) would leave them. The self-check itself needs a GPU."""

import dataclasses

import pytest
import torch

from gefen_dist import codebook, native_cuda
from gefen_dist.codes import midpoints, pack4, unpack4
from gefen_dist.reference import Hyper, SegmentState, block_update, cross_length, dense_update
from gefen_dist.segments import num_blocks

START, NUMEL, BLOCK = 37, 4001, 97


def _stepped(bits: int, block: int = BLOCK):
    """(p before, p after, state after) of one reference step from a state with codes."""
    gen = torch.Generator().manual_seed(0)
    levels = codebook.learn_codebook(
        codebook.histogram(torch.rand(4096, generator=gen) * 2 - 1), bits
    )
    st = SegmentState(START, NUMEL, block)
    if block == 1:
        st.exp_avg = (torch.randn(NUMEL, generator=gen) * 0.1).bfloat16()
        st.exp_avg_sq = torch.rand(NUMEL, generator=gen).bfloat16()
    else:
        nb = num_blocks(START, NUMEL, block)
        codes = torch.randint(0, 1 << bits, (NUMEL,), generator=gen, dtype=torch.uint8)
        st.codes = pack4(codes) if bits == 4 else codes
        st.absmax, st.v = torch.rand(nb, generator=gen) * 0.1, torch.rand(nb, generator=gen)
        st.v_cross = torch.rand(cross_length(block, START + NUMEL), generator=gen)
    p = torch.randn(NUMEL, generator=gen)
    before = p.clone()
    h = Hyper(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, step=5)
    g = torch.randn(NUMEL, generator=gen)
    if block == 1:
        dense_update(p, g, st, h)
    else:
        block_update(p, g, st, h, levels, midpoints(levels), bits)
    return before, p, st


def _copy(st: SegmentState) -> SegmentState:
    return dataclasses.replace(
        st,
        **{
            k: getattr(st, k).clone()
            for k in native_cuda.STATE_FIELDS
            if getattr(st, k) is not None
        },
    )


def _codes(st: SegmentState, bits: int) -> torch.Tensor:
    return unpack4(st.codes, NUMEL).clone() if bits == 4 else st.codes.clone()


def _set_codes(st: SegmentState, codes: torch.Tensor, bits: int) -> None:
    st.codes = pack4(codes) if bits == 4 else codes


@pytest.mark.parametrize("bits", [4, 8])
def test_agree_passes_a_step_a_few_ulps_and_codes_off(bits):
    before, p, st = _stepped(bits)
    mine, p_mine = _copy(st), p.clone()
    native_cuda.agree(p_mine, mine, p, st, before, bits, "same")
    p_mine.copy_(torch.nextafter(p, torch.full_like(p, 2.0)))  # an ulp up everywhere
    mine.v.mul_(1 + 2e-7)
    codes = _codes(st, bits)
    at = torch.tensor([3, 1000, 2500])
    codes[at] = torch.where(codes[at] > 0, codes[at] - 1, codes[at] + 1)  # flipped to a neighbour
    _set_codes(mine, codes, bits)
    native_cuda.agree(p_mine, mine, p, st, before, bits, "ulps and three codes")


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("wrong", ["p", "v", "absmax", "v_cross", "far_code", "shared_bytes"])
def test_agree_refuses_a_wrong_step(bits, wrong):
    before, p, st = _stepped(bits)
    mine, p_mine = _copy(st), p.clone()
    if wrong == "p":
        p_mine[1234] += 1e-3 * max(1.0, p[1234].abs().item())
    elif wrong in ("v", "absmax", "v_cross"):
        getattr(mine, wrong)[5].mul_(1.001)
    else:
        codes = _codes(st, bits)
        if wrong == "far_code":  # one code two levels off
            c = int(codes[77])
            codes[77] = c + 2 if c + 2 < 1 << bits else c - 2
        else:  # the first element of every block one level off: a race on shared bytes
            first = torch.arange(-START % BLOCK, NUMEL, BLOCK)
            codes[first] = torch.where(codes[first] > 0, codes[first] - 1, codes[first] + 1)
        _set_codes(mine, codes, bits)
    with pytest.raises(RuntimeError, match="differ"):
        native_cuda.agree(p_mine, mine, p, st, before, bits, wrong)


def test_agree_on_b1_state_allows_a_bf16_ulp_not_more():
    before, p, st = _stepped(4, block=1)
    mine = _copy(st)
    up = torch.nextafter(st.exp_avg_sq[9:10], torch.tensor([2.0], dtype=torch.bfloat16))
    mine.exp_avg_sq[9:10] = up
    native_cuda.agree(p.clone(), mine, p, st, before, 4, "one bf16 ulp")
    mine.exp_avg_sq[9] = st.exp_avg_sq[9] * 1.1
    with pytest.raises(RuntimeError, match="exp_avg_sq differs"):
        native_cuda.agree(p.clone(), mine, p, st, before, 4, "ten percent")
