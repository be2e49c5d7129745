"""The tables the native backends take: one row per segment, rebuilt every step.

Why a table and not a call per segment: a step touches hundreds of tensors, and FSDP/ZeRO hand
each rank pieces of many tensors in one flat buffer. One row per segment (addresses, offsets,
block size, dtypes, this step's hyperparameters) lets one call on the CPU, or a few launches on
a GPU, cover every segment, and an lr schedule changes only numbers in rows. Rebuilt each step
because gradients may be new tensors (``zero_grad(set_to_none=True)``); a few hundred rows.

Every table's columns are named once, here, by an ``IntEnum`` whose values are the column
indices: ``Meta`` (the update's integers), ``Hyp`` (its fp32 hyperparameters), ``Cross`` and
``CrossHyp`` (the factor pass's), ``Aux`` (the Triton update's extra integers per blocked or
column segment), ``Hist`` and ``HistAmax`` (the Triton codebook histogram's) and ``DType`` (the
dtype codes in them). The C++ kernel
(``csrc/gefen_cpu.cpp``) declares the same names in the same order and lists them through
``gefen_cpu_tables`` (``native_cpu.tables``); the Triton kernels take their constexpr column
indices from these enums; ``tests/test_tables.py`` holds all three to one another.
"""

from __future__ import annotations

from enum import IntEnum

import torch

from ..method.codes import step_key
from ..method.hyper import Hyper
from ..method.state import CROSS_FLOOR, SegmentState


class DType(IntEnum):
    """The dtype code of a tensor in a table."""

    F32 = 0
    BF16 = 1
    F16 = 2
    BF16_SR = 3
    """A bf16 parameter written with stochastic rounding (``Hyper.bf16_stochastic_round``;
    ``codes.write_param``): the kernels draw its r from the step key they are given
    (``codes.param_key``). Never a gradient's."""


DTYPES = {torch.float32: DType.F32, torch.bfloat16: DType.BF16, torch.float16: DType.F16}
"""The code of each dtype the kernels take (``DType.BF16_SR`` is chosen per row)."""


class Meta(IntEnum):
    """The update's integer row of one segment (``row``): addresses as integers (0: none)."""

    P = 0
    """The parameter's piece (flat, contiguous)."""
    G = 1
    """The gradient's piece."""
    CODES = 2
    """m's codes (blocked segments)."""
    ABSMAX = 3
    """m's per-block absmax (fp32)."""
    V = 4
    """The per-block v (fp32)."""
    LEVELS = 5
    """The codebook (fp32)."""
    MIDS = 6
    """The codebook's midpoints (fp32)."""
    START = 7
    """The segment's first element in its tensor."""
    NUMEL = 8
    BLOCK = 9
    """Block size: B > 1 contiguous, -P columns of period P, 1 dense (no blocks)."""
    BITS = 10
    P_DTYPE = 11
    """``DType`` of the parameter (``BF16_SR`` for stochastic rounding)."""
    G_DTYPE = 12
    EXP_AVG = 13
    """m of a B = 1 segment (bf16)."""
    EXP_AVG_SQ = 14
    """v of a B = 1 segment (bf16)."""
    N_LEVELS = 15
    STEP_KEY = 16
    """``codes.step_key`` of this step."""
    FACTOR = 17
    """This step's cross factor (fp32), or 0 for none."""
    V_CROSS = 18
    """The C++ kernel only: the v_cross it computes ``FACTOR`` from and folds (``fuses``)."""


class Hyp(IntEnum):
    """The update's fp32 row (``hyper_row``), one per (group, step): computed in double,
    rounded to fp32 once, as torch does with Python scalars."""

    BETA1 = 0
    W = 1
    """1 - beta1: lerp's weight."""
    BETA2 = 2
    A2 = 3
    """1 - beta2."""
    DECAY = 4
    """1 - lr * weight_decay."""
    NEG_STEP = 5
    """-lr / (1 - beta1^t)."""
    BC2 = 6
    """sqrt(1 - beta2^t)."""
    EPS = 7
    BC1 = 8
    """1 - beta1^t."""
    G_FLOOR = 9
    """sqrt(1 - beta2) / sqrt(1 - beta2^t): AdamW's floor on the denominator per |g|."""


class Cross(IntEnum):
    """The factor pass's integer row of one factored segment, the same on both backends (each
    leaves the columns it does not read 0)."""

    G = 0
    G_DTYPE = 1
    START = 2
    NUMEL = 3
    BLOCK = 4
    LENGTH = 5
    """Entries of v_cross."""
    V = 6
    """The C++ kernel: the block v its sums pass folds this step's g^2 into, or 0."""
    SUMS = 7
    """fp64 sums of g^2 per v_cross entry, written by the pass."""
    COUNTS = 8
    """fp64 counts of the elements behind each sum."""
    V_CROSS = 9
    OUT = 10
    """Where the factor goes (a tensor held whole), or 0: sums only."""
    PART = 11
    """Triton: the row's first partial sum in the pass's scratch."""
    CHUNKS = 12
    """Triton: chunks of tensor rows (contiguous blocks)."""


class CrossHyp(IntEnum):
    """The factor pass's fp32 row (``cross_hyper_row``)."""

    BETA2 = 0
    A2 = 1
    BC2 = 2
    FLOOR = 3
    """``state.CROSS_FLOOR``."""


class Aux(IntEnum):
    """The Triton update's extra integers per blocked or column segment
    (``triton_backend.step_plan``)."""

    SCR = 0
    """The first block's slot in the per-block scratch (new absmax, denominator)."""
    PART = 1
    """Columns: the first partial in the partial sums and maxima (chunks x columns)."""
    CHUNKS = 2
    """Columns: chunks of rows."""
    PER = 3
    """Columns: rows per chunk."""
    NB = 4
    """Blocks of the segment (columns: min(numel, P))."""


class Hist(IntEnum):
    """The Triton codebook histogram's integers (one segment: ``triton_backend.histogram``)."""

    G = 0
    G_DTYPE = 1
    START = 2
    NUMEL = 3
    BLOCK = 4
    BLOCKS = 5
    BINS = 6
    COUNTS = 7
    """int64 counts, one per bin."""


class HistAmax(IntEnum):
    """The histogram's fp32 row: the whole block's absmax of a cut first / last block, or -1."""

    HEAD = 0
    TAIL = 1


TABLES: dict[str, type[IntEnum]] = {
    e.__name__: e for e in (DType, Meta, Hyp, Cross, CrossHyp, Aux, Hist, HistAmax)
}
"""Every table's enum by name, as ``native_cpu.tables`` and ``triton_kernels`` name them."""


def as_row(values: dict[IntEnum, int | float], columns: type[IntEnum]) -> list:
    """``values`` in the column order of ``columns``, every column given."""
    if len(values) != len(columns):
        missing = [c.name for c in columns if c not in values]
        raise ValueError(f"{columns.__name__} row lacks columns {missing}")
    return [values[c] for c in columns]


def row(
    p: torch.Tensor,
    g: torch.Tensor,
    st: SegmentState,
    levels: torch.Tensor,
    mids: torch.Tensor,
    bits: int,
    step: int,
    factor: torch.Tensor | None = None,
    v_cross: torch.Tensor | None = None,
    stochastic: bool = False,
) -> list[int]:
    """The ``Meta`` row of a segment. ``factor``: this step's ``reference.cross_factor`` of the
    segment, or None; with ``v_cross`` (the C++ kernel only), the buffer the kernel writes it
    into from v_cross. ``stochastic``: ``bf16_stochastic_round``, which changes only a bf16
    parameter's write."""
    blocked = st.block_size != 1
    pdt = DType.BF16_SR if stochastic and p.dtype == torch.bfloat16 else DTYPES[p.dtype]
    return as_row(
        {
            Meta.P: p.data_ptr(),
            Meta.G: g.data_ptr(),
            Meta.CODES: st.codes.data_ptr() if blocked else 0,
            Meta.ABSMAX: st.absmax.data_ptr() if blocked else 0,
            Meta.V: st.v.data_ptr() if blocked else 0,
            Meta.LEVELS: levels.data_ptr() if blocked else 0,
            Meta.MIDS: mids.data_ptr() if blocked else 0,
            Meta.START: st.start,
            Meta.NUMEL: st.numel,
            Meta.BLOCK: st.block_size,
            Meta.BITS: bits,
            Meta.P_DTYPE: pdt,
            Meta.G_DTYPE: DTYPES[g.dtype],
            Meta.EXP_AVG: 0 if blocked else st.exp_avg.data_ptr(),
            Meta.EXP_AVG_SQ: 0 if blocked else st.exp_avg_sq.data_ptr(),
            Meta.N_LEVELS: levels.numel() if blocked else 0,
            Meta.STEP_KEY: step_key(step),
            Meta.FACTOR: 0 if factor is None else factor.data_ptr(),
            Meta.V_CROSS: 0 if v_cross is None else v_cross.data_ptr(),
        },
        Meta,
    )


def cross_row(
    g: torch.Tensor | None,
    st: SegmentState,
    sums: int,
    counts: int,
    out: int,
    v: int = 0,
    part: int = 0,
    chunks: int = 0,
) -> list[int]:
    """The ``Cross`` row of a factored segment; ``sums``, ``counts``, ``out`` (0: sums only),
    ``v`` (C++: the block v to fold into, or 0) are addresses, as a caller that cuts one buffer
    into many rows has them without a slice per row. ``g`` None: a factor row from sums already
    taken (``triton_backend.factors``): no g, no elements. ``part``, ``chunks``: Triton's
    partial sums."""
    return as_row(
        {
            Cross.G: 0 if g is None else g.data_ptr(),
            Cross.G_DTYPE: 0 if g is None else DTYPES[g.dtype],
            Cross.START: st.start,
            Cross.NUMEL: 0 if g is None else g.numel(),
            Cross.BLOCK: st.block_size,
            Cross.LENGTH: st.v_cross.numel(),
            Cross.V: v,
            Cross.SUMS: sums,
            Cross.COUNTS: counts,
            Cross.V_CROSS: st.v_cross.data_ptr(),
            Cross.OUT: out,
            Cross.PART: part,
            Cross.CHUNKS: chunks,
        },
        Cross,
    )


def hyper_row(h: Hyper) -> list[float]:
    """The ``Hyp`` row of ``h``: computed in double here, rounded to fp32 once (by the table's
    array), as torch does with Python scalars."""
    return as_row(
        {
            Hyp.BETA1: h.beta1,
            Hyp.W: 1.0 - h.beta1,
            Hyp.BETA2: h.beta2,
            Hyp.A2: 1.0 - h.beta2,
            Hyp.DECAY: 1.0 - h.lr * h.weight_decay,
            Hyp.NEG_STEP: -h.step_size,
            Hyp.BC2: h.bc2_sqrt,
            Hyp.EPS: h.eps,
            Hyp.BC1: h.bc1,
            Hyp.G_FLOOR: h.g_floor,
        },
        Hyp,
    )


def cross_hyper_row(h: Hyper) -> list[float]:
    """The ``CrossHyp`` row of ``h``: a row of the factor pass, on either backend."""
    return as_row(
        {
            CrossHyp.BETA2: h.beta2,
            CrossHyp.A2: 1.0 - h.beta2,
            CrossHyp.BC2: h.bc2_sqrt,
            CrossHyp.FLOOR: CROSS_FLOOR,
        },
        CrossHyp,
    )
