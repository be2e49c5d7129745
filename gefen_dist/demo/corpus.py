"""Byte-level corpus: the Python standard library's own source.

It is on every machine that runs this package, so the demo needs no download and every run
sees the same bytes for a given Python version.
"""

from __future__ import annotations

import os
import sysconfig

import torch

SKIP_DIRS = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}


def stdlib_files() -> list[str]:
    """Sorted by relative path so the concatenation order does not depend on the file system."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        # pruning here (not filtering afterwards) keeps the walk out of site-packages
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
        for f in filenames:
            if f.endswith(".py"):
                files.append(os.path.relpath(os.path.join(dirpath, f), root))
    return [os.path.join(root, f) for f in sorted(files)]


def load_corpus(
    max_bytes: int = 8 * 2**20, val_frac: float = 0.1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (train, val) uint8 tensors; val is the tail so the two never overlap."""
    chunks, n = [], 0
    for path in stdlib_files():
        with open(path, "rb") as f:
            b = f.read(max_bytes - n)
        chunks.append(b)
        n += len(b)
        if n >= max_bytes:
            break
    data = torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)
    if len(data) == 0:
        raise RuntimeError("no stdlib .py source found under " + sysconfig.get_paths()["stdlib"])
    n_train = int(len(data) * (1 - val_frac))
    return data[:n_train], data[n_train:]


def get_batch(
    data: torch.Tensor, batch_size: int, block_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows drawn from `generator` alone, so the data order depends only on its seed."""
    ix = torch.randint(
        len(data) - block_size, (batch_size,), generator=generator, device=generator.device
    )
    idx = ix[:, None] + torch.arange(block_size + 1, device=ix.device)
    xy = data[idx].long()
    return xy[:, :-1].contiguous(), xy[:, 1:].contiguous()
