"""The comparison's tasks: five small models on data every machine of this kind already has.

Why these five: a memory/quality claim for a drop-in AdamW has to hold across the parameter
shapes people train, not just on the demo GPT: fused-qkv GPT with LayerNorm and biases, a
Llama-style block (RMSNorm, SwiGLU, rotary, grouped-query attention, no biases, tied embedding,
hidden size 192 so nothing is a power of two), a BatchNorm ResNet (4-D conv kernels, tiny BN
vectors), a plain MLP and a GRU (stacked gate matrices). The data is the Python standard
library's source (``gefen_dist.demo.corpus``) and scikit-learn's bundled digits, so no run
downloads anything.

A task builds its model from the seed (``torch.manual_seed``) and draws its training batches
from a generator seeded from the seed alone, so every optimizer sees the same init and the
same data order for a given seed. Validation data is fixed (the same for every seed).
Sizes are set so that the whole suite (5 tasks x 9 optimizers x 3 seeds) fits in about an
hour on two cores; ``scale`` shrinks the step counts for a smoke run.

Other modules add tasks with ``register``: ``gefen_dist.bench.moe`` adds the mixture-of-experts
LM in its four expert storages (``moe``, ``moe_linear``, ``moe_transposed``, ``moe_fused``).
They run when named (``--tasks``); ``DEFAULT_TASKS`` stays the five above.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gefen_dist.demo.corpus import get_batch, load_corpus
from gefen_dist.demo.model import GPT, GPTConfig
from gefen_dist.schedule import warmup_cosine

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Hyper:
    """What every optimizer of one task shares: AdamW's lr, betas, weight decay and schedule."""

    steps: int
    lr: float
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.01
    warmup_frac: float = 0.1
    min_lr_frac: float = 0.1
    grad_clip: float = 1.0
    evals: int = 10


@dataclass(frozen=True)
class Task:
    name: str
    label: str
    kind: str
    """'lm' (metric: val loss in nats/byte) or 'cls' (val loss and accuracy)."""
    hyper: Hyper
    sizes: dict[str, Any] = field(default_factory=dict)
    """Everything that shapes the model and data; part of the settings a stored record must
    match to be reused."""

    def settings(self) -> dict[str, Any]:
        return dict(task=self.name, kind=self.kind, hyper=asdict(self.hyper), sizes=self.sizes)


def lr_factor(step: int, h: Hyper) -> float:
    """Linear warmup, then cosine decay to ``min_lr_frac`` (as gefen_dist.demo.train)."""
    warmup = max(1, int(h.warmup_frac * h.steps))
    return warmup_cosine(step, h.steps, warmup, h.min_lr_frac)


# -- data -------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _corpus(max_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    return load_corpus(max_bytes)


@functools.lru_cache(maxsize=1)
def _digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fixed split (permutation seed 0, 300 validation images), pixels scaled to [0, 1]."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    val, train = perm[:300], perm[300:]
    return x[train], y[train], x[val], y[val]


def _lm_batches(sizes: dict, seed: int) -> Iterator[Batch]:
    train, _ = _corpus(sizes["max_bytes"])
    g = torch.Generator().manual_seed(10_000 + seed)
    while True:
        yield get_batch(train, sizes["batch"], sizes["seq"], g)


def _lm_val(sizes: dict) -> list[Batch]:
    _, val = _corpus(sizes["max_bytes"])
    g = torch.Generator().manual_seed(1234)
    return [get_batch(val, sizes["batch"], sizes["seq"], g) for _ in range(sizes["val_batches"])]


def _cls_batches(sizes: dict, seed: int) -> Iterator[Batch]:
    """Shuffled epochs drawn from the seed, so the order is the same for every optimizer."""
    x, y, _, _ = _digits()
    g = torch.Generator().manual_seed(10_000 + seed)
    bs = sizes["batch"]
    while True:
        perm = torch.randperm(len(y), generator=g)
        for i in range(0, len(perm) - bs + 1, bs):
            j = perm[i : i + bs]
            yield x[j], y[j]


# -- models -----------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def register_rotary(module: nn.Module, head_dim: int, seq: int) -> None:
    """RoPE's cos and sin for positions 0..seq-1 as the module's buffers ``cos`` and ``sin``,
    which every layer's attention reads (not saved: they follow from the sizes)."""
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    ang = torch.outer(torch.arange(seq).float(), inv)
    module.register_buffer("cos", ang.cos(), persistent=False)
    module.register_buffer("sin", ang.sin(), persistent=False)


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class LlamaAttention(nn.Module):
    """Grouped-query attention with rotary positions; Llama's parameter names, so Adam-mini
    recognises q/k/v/o."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = n_heads, n_kv_heads, dim // n_heads
        self.q_proj = nn.Linear(dim, n_heads * self.hd, bias=False)
        self.k_proj = nn.Linear(dim, n_kv_heads * self.hd, bias=False)
        self.v_proj = nn.Linear(dim, n_kv_heads * self.hd, bias=False)
        self.o_proj = nn.Linear(n_heads * self.hd, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv, self.hd).transpose(1, 2)
        q, k = _rotary(q, cos, sin), _rotary(k, cos, sin)
        rep = self.n_heads // self.n_kv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, hidden: int):
        super().__init__()
        self.input_layernorm = RMSNorm(dim)
        self.self_attn = LlamaAttention(dim, n_heads, n_kv_heads)
        self.post_attention_layernorm = RMSNorm(dim)
        self.mlp = SwiGLU(dim, hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    """Byte-level Llama: RMSNorm, SwiGLU, rotary, GQA, no biases, tied embedding."""

    def __init__(
        self,
        dim: int,
        n_layers: int,
        n_heads: int,
        n_kv_heads: int,
        hidden: int,
        seq: int,
        vocab: int = 256,
    ):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            LlamaBlock(dim, n_heads, n_kv_heads, hidden) for _ in range(n_layers)
        )
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.embed_tokens.weight
        for name, p in self.named_parameters():
            if p.dim() == 2:
                resid = name.endswith(("o_proj.weight", "down_proj.weight"))
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layers) if resid else 0.02)
        register_rotary(self, dim // n_heads, seq)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        x = self.embed_tokens(idx)
        for layer in self.layers:
            x = layer(x, self.cos[:T], self.sin[:T])
        return self.lm_head(self.norm(x))


class GRULM(nn.Module):
    """Byte-level GRU language model (stacked r/z/n gate matrices: a shape transformers lack);
    ``cell=nn.LSTM``: the LSTM one (i/f/g/o gates, 4H rows)."""

    def __init__(self, emb: int, hidden: int, layers: int, vocab: int = 256, cell: type = nn.GRU):
        super().__init__()
        self.embed = nn.Embedding(vocab, emb)
        self.rnn = cell(emb, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.embed(idx))[0])


class ResBlock(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class ResNet(nn.Module):
    """ResNet-style CNN for 8x8 digits: stem, residual stages, global pooling, linear head."""

    def __init__(self, c: int, blocks: int, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(1, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU()
        )
        self.stage1 = nn.Sequential(*(ResBlock(c) for _ in range(blocks)))
        self.down = nn.Sequential(
            nn.Conv2d(c, 2 * c, 3, stride=2, padding=1, bias=False),
            nn.BatchNorm2d(2 * c),
            nn.ReLU(),
        )
        self.stage2 = nn.Sequential(*(ResBlock(2 * c) for _ in range(blocks)))
        self.fc = nn.Linear(2 * c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stage2(self.down(self.stage1(self.stem(x))))
        return self.fc(x.mean(dim=(2, 3)))


def _mlp(sizes: dict) -> nn.Module:
    w = sizes["width"]
    return nn.Sequential(
        nn.Flatten(), nn.Linear(64, w), nn.GELU(), nn.Linear(w, w), nn.GELU(), nn.Linear(w, 10)
    )


# -- the task table ---------------------------------------------------------------------------
_LM = dict(max_bytes=4 * 2**20, batch=8, seq=64, val_batches=8)
TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        Task(
            "gpt2",
            "GPT-2-style byte LM (LayerNorm, fused qkv, biases; d=128, 2 layers)",
            "lm",
            Hyper(steps=220, lr=3e-3, evals=8),
            dict(_LM, n_layer=2, n_head=4, n_embd=128),
        ),
        Task(
            "llama",
            "Llama-style byte LM (RMSNorm, SwiGLU 512, rotary, GQA 6/2 heads, d=192)",
            "lm",
            Hyper(steps=180, lr=3e-3, evals=8),
            dict(_LM, dim=192, n_layers=2, n_heads=6, n_kv_heads=2, hidden=512),
        ),
        Task(
            "resnet",
            "ResNet-style CNN with BatchNorm on sklearn digits (24/48 channels)",
            "cls",
            Hyper(steps=300, lr=2e-3, betas=(0.9, 0.999), evals=8),
            dict(c=24, blocks=1, batch=64),
        ),
        Task(
            "mlp",
            "MLP 64-256-256-10 (GELU) on flattened sklearn digits",
            "cls",
            Hyper(steps=800, lr=1e-3, betas=(0.9, 0.999)),
            dict(width=256, batch=64),
        ),
        Task(
            "gru",
            "GRU byte LM (embedding 64, hidden 192, 1 layer)",
            "lm",
            Hyper(steps=220, lr=3e-3, evals=8),
            dict(_LM, emb=64, hidden=192, layers=1, batch=16, seq=48),
        ),
    )
}


DEFAULT_TASKS: tuple[str, ...] = tuple(TASKS)
"""What ``compare`` runs without ``--tasks``: the five dense tasks above. Tasks registered later
(``register``: the MoE LMs of ``gefen_dist.bench.moe``) are run by naming them, so the commands
recorded in results/bench/* (which name no ``--tasks``) still run what their reports hold."""

Builder = Callable[["Task", int], "Instance"]
_BUILDERS: dict[str, Builder] = {}


def register(task: Task, builder: Builder) -> None:
    """Add ``task`` to ``TASKS`` with the function that builds it (``build`` calls it for that
    name). Why a registry: a task defined in another module (``gefen_dist.bench.moe``) imports
    this one, so this one cannot import it; ``gefen_dist.bench``'s ``__init__`` registers it,
    and the suite's worker subprocesses, which import the package, find it too."""
    known = TASKS.get(task.name)
    if known is not None and (known != task or _BUILDERS.get(task.name) is not builder):
        raise ValueError(f"task {task.name!r} is already registered with other settings")
    TASKS[task.name] = task
    _BUILDERS[task.name] = builder


def scaled(task: Task, scale: float, smoke: bool = False) -> Task:
    """The same task with ``scale`` x the steps; ``smoke`` also cuts the validation set and
    the number of evaluations (an end-to-end check, not a measurement)."""
    if scale == 1.0 and not smoke:
        return task
    h = dict(asdict(task.hyper), steps=max(10, int(task.hyper.steps * scale)))
    sizes = dict(task.sizes)
    if smoke:
        h["evals"] = min(task.hyper.evals, 4)
        if "val_batches" in sizes:
            sizes["val_batches"] = 2
    return Task(task.name, task.label, task.kind, Hyper(**h), sizes)


@dataclass
class Instance:
    """One task built for one seed: what the training loop needs."""

    model: nn.Module
    batches: Iterator[Batch]
    loss: Callable[[nn.Module, Batch], torch.Tensor]
    evaluate: Callable[[nn.Module], dict[str, float]]
    model_info: dict[str, int]
    """What Adam-mini needs to find attention heads (dim, n_heads, n_kv_heads)."""


def lm_instance(model: nn.Module, sizes: dict, seed: int, info: dict) -> Instance:
    """An LM task's ``Instance``: its batches of the corpus from the seed, the next-byte loss,
    and the mean val loss over its fixed validation set (every LM task, here and registered)."""
    val = _lm_val(sizes)

    @torch.no_grad()
    def evaluate(m: nn.Module) -> dict[str, float]:
        m.eval()
        loss = sum(float(_lm_loss(m, b)) for b in val) / len(val)
        m.train()
        return dict(val_loss=loss)

    return Instance(model, _lm_batches(sizes, seed), _lm_loss, evaluate, info)


def _lm_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    out = model(x)
    logits = out[0] if isinstance(out, tuple) else out
    # the loss in fp32 for a bf16 model (its logits as computed): a no-op for an fp32 one
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))


def _cls_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def build(task: Task, seed: int) -> Instance:
    if task.name in _BUILDERS:
        return _BUILDERS[task.name](task, seed)
    s = task.sizes
    torch.manual_seed(seed)
    info: dict[str, int] = {}
    if task.name == "gpt2":
        model: nn.Module = GPT(
            GPTConfig(
                block_size=s["seq"], n_layer=s["n_layer"], n_head=s["n_head"], n_embd=s["n_embd"]
            )
        )
        info = dict(dim=s["n_embd"], n_heads=s["n_head"], n_kv_heads=s["n_head"])
    elif task.name == "llama":
        model = Llama(s["dim"], s["n_layers"], s["n_heads"], s["n_kv_heads"], s["hidden"], s["seq"])
        info = dict(dim=s["dim"], n_heads=s["n_heads"], n_kv_heads=s["n_kv_heads"])
    elif task.name == "gru":
        model = GRULM(s["emb"], s["hidden"], s["layers"])
    elif task.name == "resnet":
        model = ResNet(s["c"], s["blocks"])
    elif task.name == "mlp":
        model = _mlp(s)
    else:
        raise ValueError(f"unknown task {task.name!r}; known: {', '.join(TASKS)}")

    if task.kind == "lm":
        return lm_instance(model, s, seed, info)

    _, _, xv, yv = _digits()

    @torch.no_grad()
    def evaluate_cls(m: nn.Module) -> dict[str, float]:
        m.eval()
        logits = m(xv)
        m.train()
        return dict(
            val_loss=float(F.cross_entropy(logits, yv)),
            val_acc=float((logits.argmax(1) == yv).float().mean()),
        )

    return Instance(model, _cls_batches(s, seed), _cls_loss, evaluate_cls, info)
