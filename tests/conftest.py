"""Session hygiene shared by every test module."""

from __future__ import annotations

import contextlib
import glob
import os

# The Triton kernels run on CPU tensors under Triton's interpreter, which triton takes from the
# environment when it is first imported; other modules (torchao) import it during collection,
# before a test module could set it, and the kernels would then be skipped as "imported with
# TRITON_INTERPRET set differently". So for the whole session, before anything imports triton.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

SHM_BUFFERS = "/dev/shm/deepspeed_allreduce_buffer_*"


def _mapped() -> set[str]:
    """Files some live process has mapped: a DeepSpeed buffer in use. Another test run on the
    machine may be mid-launch, and a rank whose peer's buffer vanishes waits for it forever."""
    out: set[str] = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        with contextlib.suppress(OSError):
            with open(maps) as f:
                out.update(line.split()[-1] for line in f if "deepspeed_allreduce" in line)
    return out


@contextlib.contextmanager
def _removing_new_shm_buffers():
    before = set(glob.glob(SHM_BUFFERS))
    yield
    new = set(glob.glob(SHM_BUFFERS)) - before
    if new:
        new -= _mapped()
    for path in new:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


@pytest.fixture(autouse=True, scope="session")
def _remove_deepspeed_shm_buffers_of_the_session():
    """DeepSpeed's CPU accelerator leaves a 66 MiB shared-memory all-reduce buffer per rank in
    /dev/shm after every run; /dev/shm is RAM, and a few hundred runs had filled 22 of this
    machine's 24 GiB. Session scope catches the runs of module-scoped fixtures, which start
    before any function-scoped fixture could take its snapshot."""
    with _removing_new_shm_buffers():
        yield


@pytest.fixture(autouse=True)
def _remove_deepspeed_shm_buffers_of_the_test():
    """The same per test, so a session never holds more than one test's buffers."""
    with _removing_new_shm_buffers():
        yield


SLOW = (
    "tests/test_cpu_kernels.py::test_narrower_vector_paths_pass_the_kernel_tests_too",
    "tests/test_bench.py::test_smoke_compare_end_to_end",
    "tests/test_bench.py::test_state_bytes_unpacks_torchao_quantised_tensors",
    "tests/test_bench_memory.py::test_smoke_capacity",
    "tests/test_checkpoint.py::test_resume_in_a_fresh_process_is_bit_exact",
    "tests/test_main_job.py",
    "tests/test_train.py",
)
"""Tests of tens of seconds each (a kernel build per vector path, a subprocess training run,
torchao's compile) that carry no mark of their own."""

_SPAWNS = ("torchrun(", "deepspeed_run(", "torch.distributed.run", "accelerate launch")


def pytest_collection_modifyitems(config, items):
    """Marks by what a test does, so ``-m`` selects without a mark on every test: ``dist``
    where its module starts ranks in subprocesses, ``slow`` for SLOW, ``unit`` for the rest of
    what is neither nor needs triton (the fast command in README.md runs ``-m unit``)."""
    spawns: dict[str, bool] = {}
    for item in items:
        path = str(item.path)
        if path not in spawns:
            try:
                spawns[path] = any(s in item.path.read_text() for s in _SPAWNS)
            except OSError:
                spawns[path] = False
        if spawns[path] and not item.get_closest_marker("dist"):
            item.add_marker(pytest.mark.dist)
        if item.nodeid.startswith(SLOW):
            item.add_marker(pytest.mark.slow)
        if not any(item.get_closest_marker(m) for m in ("dist", "slow", "triton")):
            item.add_marker(pytest.mark.unit)
