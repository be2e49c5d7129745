"""What checks the Triton kernels, apart from the kernels' host side (``triton_backend``): the
compiled variants the launchers can select (``variants``), their PTX compiled without a GPU
(``compile_ptx``), and the bounds within which one step of the kernels must match the reference
(``agree``). Used by ``tests/test_triton_backend.py`` and ``launch/gpu_items.py`` (the GPU
check, ``launch/gpu_check.py``); no step of the optimizer imports it.
"""

from __future__ import annotations

import torch

from ..method.codes import unpack4
from ..method.state import SegmentState
from .triton_backend import (
    COL_FINISH,
    COL_TILE,
    CROSS_COLS,
    CROSS_FINISH,
    CROSS_TILE,
    FACTOR_TILE,
    LAUNCH,
    TILE,
    WIDTHS,
    _kernels,
    _mode,
)

# ------------------------------------------------------------------ compiled, without a GPU


def variants() -> list[tuple[str, dict[str, str], dict[str, int]]]:
    """Every (kernel, signature, constexprs) the launchers use: the compiled variants there can
    be (their keys as in ``SIGNATURES``), whatever the model or the schedule."""
    i64, f32, f64, n = "*i64", "*fp32", "*fp64", "i32"
    step = {"ints": i64, "floats": f32, "meta_at": n, "hyp_at": n}
    rows = {**step, "aux_at": n, "prefix_at": n, "n_rows": n}
    scr = {"scr_amax": f32, "scr_den": f32, "scr_keep": f32}
    part = {"part_sum": f64, "part_max": f32, "part_m2": f64, "part_f2": f64}
    cross = {"ints": i64, "meta_at": n, "prefix_at": n, "n_rows": n}
    out = [("dense_kernel", {**step, "prefix_at": n, "n_rows": n}, {"TILE": TILE})]
    out += [("block_reduce_kernel", {**rows, **scr}, {"R": r, "W": w}) for w, r in WIDTHS]
    out += [
        ("col_reduce_kernel", {**rows, **part}, {"RB": COL_TILE[0], "CB": COL_TILE[1]}),
        ("col_finish_kernel", {**rows, **part, **scr}, {"CB": COL_FINISH}),
        ("apply_kernel", {**rows, **scr}, {"TILE": TILE}),
        (
            "commit_kernel",
            {"ints": i64, "meta_at": n, "aux_at": n, "prefix_at": n, "n_rows": n, "scr_amax": f32},
            {"TILE": TILE},
        ),
        ("cross_rows_kernel", {**cross, "part": f64}, {"RB": CROSS_TILE[0], "CB": CROSS_TILE[1]}),
        ("cross_finish_kernel", {**cross, "part": f64}, {"CB": CROSS_FINISH}),
        ("cross_cols_kernel", cross, {"GR": CROSS_COLS[0], "CW": CROSS_COLS[1]}),
        ("cross_factor_kernel", step, {"TILE": FACTOR_TILE}),
        ("histogram_kernel", {"ints": i64, "floats": f32}, {"TILE": TILE}),
    ]
    return out


def compile_ptx(arch: int = 90) -> dict[tuple, str]:
    """Compile every variant (``variants``) for CUDA sm_``arch`` with the launch options, no GPU
    needed (triton's own ptxas): the PTX per ``SIGNATURES`` key. Not under the interpreter."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    k = _kernels()
    if k is None or _mode(k) != "compiled":
        raise RuntimeError("compile_ptx needs triton's compiler, not TRITON_INTERPRET=1")
    out = {}
    for name, sig, const in variants():
        src = ASTSource(
            fn=getattr(k, name),
            signature={**sig, **{c: "constexpr" for c in const}},
            constexprs=const,
        )
        done = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(LAUNCH))
        out[(name, tuple(sorted(const.items())))] = done.asm["ptx"]
    return out


# ------------------------------------------------------------------------------- agreement

STATE_FIELDS = ("codes", "absmax", "v", "v_cross", "exp_avg", "exp_avg_sq")
PARAM_RTOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
"""How far a kernel's parameters may sit from the reference's after one step, relative to the
step's operands, by parameter dtype (``agree``)."""


def agree(
    p: torch.Tensor,
    st: SegmentState,
    p_ref: torch.Tensor,
    st_ref: SegmentState,
    before: torch.Tensor,
    bits: int,
    what: str,
) -> None:
    """Raise unless one step of the kernel (``p``, ``st``) matches the reference's from the same
    state (the CUDA backend's, moved here unchanged). The reference runs torch's kernels, which
    contract multiply-adds (and on this CPU's torch take a square root that is not correctly
    rounded) where these kernels do neither, so an fp32 result can sit an ulp away, and a code
    flips where m / absmax lies within that ulp of a midpoint or of its stochastic threshold:
    rare, but over thousands of elements not negligible. At most one code in 500 may differ,
    each by one level; a wrong kernel differs in whole blocks, in the bytes blocks share, or
    everywhere. Everything else within its tolerance, the parameters relative to the step's
    operands (``before``, the parameter before the step), as where a step nearly cancels p an
    ulp of the step is far more of the result."""
    tol = PARAM_RTOL[p.dtype]
    scale = torch.maximum(before.float().abs(), p_ref.float().abs()).clamp_min(1e-3)
    err = ((p.float() - p_ref.float()).abs() / scale).max()
    if not err <= tol:
        raise RuntimeError(f"parameters differ by {float(err):.3g} ({what})")
    dense = st.exp_avg is not None and st.exp_avg.numel() > 0
    if dense:  # bf16 B = 1 state: an fp32 result an ulp apart may carry differently (a bf16 ulp)
        pairs = [("exp_avg", 1e-2), ("exp_avg_sq", 1e-2)]
    else:
        pairs = [("v", 1e-5), ("absmax", 1e-5), ("v_cross", 1e-5)]
    for k, rtol in pairs:
        a, b = getattr(st, k).float(), getattr(st_ref, k).float()
        floor = 1e-6 * b.abs().max() if dense else 1e-30  # m where a lerp cancels
        if not ((a - b).abs() <= rtol * b.abs() + floor).all():
            raise RuntimeError(f"{k} differs ({what})")
    if not dense:
        mine, ref = st.codes, st_ref.codes
        if bits == 4:
            mine, ref = unpack4(mine, st.numel), unpack4(ref, st.numel)
        d = (mine.long() - ref.long()).abs()
        flipped = int((d > 0).sum())
        if flipped > st.numel // 500 or (flipped and int(d.max()) > 1):
            raise RuntimeError(
                f"{flipped} of {st.numel} codes differ, by up to {int(d.max())} levels ({what})"
            )
