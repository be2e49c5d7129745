"""Session hygiene shared by every test module."""

from __future__ import annotations

import contextlib
import glob
import os

import pytest

SHM_BUFFERS = "/dev/shm/deepspeed_allreduce_buffer_*"


@contextlib.contextmanager
def _removing_new_shm_buffers():
    before = set(glob.glob(SHM_BUFFERS))
    yield
    for path in set(glob.glob(SHM_BUFFERS)) - before:
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
