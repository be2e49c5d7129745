"""A mixture-of-experts byte LM in the four expert storages people train.

Why: the experts of today's large models hold most of their parameters, and the codebases store
them in different layouts. Gefen's partition sees only a tensor's shape and its first gradient,
so the same experts must be tried in each layout a user may hand it (issue 45):

- ``grouped``: torchtitan's ``GroupedExperts``, one 3-D weight per projection, each expert's
  slice an ``nn.Linear`` weight: w1 / w3 (E, F, D), w2 (E, D, F);
- ``transposed``: the other orientation, x @ w: w1 / w3 (E, D, F), w2 (E, F, D);
- ``fused``: gate and up fused, w13 (E, 2F, D) (first F rows gate, last F up), w2 (E, D, F);
- ``linear``: a ``ModuleList`` of per-expert modules with gate/up/down ``nn.Linear``.

Every storage holds the same expert parameters (3 E D F per layer) and computes the same
function of them; the storages differ only in where each number lies. The router is a linear
map to E logits, softmax, top-k (k = 2), the k weights renormalised to sum to one (Mixtral's
rule); no load-balancing loss, so the experts an untrained router sends no token to stay
unrouted, as in a user's first step. Attention and norms are the bench's Llama block's.

This module imports from ``gefen_dist.bench.tasks`` (one way). ``task(storage)`` and
``build`` give it as a bench task (``tasks.Task`` / ``tasks.Instance``); ``register_tasks``, which
``gefen_dist.bench``'s ``__init__`` calls, puts one task per storage in ``tasks.TASKS`` (``moe``
for the grouped storage, ``moe_linear``, ``moe_transposed``, ``moe_fused``), so ``python -m
gefen_dist.bench compare --tasks moe,moe_linear`` and its ``--lr-sweep`` run them. They are not
in ``tasks.DEFAULT_TASKS``: a command without ``--tasks`` runs what it always ran.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import gefen_dist.bench.tasks as tasks
from gefen_dist.bench.tasks import LlamaAttention, RMSNorm

STORAGES = ("grouped", "transposed", "fused", "linear")


@dataclass(frozen=True)
class MoEConfig:
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_experts: int = 8
    top_k: int = 2
    hidden: int = 160
    """F: each expert's SwiGLU width (not a multiple of dim, so D and F never coincide)."""
    seq: int = 64
    vocab: int = 256
    storage: str = "grouped"


class _Expert(nn.Module):
    """One expert of the ``linear`` storage (Mixtral/HF names)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)


class MoEFeedForward(nn.Module):
    """Top-k routed SwiGLU experts in one of ``STORAGES``.

    ``last_counts`` (E,) holds the tokens each expert received in the last forward: which
    experts were unrouted, and a check that each token went to k distinct experts."""

    def __init__(self, dim: int, hidden: int, n_experts: int, top_k: int, storage: str):
        super().__init__()
        if storage not in STORAGES:
            raise ValueError(f"storage {storage!r} is not one of {', '.join(STORAGES)}")
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k {top_k} must be in 1..n_experts ({n_experts})")
        self.storage, self.n_experts, self.top_k, self.hidden = storage, n_experts, top_k, hidden
        self.router = nn.Linear(dim, n_experts, bias=False)
        e, d, f = n_experts, dim, hidden
        if storage == "grouped":
            self.w1 = nn.Parameter(torch.empty(e, f, d))
            self.w3 = nn.Parameter(torch.empty(e, f, d))
            self.w2 = nn.Parameter(torch.empty(e, d, f))
        elif storage == "transposed":
            self.w1 = nn.Parameter(torch.empty(e, d, f))
            self.w3 = nn.Parameter(torch.empty(e, d, f))
            self.w2 = nn.Parameter(torch.empty(e, f, d))
        elif storage == "fused":
            self.w13 = nn.Parameter(torch.empty(e, 2 * f, d))
            self.w2 = nn.Parameter(torch.empty(e, d, f))
        else:
            self.experts = nn.ModuleList(_Expert(d, f) for _ in range(e))
        self.register_buffer("last_counts", torch.zeros(e, dtype=torch.long), persistent=False)

    def expert_weights(self, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Expert ``e``'s (gate (F, D), up (F, D), down (D, F)) as ``nn.Linear`` weights,
        whatever the storage."""
        s, f = self.storage, self.hidden
        if s == "grouped":
            return self.w1[e], self.w3[e], self.w2[e]
        if s == "transposed":
            return self.w1[e].t(), self.w3[e].t(), self.w2[e].t()
        if s == "fused":
            return self.w13[e, :f], self.w13[e, f:], self.w2[e]
        x = self.experts[e]
        return x.gate_proj.weight, x.up_proj.weight, x.down_proj.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = F.softmax(self.router(x), dim=-1)
        weight, chosen = probs.topk(self.top_k, dim=-1)
        weight = weight / weight.sum(-1, keepdim=True)
        self.last_counts = torch.bincount(chosen.reshape(-1), minlength=self.n_experts)
        out = torch.zeros_like(x)
        for e in range(self.n_experts):
            tok, slot = torch.nonzero(chosen == e, as_tuple=True)
            if tok.numel() == 0:
                continue
            gate, up, down = self.expert_weights(e)
            h = x[tok]
            y = F.linear(F.silu(F.linear(h, gate)) * F.linear(h, up), down)
            out.index_add_(0, tok, y * weight[tok, slot, None])
        return out.reshape(shape)


class MoEBlock(nn.Module):
    def __init__(self, c: MoEConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.dim)
        self.self_attn = LlamaAttention(c.dim, c.n_heads, c.n_heads)
        self.post_attention_layernorm = RMSNorm(c.dim)
        self.moe = MoEFeedForward(c.dim, c.hidden, c.n_experts, c.top_k, c.storage)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.moe(self.post_attention_layernorm(x))


class MoELM(nn.Module):
    """Byte-level MoE LM: Llama attention and norms, top-k routed SwiGLU experts, tied head.

    Init as the bench's Llama: normal(0.02) for every matrix, the residual outputs (o_proj and
    the experts' down projections) scaled by 1 / sqrt(2 L); the same draws in every storage
    would need one layout's RNG order, so only the distribution is shared."""

    def __init__(self, c: MoEConfig):
        super().__init__()
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab, c.dim)
        self.layers = nn.ModuleList(MoEBlock(c) for _ in range(c.n_layers))
        self.norm = RMSNorm(c.dim)
        self.lm_head = nn.Linear(c.dim, c.vocab, bias=False)
        self.lm_head.weight = self.embed_tokens.weight
        resid_std = 0.02 / math.sqrt(2 * c.n_layers)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                resid = name.endswith(("o_proj.weight", "down_proj.weight", ".w2"))
                nn.init.normal_(p, std=resid_std if resid else 0.02)
        tasks.register_rotary(self, c.dim // c.n_heads, c.seq)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        x = self.embed_tokens(idx)
        for layer in self.layers:
            x = layer(x, self.cos[:T], self.sin[:T])
        return self.lm_head(self.norm(x))

    def expert_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The experts' parameters by name (the router, attention and norms excluded)."""
        return [
            (n, p)
            for n, p in self.named_parameters()
            if ".moe." in n and not n.endswith("router.weight")
        ]


LM_SIZES = dict(tasks._LM)
"""The bench's LM data settings (batch 8 x 64 bytes of the standard library's source)."""


def lm_batches(seed: int, sizes: dict | None = None) -> Iterator[tasks.Batch]:
    """The training batches the bench's LM tasks draw for ``seed``."""
    return tasks._lm_batches(dict(LM_SIZES, **(sizes or {})), seed)


def lm_loss(model: nn.Module, batch: tasks.Batch) -> torch.Tensor:
    return tasks._lm_loss(model, batch)


def task_name(storage: str) -> str:
    """The suite's name for the MoE task of ``storage``: ``moe`` for torchtitan's grouped
    layout (the one large MoE trainings use), ``moe_<storage>`` for the others."""
    if storage not in STORAGES:
        raise ValueError(f"storage {storage!r} is not one of {', '.join(STORAGES)}")
    return "moe" if storage == "grouped" else f"moe_{storage}"


def task(storage: str = "grouped") -> tasks.Task:
    """The MoE LM as a bench task, for one storage: the Llama task's hyperparameters, data and
    step count (180). Sized so that a run takes about as long as the Llama task's on one CPU
    thread (1.15M parameters against its 0.84M; 150 against 190 ms a step with AdamW on a
    2-core Xeon: the experts each see a quarter of the tokens)."""
    c = MoEConfig(storage=storage)
    return tasks.Task(
        task_name(storage),
        f"MoE byte LM (top-{c.top_k} of {c.n_experts} SwiGLU experts of {c.hidden}, d={c.dim}, "
        f"{c.n_layers} layers; experts stored {storage})",
        "lm",
        tasks.Hyper(steps=180, lr=3e-3, evals=8),
        dict(
            LM_SIZES,
            dim=c.dim,
            n_layers=c.n_layers,
            n_heads=c.n_heads,
            n_experts=c.n_experts,
            top_k=c.top_k,
            hidden=c.hidden,
            storage=storage,
        ),
    )


def register_tasks() -> None:
    """One suite task per storage in ``tasks.TASKS``, built by ``build`` (idempotent)."""
    for storage in STORAGES:
        tasks.register(task(storage), build)


def build(t: tasks.Task, seed: int) -> tasks.Instance:
    """``tasks.build`` for an MoE task: the model from the seed, the LM batches and validation
    set every LM task of the bench uses."""
    s = t.sizes
    torch.manual_seed(seed)
    model = MoELM(
        MoEConfig(
            dim=s["dim"],
            n_layers=s["n_layers"],
            n_heads=s["n_heads"],
            n_experts=s["n_experts"],
            top_k=s["top_k"],
            hidden=s["hidden"],
            seq=s["seq"],
            storage=s["storage"],
        )
    )
    info = dict(dim=s["dim"], n_heads=s["n_heads"], n_kv_heads=s["n_heads"])
    return tasks.lm_instance(model, s, seed, info)
