"""How every launch under tests/dist ends."""

from __future__ import annotations

import gc

import torch.distributed as dist


def finish() -> None:
    """Collect, then barrier and destroy the process group, then collect again: called after
    ``main()`` returns, so that main's locals are garbage by then.

    What holds the gloo group (DDP's C++ Reducer, FSDP's modules, the HF Trainer: all in
    reference cycles) must be freed while the group is still registered. Freed after
    ``destroy_process_group``, a Reducer joined a gloo thread that waited for the GIL, and the
    rank hung; left to interpreter exit, gloo's threads aborted the rank ("terminate called
    without an active exception"). ``launch/train.py`` ends its runs the same way."""
    gc.collect()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    gc.collect()
