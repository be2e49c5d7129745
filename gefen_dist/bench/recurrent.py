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


class LSTMLM(nn.Module):
    """Byte-level LSTM language model (stacked i/f/g/o gate matrices, 4H rows)."""

    def __init__(self, emb: int, hidden: int, layers: int, vocab: int = 256):
        super().__init__()
        self.embed = nn.Embedding(vocab, emb)
        self.rnn = nn.LSTM(emb, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.embed(idx))[0])


# lr 1e-2: gru_odd's best and a third of lstm's (research/results/high_lr_rnn.md), so the sweep's
# grid (x0.33 to x10) holds both bests and the lrs above them where Gefen was seen to trail
RECURRENT: tuple[tasks.Task, ...] = (
    tasks.Task(
        "gru_odd",
        "GRU byte LM (embedding 48, hidden 200, batch 4 x 128 bytes)",
        "lm",
        tasks.Hyper(steps=500, lr=1e-2, evals=10),
        dict(_SIZES, cell="gru", emb=48, hidden=200, batch=4, seq=128),
    ),
    tasks.Task(
        "gru_wide",
        "GRU byte LM (embedding 96, hidden 312, batch 8 x 96 bytes)",
        "lm",
        tasks.Hyper(steps=500, lr=1e-2, evals=10),
        dict(_SIZES, cell="gru", emb=96, hidden=312, batch=8, seq=96),
    ),
    tasks.Task(
        "lstm",
        "LSTM byte LM (embedding 64, hidden 160, batch 6 x 96 bytes)",
        "lm",
        tasks.Hyper(steps=500, lr=1e-2, evals=10),
        dict(_SIZES, cell="lstm", emb=64, hidden=160, batch=6, seq=96),
    ),
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
    cell = {"gru": tasks.GRULM, "lstm": LSTMLM}[s["cell"]]
    model = cell(s["emb"], s["hidden"], s["layers"])
    val = tasks._lm_val(s)

    @torch.no_grad()
    def evaluate(m: nn.Module) -> dict[str, float]:
        m.eval()
        loss = sum(float(tasks._lm_loss(m, b)) for b in val) / len(val)
        m.train()
        return dict(val_loss=loss)

    return tasks.Instance(model, tasks._lm_batches(s, seed), tasks._lm_loss, evaluate, {})
