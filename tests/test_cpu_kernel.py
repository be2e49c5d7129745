"""The numba CPU backend against the reference update, step by step from identical state."""

import pytest
import torch

from gefen_dist import Gefen, Segment, state
from gefen_dist import codebook as cb
from gefen_dist.codes import unpack4

torch.set_num_threads(1)


def _pair(bits, start, numel, shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    p0 = torch.randn(numel, generator=g)
    levels = cb.learn_codebook(cb.histogram(torch.randn(10000, generator=g).clamp(-1, 1)), bits)
    ps, opts = [], []
    for backend in ("reference", "numba"):
        p = p0.clone().requires_grad_()
        o = Gefen([p], lr=1e-2, weight_decay=0.1, bits=bits)
        o.backend = backend
        seg = Segment(0, numel, start, shape)
        o.set_segments(p, [seg])
        # a piece of a larger tensor: its block size is given, as another rank's merge would
        o.state[p] = state.allocate([seg], [shape[1]], levels, p.device)
        ps.append(p)
        opts.append(o)
    return ps, opts


def _grad(numel, start, row, seed):
    g = torch.Generator().manual_seed(seed)
    rows = torch.exp(torch.randn((start + numel) // row + 2, generator=g))
    idx = (torch.arange(numel) + start) // row
    return rows[idx] * torch.randn(numel, generator=g)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(
    "start,numel,shape",
    [(0, 96 * 200, (200, 96)), (37, 4001, (90, 96)), (1, 5 * 96, (6, 96)), (0, 97 * 60, (60, 97))],
)
def test_numba_step_matches_reference(bits, start, numel, shape):
    (pr, pn), (orf, onb) = _pair(bits, start, numel, shape)
    row = shape[1]
    for t in range(5):
        g = _grad(numel, start, row, 10 + t)
        pr.grad, pn.grad = g.clone(), g.clone()
        if t:  # continue both from the reference's state: compare one step at a time
            pn.data.copy_(pr.data)
            for k, v in orf.state[pr].items():
                onb.state[pn][k].copy_(v)
        orf.step()
        onb.step()
        sr, sn = orf.state[pr], onb.state[pn]
        assert int(sr["layout"][0, 3]) == row and int(sn["layout"][0, 3]) == row
        # v: fp64 vs fp32 accumulation of the block mean of g^2
        torch.testing.assert_close(sn["v"], sr["v"], rtol=2e-6, atol=0)
        torch.testing.assert_close(sn["absmax"], sr["absmax"], rtol=1e-6, atol=0)
        torch.testing.assert_close(pn.detach(), pr.detach(), rtol=1e-6, atol=1e-7)
        cr, cn = sr["codes"], sn["codes"]
        if bits == 4:
            cr, cn = unpack4(cr, numel), unpack4(cn, numel)
        diff = (cr.long() - cn.long()).abs()
        assert diff.max() <= 1  # a value on a midpoint may round to the neighbouring level
        assert (diff > 0).float().mean() < 1e-3
    assert onb.memory_report()["backend"] == "numba"
    assert orf.memory_report()["backend"] == "reference"


def test_backend_is_validated():
    o = Gefen([torch.zeros(3, requires_grad=True)])
    assert o.backend == "auto"
    with pytest.raises(ValueError, match="backend"):
        o.backend = "cuda"
