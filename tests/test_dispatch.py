"""Which update Gefen picks (backends.dispatch): the rule for devices CI does not have."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gefen_dist.backends.dispatch import BACKENDS, Choice, Facts, choose

ROOT = Path(__file__).resolve().parents[1]

CUDA = Facts(device="cuda", triton_supports=True, triton_available=True)
CUDA_NO_TRITON = Facts(
    device="cuda", triton_supports=True, triton_available=False, triton_why="no module triton"
)
CPU = Facts(device="cpu", cpp_supports=True, cpp_available=True, triton_supports=False)
CPU_NO_CXX = Facts(device="cpu", cpp_supports=True, cpp_available=False, cpp_why="no c++")


@pytest.mark.parametrize("backend", ["auto", "native", "triton"])
def test_cuda_tensors_take_triton(backend):
    assert choose(backend, CUDA) == Choice("triton")


def test_cuda_without_triton_falls_back_to_the_reference_saying_why():
    assert choose("auto", CUDA_NO_TRITON) == Choice("reference", ("Triton", "no module triton"))
    with pytest.raises(RuntimeError, match="native.*Triton.*no module triton"):
        choose("native", CUDA_NO_TRITON)
    with pytest.raises(RuntimeError, match="triton.*unavailable.*no module triton"):
        choose("triton", CUDA_NO_TRITON)


def test_cpu_tensors_take_the_cpp_kernel_then_the_reference():
    assert choose("auto", CPU) == Choice("cpu")
    assert choose("auto", CPU_NO_CXX) == Choice("reference", ("C++ CPU", "no c++"))
    with pytest.raises(RuntimeError, match="C\\+\\+ CPU.*no c\\+\\+"):
        choose("native", CPU_NO_CXX)
    with pytest.raises(ValueError, match="Invalid backend: 'numba'"):
        choose("numba", CPU)
    assert choose("reference", CUDA) == Choice("reference")


def test_triton_on_tensors_it_does_not_take_is_refused_by_name():
    with pytest.raises(RuntimeError, match="backend='triton' does not take cpu tensors"):
        choose("triton", CPU)
    with pytest.raises(ValueError, match="Invalid backend: 'cuda'"):
        choose("cuda", CPU)
    assert set(BACKENDS) == {"auto", "native", "triton", "reference"}


def test_a_cuda_device_picks_triton_with_no_compiler_on_path(tmp_path):
    """What a user with a CUDA wheel of torch has: triton, and neither nvcc nor ninja. The
    Triton kernels need neither (they compile through triton's own bundled toolchain), so the
    facts Gefen gathers for a CUDA device say triton is available, and the rule picks it."""
    pytest.importorskip("triton")
    code = (
        "import shutil\n"
        "assert shutil.which('nvcc') is None and shutil.which('ninja') is None\n"
        "from gefen_dist.backends import triton_backend\n"
        "from gefen_dist.backends.dispatch import Facts, choose\n"
        "assert triton_backend.available(), triton_backend.build_error()\n"
        "ok = triton_backend.available()\n"
        "f = Facts(device='cuda', triton_supports=True, triton_available=ok)\n"
        "print(choose('auto', f).impl)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PATH=str(tmp_path), PYTHONPATH=str(ROOT))
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "triton"
