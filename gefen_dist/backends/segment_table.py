"""The segment table the native backends take: one row per segment, rebuilt every step.

Why a table and not a call per segment: a step touches hundreds of tensors, and FSDP/ZeRO hand
each rank pieces of many tensors in one flat buffer. One row per segment (addresses, offsets,
block size, dtypes, this step's hyperparameters) lets one call on the CPU, or a few launches on
a GPU, cover every segment, and an lr schedule changes only numbers in rows. Rebuilt each step
because gradients may be new tensors (``zero_grad(set_to_none=True)``); a few hundred rows.

Columns are those of ``csrc/gefen_cpu.cpp``'s ``Meta`` and of ``hyper_row``.
"""

from __future__ import annotations

import torch

from ..method.codes import step_key
from ..method.hyper import Hyper
from ..method.state import CROSS_FLOOR, SegmentState

DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
BF16_SR = 3
"""The parameter dtype column of a bf16 parameter written with stochastic rounding
(``Hyper.bf16_stochastic_round``; ``codes.write_param``): the kernels draw its r from the step
key they are given (``codes.param_key``)."""
META_COLS = 19
HYP_COLS = 8
P_COL, G_COL, KEY_COL = 0, 1, 16  # what changes between two steps of the same tensors
FACTOR_COL, V_CROSS_COL = 17, 18


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
    """``factor``: this step's ``reference.cross_factor`` of the segment, or None; with
    ``v_cross`` (the CPU kernel only), the buffer the kernel writes it into from v_cross.
    ``stochastic``: ``bf16_stochastic_round``, which changes only a bf16 parameter's write."""
    blocked = st.block_size != 1
    pdt = BF16_SR if stochastic and p.dtype == torch.bfloat16 else DTYPES[p.dtype]
    return [
        p.data_ptr(),
        g.data_ptr(),
        st.codes.data_ptr() if blocked else 0,
        st.absmax.data_ptr() if blocked else 0,
        st.v.data_ptr() if blocked else 0,
        levels.data_ptr() if blocked else 0,
        mids.data_ptr() if blocked else 0,
        st.start,
        st.numel,
        st.block_size,
        bits,
        pdt,
        DTYPES[g.dtype],
        0 if blocked else st.exp_avg.data_ptr(),
        0 if blocked else st.exp_avg_sq.data_ptr(),
        levels.numel() if blocked else 0,
        step_key(step),
        0 if factor is None else factor.data_ptr(),
        0 if v_cross is None else v_cross.data_ptr(),
    ]


def hyper_row(h: Hyper) -> list[float]:
    """beta1, 1 - beta1, beta2, 1 - beta2, 1 - lr * wd, -lr / (1 - beta1^t), sqrt(1 - beta2^t),
    eps: computed in double here, rounded to fp32 once, as torch does with Python scalars."""
    return [
        h.beta1,
        1.0 - h.beta1,
        h.beta2,
        1.0 - h.beta2,
        1.0 - h.lr * h.weight_decay,
        -h.step_size,
        h.bc2_sqrt,
        h.eps,
    ]


def cross_hyper_row(h: Hyper) -> list[float]:
    """beta2, 1 - beta2, sqrt(1 - beta2^t), the factor's floor: a row of the factor pass, on
    either backend."""
    return [h.beta2, 1.0 - h.beta2, h.bc2_sqrt, CROSS_FLOOR]
