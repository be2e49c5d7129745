"""The C++ CPU backend (``csrc/gefen_cpu.cpp``): built on first use, loaded with ctypes.

Why C++ and not the numba kernel it replaced as the default: measured on this project's machine
(``python benchmarks/step_speed.py``), the numba loop took ~25 ns per element, the C++ one a
fraction of that; numba stays as a fallback where no compiler is found. Why ctypes: the library
has a plain C ABI, so it builds in a few seconds with the system's C++ compiler, without torch's
headers, and one build serves every torch version.

The build goes to ``$GEFEN_CACHE_DIR`` (default ``~/.cache/gefen_dist``), keyed by the source,
the flags and the CPU, so a changed source or another machine rebuilds and a rebuilt library
never overwrites one a running process has loaded. ``available()`` says whether it loaded, and
``build_error()`` why not.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import torch

from .codes import nearest_table
from .reference import Hyper, SegmentState

SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "gefen_cpu.cpp"
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared", "-std=c++17"]
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

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


def _build() -> ctypes.CDLL:
    if not SOURCE.exists():
        raise RuntimeError(f"{SOURCE} not found (an install without csrc/)")
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
    src = SOURCE.read_bytes()
    key = hashlib.sha256(src + " ".join([cxx, *FLAGS]).encode() + _cpu_key().encode())
    cache = Path(os.environ.get("GEFEN_CACHE_DIR", Path.home() / ".cache" / "gefen_dist"))
    lib = cache / f"gefen_cpu_{key.hexdigest()[:16]}.so"
    if not lib.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            out = Path(tmp) / lib.name
            r = subprocess.run(
                [cxx, *FLAGS, str(SOURCE), "-o", str(out)], capture_output=True, text=True
            )
            if r.returncode != 0:
                raise RuntimeError(f"{cxx} failed to build {SOURCE.name}:\n{r.stderr[-2000:]}")
            os.replace(out, lib)  # atomic: concurrent ranks building at once all end the same
    dll = ctypes.CDLL(str(lib))
    P, I64, I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    dll.gefen_cpu_block_update.argtypes = [
        P,
        I32,
        P,
        I32,
        P,
        P,
        P,
        P,
        P,
        I32,
        P,
        I64,
        I64,
        I64,
        I32,
        P,
        I32,
    ]
    dll.gefen_cpu_dense_update.argtypes = [P, I32, P, I32, P, P, I64, P, I32]
    dll.gefen_cpu_block_update.restype = dll.gefen_cpu_dense_update.restype = I32
    dll.gefen_cpu_lut_cells.restype = I32
    return dll


def load() -> ctypes.CDLL | None:
    """The library, built on first call; None (and ``build_error()``) when it cannot be."""
    global _lib, _error
    if _lib is None and _error is None:
        try:
            _lib = _build()
        except Exception as e:  # any failure leaves the numba / reference backends in charge
            _error = f"{type(e).__name__}: {e}"
    return _lib


def available() -> bool:
    return load() is not None


def build_error() -> str | None:
    load()
    return _error


def supports(p: torch.Tensor, g: torch.Tensor) -> bool:
    return p.device.type == "cpu" and p.dtype in DTYPES and g.dtype in DTYPES


def _hyper(h: Hyper) -> np.ndarray:
    return np.array(
        [
            h.beta1,
            1.0 - h.beta1,
            h.beta2,
            1.0 - h.beta2,
            1.0 - h.lr * h.weight_decay,
            -h.step_size,
            h.bc2_sqrt,
            h.eps,
        ],
        dtype=np.float32,
    )


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def block_update(
    p: torch.Tensor,
    g: torch.Tensor,
    st: SegmentState,
    h: Hyper,
    levels: torch.Tensor,
    mids: torch.Tensor,
    bits: int,
) -> None:
    """Same contract as ``reference.block_update`` (contiguous CPU tensors)."""
    lib = load()
    hyper = _hyper(h)
    table = nearest_table(mids, lib.gefen_cpu_lut_cells())
    rc = lib.gefen_cpu_block_update(
        _ptr(p),
        DTYPES[p.dtype],
        _ptr(g),
        DTYPES[g.dtype],
        _ptr(st.codes),
        _ptr(st.absmax),
        _ptr(st.v),
        _ptr(levels),
        _ptr(mids),
        mids.numel(),
        _ptr(table),
        st.start,
        st.numel,
        st.block_size,
        bits,
        hyper.ctypes.data,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise RuntimeError(f"gefen_cpu_block_update refused {p.dtype}/{g.dtype}, bits={bits}")


def dense_update(p: torch.Tensor, g: torch.Tensor, st: SegmentState, h: Hyper) -> None:
    """Same contract as ``reference.dense_update`` (contiguous CPU tensors)."""
    lib = load()
    hyper = _hyper(h)
    rc = lib.gefen_cpu_dense_update(
        _ptr(p),
        DTYPES[p.dtype],
        _ptr(g),
        DTYPES[g.dtype],
        _ptr(st.exp_avg),
        _ptr(st.exp_avg_sq),
        st.numel,
        hyper.ctypes.data,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise RuntimeError(f"gefen_cpu_dense_update refused {p.dtype}/{g.dtype}")
