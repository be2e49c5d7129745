"""Session hygiene shared by every test module."""

from __future__ import annotations

import glob
import os

import pytest

SHM_BUFFERS = "/dev/shm/deepspeed_allreduce_buffer_*"


@pytest.fixture(autouse=True)
def _remove_deepspeed_shm_buffers():
    """DeepSpeed's CPU accelerator leaves a 66 MiB shared-memory all-reduce buffer per rank in
    /dev/shm after every run; /dev/shm is RAM, and a few hundred runs had filled 22 of this
    machine's 24 GiB. Remove those a test's runs created, once its processes have exited."""
    before = set(glob.glob(SHM_BUFFERS))
    yield
    for path in set(glob.glob(SHM_BUFFERS)) - before:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
