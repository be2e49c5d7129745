"""The C++ CPU backend (``csrc/gefen_cpu.cpp``): built on first use, loaded with ctypes.

Why C++: its loops vectorise (the 4-bit midpoint count, the byte-pair decode) and one call
covers a whole step; on the demo GPT it steps 34-59x faster than the reference, where a numba
port managed 1.6-1.9x and was retired (``benchmarks/backend_speed.py``). Where no compiler is
found the reference serves. Why ctypes: the library
has a plain C ABI, so it builds in a few seconds with the system's C++ compiler, without torch's
headers, and one build serves every torch version.

The source is the wheel's copy, ``gefen_dist/_csrc/`` (setup.py puts it there: ``csrc/`` sits
outside the package), else a checkout's or an editable install's ``csrc/``, so an edit there
takes effect with no reinstall. The build goes to ``$GEFEN_CACHE_DIR`` (default
``~/.cache/gefen_dist``), keyed by the source's bytes (not its path: a wheel and a checkout of
the same source share a build), the compiler, the flags and the CPU, so a changed source or
another machine rebuilds and a rebuilt library never overwrites one a running process has
loaded. ``$GEFEN_CPU_FLAGS`` appends to the flags:
``-mno-avx512f`` builds the AVX2 path on a machine with AVX-512, which is how the tests run
every path. ``available()`` says whether it loaded, ``build_error()`` why not, ``isa()`` which
vector path it runs.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from array import array
from pathlib import Path

import torch

from ..method.hyper import Hyper
from ..method.state import CROSS_FLOOR, SegmentState, cross_length
from . import segment_table as table
from .reference import local_factor
from .segment_table import Meta
from .work import CrossResult, CrossWork, SegmentWork

_PACKAGE = Path(__file__).resolve().parents[1]
PACKAGED = _PACKAGE / "_csrc" / "gefen_cpu.cpp"  # a wheel's copy (setup.py)
CHECKOUT = _PACKAGE.parent / "csrc" / "gefen_cpu.cpp"  # a checkout's, or an editable install's
SOURCE = PACKAGED if PACKAGED.exists() else CHECKOUT
# -fno-math-errno: sqrt sets no errno, so loops that take one vectorise (IEEE sqrt, same bits)
FLAGS = [
    "-O3",
    "-march=native",
    "-ffp-contract=off",
    "-fno-math-errno",
    "-fopenmp",
    "-fPIC",
    "-shared",
    "-std=c++17",
]

_lib: ctypes.CDLL | None = None
_error: str | None = None


def _cpu_key() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        flags = ""
    return flags


def _compiler() -> str | None:
    for cxx in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if cxx and shutil.which(cxx):
            return cxx
    return None


def _flags() -> list[str]:
    return [*FLAGS, *os.environ.get("GEFEN_CPU_FLAGS", "").split()]


def _build() -> ctypes.CDLL:
    if not SOURCE.exists():
        raise RuntimeError(f"{SOURCE} not found (a wheel built without setup.py's copy of csrc/?)")
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
    src = SOURCE.read_bytes()
    flags = _flags()
    key = hashlib.sha256(src + " ".join([cxx, *flags]).encode() + _cpu_key().encode())
    cache = Path(os.environ.get("GEFEN_CACHE_DIR", Path.home() / ".cache" / "gefen_dist"))
    lib = cache / f"gefen_cpu_{key.hexdigest()[:16]}.so"
    if not lib.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            out = Path(tmp) / lib.name
            r = subprocess.run(
                [cxx, *flags, str(SOURCE), "-o", str(out)], capture_output=True, text=True
            )
            if r.returncode != 0:
                raise RuntimeError(f"{cxx} failed to build {SOURCE.name}:\n{r.stderr[-2000:]}")
            os.replace(out, lib)  # atomic: concurrent ranks building at once all end the same
    dll = ctypes.CDLL(str(lib))
    P, I32 = ctypes.c_void_p, ctypes.c_int
    dll.gefen_cpu_step.argtypes = [P, P, P, I32, I32, ctypes.c_float]
    dll.gefen_cpu_step.restype = I32
    dll.gefen_cpu_isa.restype = I32
    I64 = ctypes.c_int64
    F = ctypes.c_float
    dll.gefen_cpu_cross_sums.argtypes = [P, I32, I64, I64, I64, P, P, I32, P, F, F]
    dll.gefen_cpu_cross_sums.restype = I32
    dll.gefen_cpu_cross_factor.argtypes = [P, P, I64, P, F, F, F, F, P]
    dll.gefen_cpu_cross_factor.restype = None
    dll.gefen_cpu_cross_table.argtypes = [P, P, I32, I32]
    dll.gefen_cpu_cross_table.restype = I32
    dll.gefen_cpu_count_steps.argtypes = [P, I32, P]
    dll.gefen_cpu_count_steps.restype = None
    dll.gefen_cpu_tables.argtypes = []
    dll.gefen_cpu_tables.restype = ctypes.c_char_p
    return dll


def load() -> ctypes.CDLL | None:
    """The library, built on first call; None (and ``build_error()``) when it cannot be."""
    global _lib, _error
    if _lib is None and _error is None:
        try:
            _lib = _build()
        except Exception as e:  # any failure leaves the reference in charge
            _error = f"{type(e).__name__}: {e}"
    return _lib


def available() -> bool:
    return load() is not None


def build_error() -> str | None:
    load()
    return _error


def isa() -> str | None:
    """The vector path the loaded library runs: 'avx512vbmi', 'avx512', 'avx2' or 'scalar'
    (None: not built)."""
    lib = load()
    names = {513: "avx512vbmi", 512: "avx512", 256: "avx2"}
    return None if lib is None else names.get(lib.gefen_cpu_isa(), "scalar")


def tables() -> dict[str, list[str]]:
    """The column names of each table as the loaded library declares them, in column order
    (``gefen_cpu_tables``): what ``tests/test_tables.py`` holds to ``segment_table``'s enums."""
    lib = load()
    if lib is None:
        raise RuntimeError(f"the C++ CPU kernel did not build: {_error}")
    out = {}
    for entry in lib.gefen_cpu_tables().decode().split(";"):
        if entry:
            name, columns = entry.split(":")
            out[name] = [c for c in columns.split(",") if c]
    return out


def supports(p: torch.Tensor, g: torch.Tensor) -> bool:
    return p.device.type == "cpu" and p.dtype in table.DTYPES and g.dtype in table.DTYPES


class StepTable:
    """The segment table of ``step`` as flat arrays the C++ call reads by address (not a list of
    lists: torch.tensor walks one element by element). ``cpu_plan.CpuPlan`` keeps one from step to
    step and rewrites only the addresses, step keys and hyperparameters in it."""

    def __init__(self, work: list[SegmentWork]) -> None:
        self.meta, self.hyp = array("q"), array("f")
        self.done = array("B")
        self.keep = []  # the factors: alive while the table is
        self.index: list[int] = []  # the item of ``work`` behind each row
        hrows: dict[int, list[float]] = {}  # the optimizer passes one Hyper per group and step
        for i, w in enumerate(work):
            st, h = w.seg, w.hyper
            if st.numel == 0:
                continue
            f, fused = w.factor, None
            if f is None and fuses(st, w.g):
                f = torch.empty_like(st.v_cross)  # the kernel writes it, and folds v_cross
                fused = st.v_cross
            elif f is None:  # None where the segment has no v_cross
                f = local_factor(w.g, st, h)
            self.done.append(1 if w.v_done else 0)
            self.keep.append(f)
            self.meta.extend(
                table.row(
                    w.p,
                    w.g,
                    st,
                    w.levels,
                    w.mids,
                    w.bits,
                    h.step,
                    f,
                    fused,
                    h.bf16_stochastic_round,
                )
            )
            hrow = hrows.get(id(h))
            if hrow is None:
                hrow = hrows[id(h)] = table.hyper_row(h)
            self.hyp.extend(hrow)
            self.index.append(i)

    def __len__(self) -> int:
        return len(self.done)

    def run(self) -> None:
        if not len(self):
            return
        rc = load().gefen_cpu_step(
            self.meta.buffer_info()[0],
            self.hyp.buffer_info()[0],
            self.done.buffer_info()[0],
            len(self),
            torch.get_num_threads(),
            CROSS_FLOOR,
        )
        if rc != 0:
            cols = len(Meta)
            bad = self.meta[(-rc - 1) * cols : -rc * cols].tolist()
            named = {c.name: v for c, v in zip(Meta, bad, strict=True)}
            raise RuntimeError(
                f"gefen_cpu_step refused a segment (dtypes, bits, block or v_cross): {named}"
            )


def fuses(st: SegmentState, g: torch.Tensor) -> bool:
    """Whether the kernel takes the segment's factor pass itself: a factored segment that starts
    its tensor and whose v_cross its own elements fill (a tensor held whole: the optimizer gives
    every piece of a tensor spread over ranks its factor), fp32 on the CPU. Other pieces a
    caller steps alone get ``local_factor``."""
    vx = st.v_cross
    return (
        vx is not None
        and vx.numel() > 0
        and st.start == 0
        and st.block_size != 1
        and vx.numel() == cross_length(st.block_size, st.numel)
        and vx.dtype == torch.float32
        and vx.is_contiguous()
        and vx.device.type == "cpu"
    )


def step(work: list[SegmentWork]) -> StepTable:
    """Run every ``SegmentWork`` in one call: blocks and dense tiles of all segments share the
    threads. Contiguous CPU tensors. Returns the table it ran.

    ``factor`` None where the segment has a v_cross: the kernel computes the factor from the
    segment's own g. Why here and not by the caller: ``SegmentWork`` gives None only to a
    segment whose own elements are its whole tensor, whose own sums are then exact, and the
    kernel can take them in the update's own read of g (``fuses``: the factor from v_cross as
    the steps before left it, this step's sums folded in after), one pass over g fewer than a
    factor pass before the update; a piece that does not fill its v_cross gets
    ``local_factor``. ``v_done``: ``cross_sums`` has folded this step's g^2 into the segment's v
    (contiguous blocks), so the kernel does not."""
    t = StepTable(work)
    t.run()
    return t


def count_steps(addrs: array, out: array) -> None:
    """Add one to the fp32 step counts at ``addrs`` (array 'q') and write the new values into
    ``out`` (array 'f', as long): one call for ``cpu_plan.CpuPlan``, where torch._foreach_add_
    over the scalars and an ``item()`` of each cost a few percent of the demo GPT's step."""
    if len(out) != len(addrs):
        raise ValueError(f"count_steps: {len(addrs)} addresses but {len(out)} outputs")
    load().gefen_cpu_count_steps(addrs.buffer_info()[0], len(addrs), out.buffer_info()[0])


def cross_sums(
    g: torch.Tensor,
    start: int,
    block_size: int,
    length: int,
    v: torch.Tensor | None = None,
    h: Hyper | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.cross_sums`` in one pass over g, both threads (each entry's sum in a fixed
    order, so the result does not depend on the thread count); g a flat contiguous CPU view.
    With ``v`` and ``h`` (contiguous blocks only): also folds each block's mean g^2 into the
    segment's fp32 block v, as the step's first pass would: the pass the factor needs then
    saves the step one read of g (tell ``step`` with ``v_done``)."""
    if v is not None and (block_size < 0 or h is None or v.dtype != torch.float32):
        raise ValueError("cross_sums folds into v only for contiguous blocks, fp32 v, given h")
    lib = load()
    sums = torch.zeros(length, dtype=torch.float64, device="cpu")
    counts = torch.zeros(length, dtype=torch.float64, device="cpu")
    rc = lib.gefen_cpu_cross_sums(
        g.data_ptr(),
        table.DTYPES[g.dtype],
        start,
        g.numel(),
        block_size,
        sums.data_ptr(),
        counts.data_ptr(),
        torch.get_num_threads(),
        0 if v is None else v.data_ptr(),
        0.0 if h is None else h.beta2,
        0.0 if h is None else 1.0 - h.beta2,
    )
    if rc != 0:
        raise RuntimeError(f"gefen_cpu_cross_sums refused a {g.dtype} gradient")
    return sums, counts


class CrossTable:
    """The factor pass's table (``segment_table.Cross`` rows of ``gefen_cpu_cross_table``) over
    ``CrossWork`` items, as flat arrays, with the buffers its sums, counts and factors land in:
    like ``StepTable``, kept by ``cpu_plan.CpuPlan`` and rewritten in place from step to step."""

    def __init__(self, work: list[CrossWork], fold: bool = True) -> None:
        lengths = [w.seg.v_cross.numel() for w in work]
        total = sum(lengths)
        self.sums = torch.zeros(2 * total, dtype=torch.float64, device="cpu")  # sums, counts
        out = torch.empty(
            sum(n for n, w in zip(lengths, work, strict=True) if w.whole), device="cpu"
        )
        sc_at, out_at = self.sums.data_ptr(), out.data_ptr()  # a slice costs a microsecond
        self.meta, self.hyp = array("q"), array("f")
        self.results: list[CrossResult] = []
        self.what = [(w.g.dtype, w.seg.block_size) for w in work]  # not g: kept for later
        at = fat = 0
        for w, n in zip(work, lengths, strict=True):
            st = w.seg
            v = st.v.data_ptr() if fold and st.block_size > 1 else 0
            self.meta.extend(
                table.cross_row(
                    w.g,
                    st,
                    sums=sc_at + 8 * at,
                    counts=sc_at + 8 * (total + at),
                    out=out_at + 4 * fat if w.whole else 0,
                    v=v,
                )
            )
            self.hyp.extend(table.cross_hyper_row(w.hyper))
            if w.whole:
                self.results.append(CrossResult(None, None, out[fat : fat + n]))
                fat += n
            else:
                sums = self.sums[at : at + n], self.sums[total + at : total + at + n]
                self.results.append(CrossResult(*sums, None))
            at += n

    def __len__(self) -> int:
        return len(self.results)

    def run(self) -> None:
        if not len(self):
            return
        rc = load().gefen_cpu_cross_table(
            self.meta.buffer_info()[0],
            self.hyp.buffer_info()[0],
            len(self),
            torch.get_num_threads(),
        )
        if rc != 0:
            dtype, block = self.what[-rc - 1]
            raise RuntimeError(
                f"gefen_cpu_cross_table refused a segment: {dtype} gradient, block {block}"
            )


def cross_table(work: list[CrossWork], fold: bool = True) -> CrossTable:
    """``cross_sums`` (folding into v where the blocks are contiguous) of every ``CrossWork`` in
    one call, then ``cross_factor`` of each ``whole`` one (a tensor held whole: its
    own sums are its tensor's): one call per step instead of two per factored tensor, each of
    which cost more in Python and in starting threads than the demo GPT's pass itself. The
    table's ``results`` hold a ``CrossResult`` per item: its factor if whole, else its sums and
    counts, for the all-reduce; the same bits as the per-segment calls. ``fold=False`` leaves
    the block v to the update's own first pass (``benchmarks/factor_cost.py`` times the
    difference)."""
    t = CrossTable(work, fold)
    t.run()
    return t


def cross_factor(
    st: SegmentState, h: Hyper, sums: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """``reference.cross_factor(st, h, reference.cross_mean(sums, counts))`` in one call: a dozen
    torch ops on a vector of a few hundred entries cost more than the kernel's pass over the
    tensor. fp32 CPU ``st.v_cross``, fp64 contiguous CPU sums and counts."""
    out = torch.empty_like(st.v_cross)
    load().gefen_cpu_cross_factor(
        sums.data_ptr(),
        counts.data_ptr(),
        st.v_cross.numel(),
        st.v_cross.data_ptr(),
        h.beta2,
        1.0 - h.beta2,
        h.bc2_sqrt,
        CROSS_FLOOR,
        out.data_ptr(),
    )
    return out
