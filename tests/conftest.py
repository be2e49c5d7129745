"""Session hygiene shared by every test module."""

from __future__ import annotations

import glob
import os

import pytest

SHM_BUFFERS = "/dev/shm/deepspeed_allreduce_buffer_*"


def _remove_new(before: set[str]) -> None:
    for path in set(glob.glob(SHM_BUFFERS)) - before:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


@pytest.fixture(autouse=True, scope="session")
def _remove_deepspeed_shm_buffers_of_the_session():
    """DeepSpeed's CPU accelerator leaves a 66 MiB shared-memory all-reduce buffer per rank in
    /dev/shm after every run; /dev/shm is RAM, and a few hundred runs had filled 22 of this
    machine's 24 GiB. Session scope catches the runs of module-scoped fixtures, which start
    before any function-scoped fixture could take its snapshot."""
    before = set(glob.glob(SHM_BUFFERS))
    yield
    _remove_new(before)


@pytest.fixture(autouse=True)
def _remove_deepspeed_shm_buffers_of_the_test():
    """The same per test, so a session never holds more than one test's buffers."""
    before = set(glob.glob(SHM_BUFFERS))
    yield
    _remove_new(before)
