"""Session hygiene shared by every test module, and the check of the kinds each test declares."""

from __future__ import annotations

import contextlib
import glob
import os
import time

# The Triton kernels run on CPU tensors under Triton's interpreter, which triton takes from the
# environment when it is first imported; other modules (torchao) import it during collection,
# before a test module could set it, and the kernels would then be skipped as "imported with
# TRITON_INTERPRET set differently". So for the whole session, before anything imports triton.
os.environ.setdefault("TRITON_INTERPRET", "1")

# Every process a test starts (scripts, launchers, their ranks) imports the gefen_dist of the
# checkout under test, not the one pip installed in editable mode, which may be another checkout.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")]))

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


STALE_S = 60.0
"""A buffer unchanged this long and mapped by no process is a finished run's leftover. Why not
"whatever appeared during this session": two sessions on one machine then deleted each other's
live buffers between a rank's shm_open and its mmap, and its peer waited for the file forever."""


def _remove_stale_shm_buffers() -> None:
    paths = glob.glob(SHM_BUFFERS)
    if not paths:
        return
    in_use = _mapped()
    now = time.time()
    for path in paths:
        if path in in_use:
            continue
        with contextlib.suppress(FileNotFoundError):
            st = os.stat(path)
            if now - max(st.st_mtime, st.st_ctime) > STALE_S:
                os.unlink(path)


@pytest.fixture(autouse=True, scope="session")
def _remove_deepspeed_shm_buffers_of_the_session():
    """DeepSpeed's CPU accelerator leaves a 66 MiB shared-memory all-reduce buffer per rank in
    /dev/shm after every run; /dev/shm is RAM, and a few hundred runs had filled 22 of this
    machine's 24 GiB. Session scope catches the runs of module-scoped fixtures, which start
    before any function-scoped fixture runs."""
    yield
    _remove_stale_shm_buffers()


@pytest.fixture(autouse=True)
def _remove_deepspeed_shm_buffers_of_the_test():
    """The same after each test, so leftovers never pile up over a session."""
    yield
    _remove_stale_shm_buffers()


KINDS = ("unit", "dist", "triton", "slow")
"""What a test does, declared by its module's ``pytestmark`` (pyproject.toml describes each):
``-m unit`` is the fast in-process part, and ``-m 'not slow'`` leaves out what takes tens of
seconds."""


def _kinds(node: pytest.Item | pytest.Collector) -> set[str]:
    return {m.name for m in node.own_markers if m.name in KINDS}


def _resolve(item: pytest.Item) -> tuple[set[str], str | None]:
    """The kinds ``item`` has, and what is wrong with them (None: nothing).

    Kinds add up from the module down to the test, with one exception: ``unit`` means none of
    the others, so a test (or class) that declares another kind in a ``unit`` module is not
    ``unit``. Declaring ``unit`` beside another kind on one node, or on a test of a module of
    another kind, is an error; so is a test with no kind."""
    chain = [node for node in item.listchain() if isinstance(node, (pytest.Module, pytest.Class))]
    chain.append(item)
    kinds: set[str] = set()
    for node in chain:
        own = _kinds(node)
        if "unit" in own and len(own) > 1:
            return kinds | own, f"{node.name} declares unit beside {sorted(own - {'unit'})}"
        if "unit" in own and kinds - {"unit"}:
            return kinds | own, f"{node.name} declares unit inside {sorted(kinds)}"
        if own - {"unit"}:
            kinds.discard("unit")
        kinds |= own
    if not kinds:
        return kinds, f"declares none of {', '.join(KINDS)}; its module's pytestmark must name one"
    return kinds, None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Checks every test's declared kinds, and moves ``unit`` from a module (or class) onto the
    tests that keep it, so that ``-m unit`` leaves out a test that declared another kind. Runs
    before pytest's own ``-m`` selection (tryfirst), which reads the markers this leaves."""
    wrong: list[str] = []
    keeps: list[pytest.Item] = []
    for item in items:
        kinds, why = _resolve(item)
        if why:
            wrong.append(f"{item.nodeid}: {why}")
        elif "unit" in kinds:
            keeps.append(item)
    if wrong:
        raise pytest.UsageError("tests with a wrong kind:\n  " + "\n  ".join(wrong))
    for node in {node for item in items for node in item.listchain()[:-1]}:
        node.own_markers[:] = [m for m in node.own_markers if m.name != "unit"]
    for item in keeps:
        if "unit" not in _kinds(item):
            item.add_marker(pytest.mark.unit)
