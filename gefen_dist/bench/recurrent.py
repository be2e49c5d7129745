"""Recurrent byte LMs of other shapes than the suite's ``gru``: what a user's RNN looks like.

Why: the suite's GRU (embedding 64, hidden 192, batch 16 x 48 bytes) passed while a GRU of other
sizes, corpus, sequence length and batch fell apart at 3x AdamW's best lr (issue 43). Gefen's
partition sees only a tensor's shape and its first gradient, so the suite must hold recurrent
cells whose stacked gate matrices have other row counts (a hidden size that is not a multiple of
64), another cell (LSTM: four gates, not three), longer sequences (more applications of
``weight_hh`` per step) and smaller batches (noisier gradients):

- ``gru_odd``: GRU, embedding 48, hidden 200, batch 4 x 128 bytes;
- ``gru_wide``: GRU, embedding 96, hidden 312, batch 8 x 96 bytes;
- ``lstm``: LSTM, embedding 64, hidden 160, batch 6 x 96 bytes.

The corpus is the first MiB of the standard library's source (the other LM tasks read 4 MiB, so
the validation text differs too). Each run is 500 steps (as the held-out GRU of issue 43) and
takes 10-60 s on one CPU thread.
``register_tasks`` (called by ``gefen_dist.bench``'s ``__init__``) adds them to ``tasks.TASKS``;
they are not in ``tasks.DEFAULT_TASKS``.
"""

from __future__ import annotations

import torch
from torch import nn

import gefen_dist.bench.tasks as tasks

_SIZES = dict(max_bytes=2**20, val_batches=8, layers=1)


def _task(name: str, cell: str, emb: int, hidden: int, batch: int, seq: int) -> tasks.Task:
    """lr 1e-2: gru_odd's best and a third of lstm's (research/results/high_lr_rnn.md), so the
    sweep's grid (x0.33 to x10) holds both bests and the lrs above them where Gefen trailed."""
    label = (
        f"{cell.upper()} byte LM (embedding {emb}, hidden {hidden}, batch {batch} x {seq} bytes)"
    )
    sizes = dict(_SIZES, cell=cell, emb=emb, hidden=hidden, batch=batch, seq=seq)
    return tasks.Task(name, label, "lm", tasks.Hyper(steps=500, lr=1e-2, evals=10), sizes)


RECURRENT: tuple[tasks.Task, ...] = (
    _task("gru_odd", "gru", emb=48, hidden=200, batch=4, seq=128),
    _task("gru_wide", "gru", emb=96, hidden=312, batch=8, seq=96),
    _task("lstm", "lstm", emb=64, hidden=160, batch=6, seq=96),
)


def register_tasks() -> None:
    """Each task of ``RECURRENT`` in ``tasks.TASKS``, built by ``build`` (idempotent)."""
    for t in RECURRENT:
        tasks.register(t, build)


def build(t: tasks.Task, seed: int) -> tasks.Instance:
    """``tasks.build`` for a recurrent task: the model from the seed, the LM batches of the
    task's corpus and its fixed validation set."""
    s = t.sizes
    torch.manual_seed(seed)
    cell = {"gru": nn.GRU, "lstm": nn.LSTM}[s["cell"]]
    model = tasks.GRULM(s["emb"], s["hidden"], s["layers"], cell=cell)
    return tasks.lm_instance(model, s, seed, {})
