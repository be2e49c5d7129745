"""The CUDA backend (``csrc/gefen_cuda.cu``): JIT-built with torch's cpp_extension, cached.

Why a segment table: a step touches hundreds of tensors, and FSDP/ZeRO hand each rank pieces of
many tensors in one flat buffer; one row per segment (pointers, offsets, block size, dtypes, the
step's hyperparameters) lets three launches cover every segment of a step, whatever the model,
and an lr schedule changes only a row's numbers, never the kernels.

The build needs ninja, nvcc and a CUDA build of torch; it goes to ``$GEFEN_CACHE_DIR``
(default ``~/.cache/gefen_dist``) keyed by the sources, torch's version and the device's
architecture, so a second process loads it in a second. When it cannot be built, or its
self-check against the reference fails on a device (``_verified``), ``available(device)`` is
False and ``build_error()`` says why; Gefen then runs the reference update and says so once.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import torch

from . import segment_table as table
from .reference import Hyper, SegmentState, local_factor
from .segments import num_blocks

CSRC = Path(__file__).resolve().parent.parent / "csrc"
SOURCES = [CSRC / "gefen_cuda_binding.cpp", CSRC / "gefen_cuda.cu"]
HEADERS = [CSRC / "gefen_cuda.h"]
CUDA_FLAGS = ["-O3", "--fmad=false"]
WIDE = 1024
"""Blocks of at least this many elements get a whole thread block (256 threads), shorter ones
a warp: a warp alone would leave most of a long block's bandwidth unused, a thread block on a
short one would idle most of its threads."""
DTYPES = table.DTYPES

_ext: Any = None
_error: str | None = None


def _build() -> Any:
    if not torch.cuda.is_available():
        raise RuntimeError("CUDA is not available")
    if torch.version.cuda is None:
        raise RuntimeError("this torch is a CPU build")
    missing = [str(p) for p in SOURCES + HEADERS if not p.exists()]
    if missing:
        raise RuntimeError(f"sources not found: {missing} (an install without csrc/)")
    from torch.utils.cpp_extension import load

    major, minor = torch.cuda.get_device_capability()
    h = hashlib.sha256()
    for p in SOURCES + HEADERS:
        h.update(p.read_bytes())
    h.update(f"{torch.__version__} {torch.version.cuda} sm_{major}{minor} {CUDA_FLAGS}".encode())
    cache = Path(os.environ.get("GEFEN_CACHE_DIR", Path.home() / ".cache" / "gefen_dist"))
    build = cache / f"cuda_{h.hexdigest()[:16]}"
    build.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", f"{major}.{minor}")
    return load(
        name="gefen_cuda_ext",
        sources=[str(p) for p in SOURCES],
        extra_cflags=["-O3"],
        extra_cuda_cflags=CUDA_FLAGS,
        extra_include_paths=[str(CSRC)],
        build_directory=str(build),
        verbose=False,
    )


def load() -> Any:
    """The extension, built on first call; None (and ``build_error()``) when it cannot be."""
    global _ext, _error
    if _ext is None and _error is None:
        try:
            _ext = _build()
        except Exception as e:  # any failure leaves the reference update in charge
            _error = f"{type(e).__name__}: {e}"
    return _ext


def available(device: torch.device | None = None) -> bool:
    """Built, and (with ``device``) passed the self-check on that device."""
    if load() is None:
        return False
    return device is None or _verified(device)


_checked: dict[str, bool] = {}


def _verified(device: torch.device) -> bool:
    """Run the kernels once per device on a small awkward layout against the reference
    (4-bit blocks of odd length from an odd start, so bytes are shared; 8-bit; B = 1; bf16).
    Why: a kernel that miscompiles or misbehaves on a device must not corrupt a training run;
    on a mismatch the reference update runs instead and ``build_error()`` says why."""
    global _error
    key = str(device)
    if key not in _checked:
        try:
            _self_check(device)
            _checked[key] = True
        except Exception as e:
            _error = f"self-check on {key} failed: {type(e).__name__}: {e}"
            _checked[key] = False
    return _checked[key]


def _self_check(device: torch.device) -> None:
    from . import codebook as cb
    from .codes import midpoints
    from .reference import block_update, column_update, cross_length, dense_update

    gen = torch.Generator().manual_seed(0)
    for bits, dtype, start, numel, block in [
        (4, torch.float32, 37, 4001, 97),
        (8, torch.bfloat16, 0, 3000, 1000),
        (4, torch.float32, 0, 777, 1),
        (4, torch.float32, 37, 4001, -97),
        (8, torch.float16, 5, 9000, -300),
    ]:
        levels = cb.learn_codebook(cb.histogram(torch.rand(4096, generator=gen) * 2 - 1), bits)
        levels, mids = levels.to(device), midpoints(levels).to(device)
        p0 = torch.randn(numel, generator=gen).to(device, dtype)
        sts, ps = [], []
        for _ in range(2):
            nb = num_blocks(start, numel, block)
            st = SegmentState(start, numel, block)
            if block == 1:
                st.exp_avg = torch.zeros(numel, dtype=torch.bfloat16, device=device)
                st.exp_avg_sq = torch.zeros(numel, dtype=torch.bfloat16, device=device)
            else:
                st.codes = torch.zeros(
                    numel if bits == 8 else (numel + 1) // 2, dtype=torch.uint8, device=device
                )
                st.absmax = torch.zeros(nb, device=device)
                st.v = torch.zeros(nb, device=device)
                st.v_cross = torch.zeros(cross_length(block, start + numel), device=device)
            sts.append(st)
            ps.append(p0.clone())
        for t in range(1, 4):
            g = torch.randn(numel, generator=gen).to(device, dtype)
            h = Hyper(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, step=t)
            if block == 1:
                dense_update(ps[0], g, sts[0], h)
            elif block < 0:
                column_update(ps[0], g, sts[0], h, levels, mids, bits)
            else:
                block_update(ps[0], g, sts[0], h, levels, mids, bits)
            step([(ps[1], g, sts[1], h, levels, mids, bits)])
        torch.cuda.synchronize(device)
        tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
        err = ((ps[1].float() - ps[0].float()).abs() / ps[0].float().abs().clamp_min(1e-3)).max()
        if not err <= tol:
            raise RuntimeError(f"parameters differ by {err.item():.3g} (bits={bits}, B={block})")
        pairs = [("v", 1e-5), ("absmax", 1e-5), ("v_cross", 1e-5)]
        # bf16 B = 1 state: an fp32 result an ulp apart may carry differently (one bf16 ulp)
        pairs = pairs if block != 1 else [("exp_avg", 1e-2), ("exp_avg_sq", 1e-2)]
        for k, rtol in pairs:
            a, b = getattr(sts[1], k).float(), getattr(sts[0], k).float()
            floor = 1e-6 * b.abs().max() if block == 1 else 1e-30  # m where a lerp cancels
            if not ((a - b).abs() <= rtol * b.abs() + floor).all():
                raise RuntimeError(f"{k} differs (bits={bits}, B={block})")


def build_error() -> str | None:
    load()
    return _error


def supports(p: torch.Tensor, g: torch.Tensor) -> bool:
    return p.device.type == "cuda" and p.dtype in DTYPES and g.dtype in DTYPES


def _table(rows, hyps, counts, device):
    prefix = [0]
    for c in counts:
        prefix.append(prefix[-1] + c)
    meta = torch.tensor(rows, dtype=torch.int64).pin_memory().to(device, non_blocking=True)
    hyp = torch.tensor(hyps, dtype=torch.float32).pin_memory().to(device, non_blocking=True)
    pre = torch.tensor(prefix, dtype=torch.int64).pin_memory().to(device, non_blocking=True)
    return meta, hyp, pre, prefix[-1]


def step(work: list[tuple]) -> None:
    """Run every (p, g, segment views, Hyper, levels, mids, bits[, factor]) of one device: three
    launches for all blocked and B = 1 segments, then three per column segment. Flat 1-D
    contiguous views; the optimizer guarantees it. ``factor`` as ``native_cpu.step``'s."""
    ext = load()
    if not work:
        return
    device = work[0][0].device
    stream = torch.cuda.current_stream(device).cuda_stream
    groups: dict[str, tuple[list, list, list]] = {
        "narrow": ([], [], []),
        "wide": ([], [], []),
        "dense": ([], [], []),
    }
    tile = ext.DENSE_TILE
    columns = []
    factors = []  # this step's cross factors, alive until the launches are queued
    for p, g, st, h, levels, mids, bits, *given in work:
        if st.numel == 0:
            continue
        if p.device != device or g.device != device:
            raise ValueError("Gefen's CUDA step got tensors on several devices in one call")
        f = given[0] if given else local_factor(g, st, h)
        if st.block_size < 0:
            columns.append((p, g, st, h, levels, mids, bits, f))
            continue
        if st.block_size == 1:
            key, count = "dense", -(-st.numel // tile)
        else:
            key = "wide" if st.block_size >= WIDE else "narrow"
            count = num_blocks(st.start, st.numel, st.block_size)
        rows, hyps, counts = groups[key]
        rows.append(table.row(p, g, st, levels, mids, bits, h.step, f))
        factors.append(f)
        hyps.append(table.hyper_row(h))
        counts.append(count)
    with torch.cuda.device(device):
        for key, (rows, hyps, counts) in groups.items():
            if not rows:
                continue
            meta, hyp, pre, total = _table(rows, hyps, counts, device)
            if key == "dense":
                ext.dense(meta, hyp, pre, total, stream)
            else:
                ext.blocks(meta, hyp, pre, total, 256 if key == "wide" else 32, stream)
    for w in columns:
        _column_step(ext, *w)


COLUMN_ROWS = 32
"""Rows per thread in a column segment's reduction pass, with at most 128 chunks of rows and
64 MiB of partial sums and maxima (12 bytes per column and chunk): enough threads to fill the
device on a tall tensor, a bounded transient on a wide one."""


def _column_step(
    ext: Any,
    p: torch.Tensor,
    g: torch.Tensor,
    st: SegmentState,
    h: Hyper,
    levels: torch.Tensor,
    mids: torch.Tensor,
    bits: int,
    f: torch.Tensor | None,
) -> None:
    """One column segment (``st.block_size`` = -P), as ``reference.column_update``."""
    period = -st.block_size
    nb = min(st.numel, period)
    rows = -(-st.numel // period)
    chunks = max(1, min(128, -(-rows // COLUMN_ROWS), (64 << 20) // (12 * nb)))
    per_chunk = -(-rows // chunks)
    chunks = -(-rows // per_chunk)
    device = p.device
    with torch.cuda.device(device):
        meta, hyp, _, _ = _table(
            [table.row(p, g, st, levels, mids, bits, h.step, f)], [table.hyper_row(h)], [0], device
        )
        part_sum = torch.empty(chunks * nb, dtype=torch.float64, device=device)
        part_max = torch.empty(chunks * nb, dtype=torch.float32, device=device)
        denom = torch.empty(nb, dtype=torch.float32, device=device)
        amax_new = torch.empty(nb, dtype=torch.float32, device=device)
        stream = torch.cuda.current_stream(device).cuda_stream
        ext.columns(
            meta,
            hyp,
            st.numel,
            period,
            per_chunk,
            part_sum,
            part_max,
            denom,
            amax_new,
            st.absmax,
            bits,
            stream,
        )


def histogram(
    g: torch.Tensor,
    start: int,
    block: int,
    head_amax: float,
    tail_amax: float,
    counts: torch.Tensor,
) -> None:
    """Add one segment's g / absmax(block) to int64 ``counts`` (on g's device), binned as
    ``codebook.histogram``; ``head_amax`` / ``tail_amax`` (or -1) replace the absmax of a cut
    first / last block with the whole block's."""
    ext = load()
    with torch.cuda.device(g.device):
        stream = torch.cuda.current_stream(g.device).cuda_stream
        ext.histogram(g, start, block, head_amax, tail_amax, counts, stream)
