"""Which update Gefen picks (backends.dispatch): the rule for devices CI does not have."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from needs import extra

from gefen_dist.backends.dispatch import BACKENDS, Choice, Facts, choose

pytestmark = pytest.mark.unit

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


@pytest.mark.triton
@pytest.mark.slow
def test_a_cuda_device_picks_triton_with_no_compiler_on_path(tmp_path):
    """What a user with a CUDA wheel of torch has: triton, and neither nvcc nor ninja. The
    Triton kernels need neither (they compile through triton's own bundled toolchain), so the
    facts Gefen gathers for a CUDA device say triton is available, and the rule picks it."""
    extra("triton")
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


def test_each_parameter_takes_its_own_devices_kernel():
    """FSDP2's CPUOffloadPolicy on a GPU machine: one optimizer holds host DTensors (their
    local shards on the CPU) next to CUDA parameters. The choice is made per parameter from its
    local tensor's facts, so host shards take the C++ kernel and CUDA ones Triton, and a host
    shard without a compiler falls back alone (warning about the C++ kernel, not Triton's)."""
    host = Facts(device="cpu", cpp_supports=True, cpp_available=True, triton_supports=False)
    assert [choose("auto", f).impl for f in (host, CUDA, host)] == ["cpu", "triton", "cpu"]
    assert [choose("native", f).impl for f in (host, CUDA)] == ["cpu", "triton"]
    assert choose("auto", CPU_NO_CXX).unavailable == ("C++ CPU", "no c++")
    assert choose("auto", CUDA).unavailable is None


@pytest.mark.triton
@pytest.mark.slow
def test_host_tensors_take_the_cpp_kernel_where_triton_is_compiled(tmp_path):
    """The facts Gefen gathers for a host tensor in a process where triton imports compiled (no
    interpreter, as on a GPU machine): Triton does not take host tensors, so 'auto' and
    'native' give the C++ kernel (``Gefen.backend_of`` says so per parameter, as for an
    offloaded FSDP2 shard), and 'triton' by name is refused saying why."""
    extra("triton")
    code = (
        "import torch\n"
        "from gefen_dist import Gefen\n"
        "from gefen_dist.backends import native_cpu, triton_backend\n"
        "assert not triton_backend.interpreting()\n"
        "p = torch.zeros(64, 64, requires_grad=True)\n"
        "p.grad = torch.ones(64, 64)\n"
        "assert not triton_backend.supports(p, p.grad)\n"
        "out = []\n"
        "for b in ('auto', 'native'):\n"
        "    o = Gefen([p]); o.backend = b; out.append(o.backend_of(p))\n"
        "o = Gefen([p]); o.backend = 'triton'\n"
        "try:\n"
        "    o.step()\n"
        "except RuntimeError as e:\n"
        "    out.append('refused' if 'does not take cpu tensors' in str(e) else str(e))\n"
        "print(' '.join(out), native_cpu.available())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT))
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert r.returncode == 0, r.stderr[-2000:]
    words = r.stdout.split()
    assert words[2] == "refused"
    if words[3] == "True":
        assert words[:2] == ["native-cpu", "native-cpu"]
