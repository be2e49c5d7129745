"""Pieces of one tensor in one buffer share one ``v_cross`` (``state.cross_column``).

A RowwiseParallel weight's piece is one segment per row, and each used to keep its own copy of
the tensor's factor: more state than AdamW's at real widths. Here a buffer holds a tensor as a
segment per row, with no process group: the copy is one, the factor comes from all the rows, so
the steps are the single-process ones (spec), and a state saved with a copy per piece loads.
"""

from __future__ import annotations

import copy
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from needs import extra

from gefen_dist import Gefen
from gefen_dist.method import codebook as cb
from gefen_dist.method import spec, state
from gefen_dist.method.segments import Segment

pytestmark = pytest.mark.unit

ROWS, WIDTH = 24, 64  # 24 blocks of a row: factored (MIN_CROSS_BLOCKS = 16)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rows(name: str = "w") -> list[Segment]:
    return [Segment(r * WIDTH, WIDTH, r * WIDTH, (ROWS, WIDTH), name) for r in range(ROWS)]


def _levels(bits: int) -> torch.Tensor:
    x = torch.rand(1000, generator=_gen(7)) * 2 - 1
    return cb.learn_codebook(cb.histogram(x), bits)


def _opt(p: torch.Tensor, bits: int, backend: str, segments: list[Segment]) -> Gefen:
    opt = Gefen([p], lr=1e-2, weight_decay=0.1, bits=bits)
    opt.backend = backend
    opt.set_segments(p, segments)
    return opt


def test_the_layout_keeps_one_copy_and_every_row_views_it():
    segs = _rows()
    st = state.allocate(segs, [WIDTH] * ROWS, _levels(8), torch.device("cpu"))
    assert st["v_cross"].numel() == state.cross_length(WIDTH, ROWS * WIDTH) == WIDTH
    assert st["layout"][:, 4].tolist() == [WIDTH] + [-1] * (ROWS - 1)
    views = state.segment_views(st)
    ptrs = {v.seg.v_cross.data_ptr() for v in views}
    assert ptrs == {st["v_cross"].data_ptr()}
    # other names, shapes or block sizes keep their own
    other = segs[:2] + [Segment(2 * WIDTH, WIDTH, 0, (ROWS, WIDTH), "u")]
    st = state.allocate(other, [WIDTH, WIDTH, WIDTH], _levels(8), torch.device("cpu"))
    assert st["layout"][:, 4].tolist() == [WIDTH, -1, WIDTH]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("backend", ["reference", "native"])
def test_rows_as_segments_step_as_the_whole_tensor(bits, backend):
    """Blocks of a row, a segment per row: no block is cut, so with the factor taken from all
    rows the update is the single-process one. (With a copy per row, each row's factor came from
    that row alone.)"""
    check_rows(bits, backend)


@pytest.mark.triton
@pytest.mark.slow
def test_rows_as_segments_step_as_the_whole_tensor_on_triton():
    """The same through the Triton kernels, on CPU tensors under Triton's interpreter (set
    before triton is imported, hence a process of its own)."""
    _on_triton("check_rows")


def _on_triton(check: str) -> None:
    """``check(bits, 'triton')`` at both widths in a process whose triton is interpreted."""
    extra("triton")
    here = Path(__file__).resolve().parent
    code = f"import test_shared_cross as t; t.{check}(8, 'triton'); t.{check}(4, 'triton')"
    path = os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=600)


def check_rows(bits: int, backend: str) -> None:
    p0 = torch.randn(ROWS * WIDTH, generator=_gen(2))
    p = p0.clone().requires_grad_()
    opt = _opt(p, bits, backend, _rows())
    levels = _levels(bits)
    opt.state[p] = state.allocate(_rows(), [WIDTH] * ROWS, levels, p.device)
    scale = torch.linspace(0.1, 3.0, WIDTH).repeat(ROWS)  # positions differ: the factor matters
    grads = [torch.randn(ROWS * WIDTH, generator=_gen(10 + t)) * scale for t in range(5)]
    for g in grads:
        p.grad = g.clone()
        opt.step()
    want = spec.gefen(p0, grads, 1e-2, (0.9, 0.999), 1e-8, 0.1, WIDTH, levels, 0, ROWS * WIDTH)
    torch.testing.assert_close(p.detach(), want, atol=2e-6, rtol=1e-5)
    assert opt.state[p]["v_cross"].numel() == WIDTH
    assert opt.memory_report()["backend"] == {"native": "native-cpu"}.get(backend, backend)


def _per_piece(st: dict) -> dict:
    """``st`` as a version with a copy of v_cross per piece saved it."""
    old = dict(st)
    layout = st["layout"].clone()
    layout[:, 4] = torch.where(layout[:, 4] < 0, torch.full_like(layout[:, 4], WIDTH), layout[:, 4])
    old["layout"] = layout
    old["v_cross"] = st["v_cross"].repeat(ROWS)
    return old


def test_a_state_saved_with_a_copy_per_piece_loads_and_resumes_the_same():
    torch.manual_seed(0)
    p = torch.randn(ROWS * WIDTH).requires_grad_()
    opt = _opt(p, 8, "native", _rows())
    opt.state[p] = state.allocate(_rows(), [WIDTH] * ROWS, _levels(8), p.device)
    for t in range(3):
        p.grad = torch.randn(p.numel(), generator=_gen(t))
        opt.step()
    sd = copy.deepcopy(opt.state_dict())  # as torch.save would: no tensor shared with opt
    old = {**sd, "state": {0: _per_piece(sd["state"][0])}}
    assert old["state"][0]["v_cross"].numel() == ROWS * WIDTH

    q = p.detach().clone().requires_grad_()
    resumed = _opt(q, 8, "native", _rows())
    resumed.load_state_dict(old)
    got = resumed.state[q]
    assert got["v_cross"].numel() == WIDTH
    assert torch.equal(got["layout"], opt.state[p]["layout"])
    assert torch.equal(got["v_cross"], opt.state[p]["v_cross"])
    for t in range(3, 5):
        g = torch.randn(p.numel(), generator=_gen(t))
        p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        resumed.step()
    assert torch.equal(p, q)


def test_copies_that_differ_are_not_taken_for_one():
    """Only a layout that is exactly the per-piece one is upgraded; anything else is refused
    by name, not silently merged."""
    segs = _rows()
    st = state.allocate(segs, [WIDTH] * ROWS, _levels(8), torch.device("cpu"))
    old = _per_piece(st)
    old["layout"][3, 4] = WIDTH - 1  # one piece with another count: not a layout any run wrote
    old["v_cross"] = old["v_cross"][:-1]
    got = state.upgrade(old, segs)
    assert got["v_cross"].numel() == ROWS * WIDTH - 1
    with pytest.raises(ValueError, match="v_cross entries per segment"):
        state.check_loaded(got, segs, 8, "parameter 'w'")


def test_the_memory_report_counts_one_copy():
    p = torch.randn(ROWS * WIDTH).requires_grad_()
    opt = _opt(p, 4, "native", _rows())
    opt.state[p] = state.allocate(_rows(), [WIDTH] * ROWS, _levels(4), p.device)
    p.grad = torch.randn(p.numel(), generator=_gen(1))
    opt.step()
    rep = opt.memory_report()
    nb = ROWS  # one v and one absmax per row block, one byte per two codes, one v_cross
    assert rep["state_bytes"] == 8 * nb + math.ceil(ROWS * WIDTH / 2) + 4 * WIDTH


# -- rows of a column-blocked tensor's piece share their columns' v and absmax -----------------
P, C0, C = 64, 16, 32  # each row's columns [16, 48) of 64: a RowwiseParallel piece


def _column_rows(name: str = "w") -> list[Segment]:
    return [Segment(r * C, C, r * P + C0, (ROWS, P), name) for r in range(ROWS)]


def test_rows_of_a_column_piece_keep_one_v_and_absmax_per_column():
    st = state.allocate(_column_rows(), [-P] * ROWS, _levels(4), torch.device("cpu"))
    assert st["v"].numel() == st["absmax"].numel() == C  # a copy per row would be ROWS * C
    assert st["v_cross"].numel() == ROWS
    views = state.segment_views(st)
    assert {v.seg.v.data_ptr() for v in views} == {st["v"].data_ptr()}
    ((offset, first, whole),) = state.step_views(st)  # one piece of R rows x C columns
    assert (offset, first, whole.start, whole.numel, whole.block_size) == (0, 0, 0, ROWS * C, -C)
    # a gap in the rows, or another tensor, starts a run of its own
    segs = _column_rows()
    segs[5] = Segment(5 * C, C, 6 * P + C0, (ROWS, P), "w")
    owners = state.block_owners(
        state.layout_rows(state.allocate(segs, [-P] * ROWS, _levels(4), "cpu")), 4
    )
    assert owners == [0] * 5 + [5] + [6] * (ROWS - 6)


def check_column_rows(bits: int, backend: str) -> None:
    """The rows stepped as one R x C piece: the update of an R x C tensor with column blocks,
    from its own elements (no process group), as the spec states it."""
    n = ROWS * C
    p0 = torch.randn(n, generator=_gen(3))
    p = p0.clone().requires_grad_()
    opt = _opt(p, bits, backend, _column_rows())
    levels = _levels(bits)
    opt.state[p] = state.allocate(_column_rows(), [-P] * ROWS, levels, p.device)
    scale = torch.linspace(0.2, 2.0, ROWS).repeat_interleave(C)  # rows differ: the factor
    grads = [torch.randn(n, generator=_gen(20 + t)) * scale for t in range(5)]
    for g in grads:
        p.grad = g.clone()
        opt.step()
    want = spec.gefen(p0, grads, 1e-2, (0.9, 0.999), 1e-8, 0.1, -C, levels, 0, n)
    torch.testing.assert_close(p.detach(), want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("backend", ["reference", "native"])
def test_rows_of_a_column_piece_step_as_one_piece(bits, backend):
    check_column_rows(bits, backend)


@pytest.mark.triton
@pytest.mark.slow
def test_rows_of_a_column_piece_step_as_one_piece_on_triton():
    _on_triton("check_column_rows")


def test_a_column_piece_re_cut_from_the_whole_tensor_shares_the_mean_v_and_max_absmax():
    """A one-process state (one v and absmax per column over all rows) restored into row
    pieces: the run's v is the mean of its rows' restored v, absmax the max, the codes
    requantised to it; at the same layout the round trip is exact."""
    from gefen_dist.method import portable

    torch.manual_seed(0)
    whole = torch.randn(ROWS * P).requires_grad_()
    solo = Gefen([whole], lr=1e-2, bits=8)
    solo.backend = "native"
    solo.set_segments(whole, [Segment(0, ROWS * P, 0, (ROWS, P), "w")])
    solo.state[whole] = state.allocate(
        [Segment(0, ROWS * P, 0, (ROWS, P), "w")], [-P], _levels(8), whole.device
    )
    for t in range(3):
        whole.grad = torch.randn(ROWS * P, generator=_gen(t))
        solo.step()
    saved = portable.merge(portable.export(solo.state[whole], solo.segments_of(whole)))
    got = portable.install(saved, _column_rows(), torch.device("cpu"))
    full = solo.state[whole]
    torch.testing.assert_close(got["v"], full["v"][C0 : C0 + C])  # every row: the column's v
    assert torch.equal(got["absmax"], full["absmax"][C0 : C0 + C])
    again = portable.install(
        portable.merge(portable.export(got, _column_rows())), _column_rows(), torch.device("cpu")
    )
    for k in ("codes", "absmax", "v", "v_cross"):
        assert torch.equal(again[k], got[k]), k


def test_runs_saved_apart_merge_into_one_by_mean_v_and_max_absmax():
    """Rows saved as two runs (two dp ranks' rows, each with its own column v and absmax)
    restored as one: v the mean, absmax the max, and each row's m as it was, up to the
    requantisation of the rows whose absmax was lower (half a level spacing at most)."""
    from gefen_dist.method import portable

    half = ROWS // 2
    segs = _column_rows()
    parts, ms = [], []
    g = _gen(5)
    for lo in (0, half):
        mine = [Segment(s.offset - lo * C, s.numel, s.start, s.shape, s.name) for s in segs[lo:]]
        mine = mine[:half]
        st = state.allocate(mine, [-P] * half, _levels(8), torch.device("cpu"))
        st["v"].copy_(torch.rand(C, generator=g))
        st["absmax"].copy_(torch.rand(C, generator=g) + 0.5)
        st["codes"].copy_(torch.randint(0, 256, (half * C,), generator=g).to(torch.uint8))
        levels = st["codebook"]
        ms.append(levels[st["codes"].long()].view(half, C) * st["absmax"])
        parts += portable.export(st, mine)
        kept = st
    got = portable.install(portable.merge(parts), segs, torch.device("cpu"))
    vs = [p.v for p in portable.merge(parts)["w"].pieces]
    torch.testing.assert_close(got["v"], (vs[0] + vs[-1]) / 2)
    amax = torch.maximum(*(p.absmax for p in portable.merge(parts)["w"].pieces[::half]))
    assert torch.equal(got["absmax"], amax)
    m = kept["codebook"][got["codes"].long()].view(ROWS, C) * got["absmax"]
    spacing = (kept["codebook"][1:] - kept["codebook"][:-1]).max() * amax
    assert ((m - torch.cat(ms)).abs() <= spacing / 2 + 1e-6).all()
