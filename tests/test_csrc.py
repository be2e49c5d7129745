"""The CUDA sources compile: kernels with nvcc for sm_80 and sm_90, the torch binding against the
installed torch's headers. Nothing CUDA runs here; launch/gpu_check.py runs them on a GPU."""

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from torch.utils.cpp_extension import include_paths

CSRC = Path(__file__).resolve().parents[1] / "csrc"
NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not installed")


def _cuda_root() -> Path:
    roots = [os.environ.get("CUDA_HOME"), Path(NVCC).resolve().parents[1], "/usr/local/cuda"]
    for root in filter(None, roots):
        if (Path(root) / "include" / "cuda_runtime.h").exists():
            return Path(root)
    pytest.fail("nvcc found but no cuda_runtime.h next to it (set CUDA_HOME)")


@needs_nvcc
def test_kernels_compile_for_sm80_and_sm90(tmp_path):
    cmd = [
        NVCC,
        "-c",
        str(CSRC / "gefen_cuda.cu"),
        "-o",
        str(tmp_path / "k.o"),
        "-O3",
        "--fmad=false",
        "-std=c++17",
        "-Werror",
        "all-warnings",
        "-gencode",
        "arch=compute_80,code=sm_80",
        "-gencode",
        "arch=compute_90,code=sm_90",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    try:  # cuobjdump is not part of every toolkit install; where it runs, check the archs
        elf = subprocess.run(
            ["cuobjdump", "--list-elf", tmp_path / "k.o"], capture_output=True, text=True
        )
    except FileNotFoundError:
        return
    if elf.returncode == 0:
        assert "sm_80" in elf.stdout and "sm_90" in elf.stdout, elf.stdout


@needs_nvcc
def test_binding_compiles_against_torch_headers():
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    cuda = str(_cuda_root() / "include")
    incs = [*include_paths(), cuda, sysconfig.get_paths()["include"], str(CSRC)]
    cmd = [
        cxx,
        "-fsyntax-only",
        "-std=c++20",
        "-Wall",
        "-Werror=return-type",
        "-DTORCH_EXTENSION_NAME=gefen_cuda_ext",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        *(f"-I{i}" for i in incs),
        str(CSRC / "gefen_cuda_binding.cpp"),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]


def test_cuda_backend_reports_why_it_is_unavailable_here():
    """Skips only where the child itself finds CUDA: a child that crashes (an import error, an
    exception in ``build_error``) fails, where it once skipped as "may have CUDA"."""
    code = (
        "import torch\n"
        "from gefen_dist import native_cuda\n"
        "if torch.cuda.is_available():\n"
        "    print('has CUDA')\n"
        "    raise SystemExit\n"
        "assert not native_cuda.available()\n"
        "print(native_cuda.build_error())\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    if r.stdout.strip() == "has CUDA":
        pytest.skip("this machine has CUDA")
    assert "CUDA is not available" in r.stdout or "CPU build" in r.stdout, r.stdout
