"""One definition of each table's columns: ``segment_table``'s enums, the C++ kernel's and the
Triton kernels' constants agree, and the rows the Python side builds put each value in its
named column."""

from __future__ import annotations

import pytest
import torch
from needs import extra

from gefen_dist.backends import native_cpu, segment_table
from gefen_dist.backends.segment_table import (
    TABLES,
    Cross,
    CrossHyp,
    DType,
    Hyp,
    Meta,
)
from gefen_dist.method.hyper import Hyper
from gefen_dist.method.state import CROSS_FLOOR, SegmentState

pytestmark = pytest.mark.unit

TRITON_PREFIX = {
    "Meta": "M",
    "Hyp": "H",
    "Aux": "A",
    "Cross": "X",
    "CrossHyp": "XH",
    "DType": "DT",
    "Hist": "HI",
    "HistAmax": "HA",
}
"""The prefix of each table's constexprs in ``triton_kernels`` (``M_P`` is ``Meta.P``)."""


def test_every_enum_numbers_its_columns_from_zero_without_gaps():
    """A row is a flat list: column k is the k-th member, so the values are 0..n-1 in order."""
    for name, enum in TABLES.items():
        assert [int(c) for c in enum] == list(range(len(enum))), name
        assert enum.__name__ == name


def test_the_cpp_kernel_declares_the_same_columns():
    """``gefen_cpu_tables`` lists the X-macros that make the C++ enums: every table the C++
    kernel reads, with Python's names in Python's order (so an edit of either side alone
    fails here)."""
    if not native_cpu.available():
        pytest.fail(f"the C++ kernel did not build: {native_cpu.build_error()}", pytrace=False)
    cpp = native_cpu.tables()
    assert set(cpp) == {"DType", "Meta", "Hyp", "Cross", "CrossHyp"}, sorted(cpp)
    for name, columns in cpp.items():
        assert columns == [c.name for c in TABLES[name]], name


def test_the_triton_kernels_constants_are_the_enums():
    """Every column of every table has its constexpr in ``triton_kernels`` with the enum's
    value, every table its width, and no constant with a table's prefix names a column the
    enum lacks."""
    extra("triton.language")
    from gefen_dist.backends import triton_backend, triton_kernels

    for name, enum in TABLES.items():
        pre = TRITON_PREFIX[name] + "_"
        want = {pre + c.name: int(c) for c in enum}
        if name != "DType":
            want[pre + "COLS"] = len(enum)
        got = {
            k: getattr(triton_kernels, k).value
            for k in dir(triton_kernels)
            if k.startswith(pre) and k[len(pre) :].isupper()
        }
        # a longer prefix of another table (XH_ under X_, HI_ / HA_ under H_) is not this one's
        others = [p + "_" for p in TRITON_PREFIX.values() if p + "_" != pre and p.startswith(pre)]
        got = {k: v for k, v in got.items() if not any(k.startswith(o) for o in others)}
        assert got == want, name
    assert triton_backend.META_COLS == len(Meta)
    assert triton_backend.CROSS_META_COLS == len(Cross)


def _segment(blocked: bool) -> tuple[SegmentState, torch.Tensor, torch.Tensor]:
    if blocked:
        st = SegmentState(
            3,
            40,
            16,
            codes=torch.zeros(20, dtype=torch.uint8),
            absmax=torch.zeros(3),
            v=torch.zeros(3),
            v_cross=torch.zeros(16),
        )
    else:
        bf16 = dict(dtype=torch.bfloat16)
        st = SegmentState(
            0, 40, 1, exp_avg=torch.zeros(40, **bf16), exp_avg_sq=torch.zeros(40, **bf16)
        )
    return st, torch.linspace(-1, 1, 16), torch.linspace(-1, 1, 15)


def test_a_row_puts_each_value_in_its_named_column():
    st, levels, mids = _segment(blocked=True)
    p, g = torch.zeros(40, dtype=torch.bfloat16), torch.zeros(40, dtype=torch.float16)
    factor = torch.zeros(16)
    row = segment_table.row(p, g, st, levels, mids, 4, 7, factor, st.v_cross, stochastic=True)
    assert len(row) == len(Meta)
    want = {
        Meta.P: p.data_ptr(),
        Meta.G: g.data_ptr(),
        Meta.CODES: st.codes.data_ptr(),
        Meta.ABSMAX: st.absmax.data_ptr(),
        Meta.V: st.v.data_ptr(),
        Meta.LEVELS: levels.data_ptr(),
        Meta.MIDS: mids.data_ptr(),
        Meta.START: 3,
        Meta.NUMEL: 40,
        Meta.BLOCK: 16,
        Meta.BITS: 4,
        Meta.P_DTYPE: DType.BF16_SR,
        Meta.G_DTYPE: DType.F16,
        Meta.EXP_AVG: 0,
        Meta.EXP_AVG_SQ: 0,
        Meta.N_LEVELS: 16,
        Meta.FACTOR: factor.data_ptr(),
        Meta.V_CROSS: st.v_cross.data_ptr(),
    }
    for col, value in want.items():
        assert row[col] == value, col.name
    dense, _, _ = _segment(blocked=False)
    row = segment_table.row(p, g, dense, levels, mids, 8, 7)
    assert row[Meta.P_DTYPE] == DType.BF16 and row[Meta.EXP_AVG] == dense.exp_avg.data_ptr()
    assert row[Meta.CODES] == 0 and row[Meta.FACTOR] == 0 and row[Meta.V_CROSS] == 0


def test_hyper_rows_name_their_values():
    h = Hyper(lr=1e-3, beta1=0.8, beta2=0.95, eps=1e-7, weight_decay=0.1, step=3)
    row = segment_table.hyper_row(h)
    assert len(row) == len(Hyp)
    assert row[Hyp.BETA1] == 0.8 and row[Hyp.W] == 1.0 - 0.8
    assert row[Hyp.BETA2] == 0.95 and row[Hyp.A2] == 1.0 - 0.95
    assert row[Hyp.DECAY] == 1.0 - 1e-3 * 0.1 and row[Hyp.EPS] == 1e-7
    assert row[Hyp.NEG_STEP] == -h.step_size and row[Hyp.BC2] == h.bc2_sqrt
    cross = segment_table.cross_hyper_row(h)
    assert len(cross) == len(CrossHyp)
    assert cross[CrossHyp.BETA2] == 0.95 and cross[CrossHyp.A2] == 1.0 - 0.95
    assert cross[CrossHyp.BC2] == h.bc2_sqrt and cross[CrossHyp.FLOOR] == CROSS_FLOOR


def test_a_cross_row_and_a_missing_column():
    st, _, _ = _segment(blocked=True)
    g = torch.zeros(40)
    row = segment_table.cross_row(g, st, sums=11, counts=12, out=13, v=14, part=15, chunks=16)
    assert len(row) == len(Cross)
    assert row[Cross.G] == g.data_ptr() and row[Cross.G_DTYPE] == DType.F32
    assert (row[Cross.START], row[Cross.NUMEL], row[Cross.BLOCK]) == (3, 40, 16)
    assert row[Cross.LENGTH] == 16 and row[Cross.V_CROSS] == st.v_cross.data_ptr()
    assert [row[c] for c in (Cross.SUMS, Cross.COUNTS, Cross.OUT, Cross.V)] == [11, 12, 13, 14]
    assert (row[Cross.PART], row[Cross.CHUNKS]) == (15, 16)
    factor_only = segment_table.cross_row(None, st, 1, 2, 3)
    assert factor_only[Cross.G] == 0 and factor_only[Cross.NUMEL] == 0
    with pytest.raises(ValueError, match=r"Hyp row lacks columns \['EPS'\]"):
        segment_table.as_row({c: 0.0 for c in Hyp if c != Hyp.EPS}, Hyp)
