"""Optimizer state, in GiB, of GPT-2 124M-1.5B, Llama-3 1B/8B and the mixture of experts
Qwen1.5-MoE-A2.7B, for Gefen and every peer.

Why measured this way: the peers' state depends only on shapes (and, for Adam-mini, on names
and heads), but Gefen's depends on the block size its partition picks from a real first
gradient. So every number is the state an optimizer really allocates, counted by
``peers.state_bytes``, after a real ``step()`` on the real first gradient of that tensor:

1. Build ONE transformer layer with the embeddings and the head at full width (the real names:
   ``gefen_dist.demo.model.GPT`` for GPT-2, ``transformers``' Llama for Llama-3) and run one real
   forward/backward on a short batch of real text (the Python stdlib source; words hashed into
   the vocabulary, a stand-in for BPE since no tokenizer files are here).
2. For each tensor, one at a time: each peer is built on a lone parameter of that name and shape,
   given that tensor's gradient, stepped once, counted and freed; Gefen's state is what its
   first step allocates, from its own partition of that gradient (``gefen_state``; the tests
   check it equals a real ``Gefen.step()``, whose codebook learning takes ~1.5 s per million
   elements here, too slow for 1.3B-element tensors on 2 cores).
3. The model's state = embeddings + head + (layer-0 state x number of layers): an extrapolation
   by layer count, exact for the peers (every layer has the same shapes) and for Gefen as far as
   every layer's first gradient picks the blocks layer 0's did (``--full`` measures every layer
   of a model that fits, which tests that).

Memory: the vocabulary matrices (Llama-3-8B: 2 x 128256 x 4096) are frozen in the backward and
their gradients formed from the captured upstream gradients, the same products autograd forms
(``dlogits^T h`` and a scatter of d(embedding output)); peers other than Gefen are measured on
row chunks of tensors over ``CHUNK_NUMEL`` elements (exact for per-element and fixed-block state:
one chunk is stepped and counted K times); torchao's update arithmetic is skipped
(its state is allocated by its own ``step()`` before the update; eager torchao on CPU takes ~1 s
per million elements). Each model runs in its own subprocess; its peak RSS is reported.

The MoE row, ``qwen1.5-moe-a2.7b``, has the shapes of Qwen's Qwen1.5-MoE-A2.7B as its
published ``config.json`` (Hugging Face ``Qwen/Qwen1.5-MoE-A2.7B``, model type ``qwen2_moe``)
gives them: hidden size 2048, 24 layers, every one sparse (``decoder_sparse_step`` 1), 16
attention heads and 16 key/value heads (head dim 128) with q/k/v biases, 60 routed experts of
SwiGLU width 1408 (``moe_intermediate_size``), top 4 without renormalisation
(``norm_topk_prob`` false), one shared SwiGLU expert of width 5632
(``shared_expert_intermediate_size``) scaled by a sigmoid gate (a (1, 2048) weight), a router
(60, 2048), vocabulary 151936, input embedding and head untied. That is 14,315,784,192
parameters, the model card's "14.3B parameters in total". Its routed experts are stored as
torchtitan's ``GroupedExperts`` store them, one 3-D weight per projection and layer: ``w1`` /
``w3`` (60, 1408, 2048) and ``w2`` (60, 2048, 1408), 519M of each layer's 571M parameters
(Hugging Face keeps a ``ModuleList`` or a fused (E, 2F, D) weight instead; the grouped layout
is the one large MoE trainings shard). One layer is built at full width with all 60 experts
(571M parameters, 2.3 GB in fp32, with the 2 x 311M vocabulary matrices: fits 24 GiB), its
first gradient comes from one real forward/backward as for the dense models (the top-4 routing
of 2 x 128 tokens: an expert that no token reaches has an all-zero first gradient slice, as in
a user's first step), and layer 0 is multiplied by 24 like every other model's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from gefen_dist.bench import peers, store

GiB = 2**30
CHUNK_NUMEL = 1 << 24
PAPER = {"gpt2-1.5b": {"adamw": 11.2, "gefen": 1.5}}
"""The paper's anchor (GiB of optimizer state, GPT-2 1.5B), shown next to our numbers."""


@dataclass(frozen=True)
class Shape:
    """A model's shapes; ``kind`` is ``gpt2`` (fused qkv, tied, learned positions), ``llama`` or
    ``moe`` (``QwenMoE``: Qwen2-MoE with routed experts grouped as torchtitan stores them)."""

    name: str
    kind: str
    d: int
    n_layer: int
    n_head: int
    vocab: int
    n_kv_head: int = 0
    ffn: int = 0
    tied: bool = True
    ctx: int = 1024
    n_experts: int = 0
    """``kind`` ``moe``: routed experts per layer, each a SwiGLU of width ``expert_ffn``."""
    top_k: int = 0
    expert_ffn: int = 0
    shared_ffn: int = 0
    """``kind`` ``moe``: the shared expert's SwiGLU width (0: none)."""
    qkv_bias: bool = False


MODELS: dict[str, Shape] = {
    s.name: s
    for s in (
        Shape("gpt2-124m", "gpt2", 768, 12, 12, 50257),
        Shape("gpt2-355m", "gpt2", 1024, 24, 16, 50257),
        Shape("gpt2-774m", "gpt2", 1280, 36, 20, 50257),
        Shape("gpt2-1.5b", "gpt2", 1600, 48, 25, 50257),
        Shape("llama3-1b", "llama", 2048, 16, 32, 128256, 8, 8192, True),
        Shape("llama3-8b", "llama", 4096, 32, 32, 128256, 8, 14336, False),
        Shape(
            "qwen1.5-moe-a2.7b",
            "moe",
            2048,
            24,
            16,
            151936,
            n_kv_head=16,
            tied=False,
            n_experts=60,
            top_k=4,
            expert_ffn=1408,
            shared_ffn=5632,
            qkv_bias=True,
        ),
    )
}


class _SwiGLU(nn.Module):
    """A dense SwiGLU with Hugging Face's names (the shared expert)."""

    def __init__(self, d: int, f: int):
        super().__init__()
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class GroupedExperts(nn.Module):
    """torchtitan's storage: ``w1`` / ``w3`` (E, F, D), ``w2`` (E, D, F); expert e computes
    ``w2[e] @ (silu(w1[e] @ x) * (w3[e] @ x))``."""

    def __init__(self, d: int, f: int, n: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n, f, d))
        self.w3 = nn.Parameter(torch.empty(n, f, d))
        self.w2 = nn.Parameter(torch.empty(n, d, f))
        for w in (self.w1, self.w2, self.w3):
            nn.init.normal_(w, std=0.02)

    def forward(self, x: torch.Tensor, chosen: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Sum over each token's chosen experts of weight x expert(token); ``chosen`` and
        ``weight`` (N, k). The tokens are padded per expert to (E, C, D) and go through three
        batched products, so the backward forms each weight's gradient once (indexing
        ``w1[e]`` per expert would form a full (E, F, D) gradient per expert)."""
        n_exp = self.w1.shape[0]
        e_flat = chosen.reshape(-1)
        order = torch.argsort(e_flat, stable=True)
        e_sorted = e_flat[order]
        tok = order // chosen.shape[1]
        counts = torch.bincount(e_flat, minlength=n_exp)
        starts = torch.cumsum(counts, 0) - counts
        pos = torch.arange(len(e_sorted)) - starts[e_sorted]
        xp = x.new_zeros(n_exp, int(counts.max()), x.shape[-1])
        xp[e_sorted, pos] = x[tok]
        h = nn.functional.silu(xp @ self.w1.transpose(1, 2)) * (xp @ self.w3.transpose(1, 2))
        y = (h @ self.w2.transpose(1, 2))[e_sorted, pos]
        return torch.zeros_like(x).index_add(0, tok, y * weight.reshape(-1)[order, None])


class QwenMoEBlock(nn.Module):
    """Qwen2-MoE's sparse block (names as Hugging Face's ``Qwen2MoeSparseMoeBlock``, the routed
    experts grouped): softmax router, top-k without renormalisation, plus the shared expert
    times sigmoid(shared_expert_gate(x))."""

    def __init__(self, s: Shape):
        super().__init__()
        self.top_k = s.top_k
        self.gate = nn.Linear(s.d, s.n_experts, bias=False)
        self.experts = GroupedExperts(s.d, s.expert_ffn, s.n_experts)
        self.shared_expert = _SwiGLU(s.d, s.shared_ffn)
        self.shared_expert_gate = nn.Linear(s.d, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weight, chosen = nn.functional.softmax(self.gate(x), dim=-1).topk(self.top_k, dim=-1)
        out = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return (out + self.experts(x, chosen, weight)).reshape(shape)


class _Attention(nn.Module):
    """Multi-/grouped-query attention with rotary positions, Qwen2's names and q/k/v biases."""

    def __init__(self, s: Shape):
        super().__init__()
        self.h, self.kv, self.hd = s.n_head, s.n_kv_head or s.n_head, s.d // s.n_head
        self.q_proj = nn.Linear(s.d, self.h * self.hd, bias=s.qkv_bias)
        self.k_proj = nn.Linear(s.d, self.kv * self.hd, bias=s.qkv_bias)
        self.v_proj = nn.Linear(s.d, self.kv * self.hd, bias=s.qkv_bias)
        self.o_proj = nn.Linear(self.h * self.hd, s.d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        from gefen_dist.bench.tasks import _rotary

        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.h, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.kv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kv, self.hd).transpose(1, 2)
        q, k = _rotary(q, cos, sin), _rotary(k, cos, sin)
        y = nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.kv != self.h
        )
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class _QwenMoELayer(nn.Module):
    def __init__(self, s: Shape):
        super().__init__()
        from gefen_dist.bench.tasks import RMSNorm

        self.input_layernorm = RMSNorm(s.d)
        self.self_attn = _Attention(s)
        self.post_attention_layernorm = RMSNorm(s.d)
        self.mlp = QwenMoEBlock(s)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class _QwenMoEBody(nn.Module):
    def __init__(self, s: Shape, n_layer: int):
        super().__init__()
        from gefen_dist.bench.tasks import RMSNorm, register_rotary

        self.embed_tokens = nn.Embedding(s.vocab, s.d)
        self.layers = nn.ModuleList(_QwenMoELayer(s) for _ in range(n_layer))
        self.norm = RMSNorm(s.d)
        register_rotary(self, s.d // s.n_head, s.ctx)


class QwenMoE(nn.Module):
    """A Qwen2-MoE causal LM with grouped experts, under Hugging Face's parameter names
    (``model.layers.N.mlp.experts.w1`` ...): ``(logits, loss) = model(idx, targets)``."""

    def __init__(self, s: Shape, n_layer: int):
        super().__init__()
        self.model = _QwenMoEBody(s, n_layer)
        self.lm_head = nn.Linear(s.d, s.vocab, bias=False)
        if s.tied:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        T = idx.shape[1]
        m = self.model
        x = m.embed_tokens(idx)
        for layer in m.layers:
            x = layer(x, m.cos[:T], m.sin[:T])
        logits = self.lm_head(m.norm(x))
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def tokens(vocab: int, batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    """Real text as token ids: stdlib source words, each hashed (crc32) into the vocabulary."""
    from gefen_dist.demo.corpus import load_corpus

    train, _ = load_corpus(max_bytes=2 * 2**20)
    words = bytes(train.numpy()).split()
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(len(words) - seq - 1, (batch,), generator=g).tolist()
    ids = [[zlib.crc32(w) % vocab for w in words[s : s + seq + 1]] for s in starts]
    return torch.tensor(ids, dtype=torch.long)


def build_model(s: Shape, n_layer: int = 1) -> tuple[nn.Module, list[str], list[str]]:
    """(model, names of the input-embedding matrix, names of the head matrix) at full width."""
    torch.manual_seed(0)
    if s.kind == "gpt2":
        from gefen_dist.demo.model import GPT, GPTConfig

        cfg = GPTConfig(
            vocab_size=s.vocab, block_size=s.ctx, n_layer=n_layer, n_head=s.n_head, n_embd=s.d
        )
        return GPT(cfg), ["transformer.wte"], ["lm_head"]
    if s.kind == "moe":
        return QwenMoE(s, n_layer), ["model.embed_tokens"], ["lm_head"]
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=s.vocab,
        hidden_size=s.d,
        intermediate_size=s.ffn,
        num_hidden_layers=n_layer,
        num_attention_heads=s.n_head,
        num_key_value_heads=s.n_kv_head,
        tie_word_embeddings=s.tied,
        max_position_embeddings=s.ctx,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg), ["model.embed_tokens"], ["lm_head"]


def first_gradients(
    model: nn.Module, s: Shape, ids: torch.Tensor, emb: list[str], head: list[str]
) -> dict[str, torch.Tensor]:
    """One real forward/backward; returns every parameter's gradient by name.

    The vocabulary matrices are frozen during the backward (their parameters and gradients
    would not fit next to each other at 8B) and their gradients formed afterwards from the
    captured upstream gradients: exactly the sums autograd would form. The model's parameters
    are released (emptied) before that, so its weights and the vocabulary gradients are never
    held together; the model is unusable afterwards."""
    mods = dict(model.named_modules())
    emb_mod, head_mod = mods[emb[0]], mods[head[0]]
    vocab_params = {id(emb_mod.weight), id(head_mod.weight)}
    for p in model.parameters():
        p.requires_grad_(id(p) not in vocab_params)
    cap: dict[str, torch.Tensor] = {}

    def on_emb(_m, _inp, out):
        out = out.detach().requires_grad_()
        out.retain_grad()
        cap["x0"] = out
        return out

    def on_head(_m, inp, out):
        cap["h"] = inp[0].detach()
        out.retain_grad()
        cap["logits"] = out

    hooks = [emb_mod.register_forward_hook(on_emb), head_mod.register_forward_hook(on_head)]
    x, y = ids[:, :-1], ids[:, 1:]
    if s.kind in ("gpt2", "moe"):
        loss = model(x, y)[1]
    else:
        loss = model(input_ids=x, labels=ids[:, :-1].clone()).loss  # HF shifts labels itself
    loss.backward()
    for h in hooks:
        h.remove()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    tied = emb_mod.weight is head_mod.weight
    for p in model.parameters():
        p.grad = None
        p.data = torch.empty(0)
    dlog = cap["logits"].grad.reshape(-1, s.vocab)
    head_grad = dlog.t() @ cap["h"].reshape(-1, s.d)
    del dlog, cap["logits"]
    x0g = cap["x0"].grad.reshape(-1, s.d)
    emb_grad = torch.zeros(s.vocab, s.d).index_add_(0, x.reshape(-1), x0g)
    if tied:
        grads[emb[0] + ".weight"] = emb_grad.add_(head_grad)
    else:
        grads[emb[0] + ".weight"] = emb_grad
        grads[head[0] + ".weight"] = head_grad
    cap.clear()
    return grads


class _Holder(nn.Module):
    """One parameter under its model name (Adam-mini reads names)."""

    def __init__(self, name: str, p: nn.Parameter):
        super().__init__()
        *path, last = name.split(".")
        mod: nn.Module = self
        for part in path:
            child = nn.Module()
            mod.add_module(part, child)
            mod = child
        mod.register_parameter(last, p)


def _chunks(n_rows: int, numel: int, limit: int) -> int:
    """Fewest equal row chunks of at most ``limit`` elements (1 when rows do not split)."""
    for k in range(1, n_rows + 1):
        if n_rows % k == 0 and numel // k <= limit:
            return k
    return 1


def gefen_state(grad: torch.Tensor, bits: list[int]) -> dict[int, dict]:
    """Gefen's state for one tensor: what ``Gefen.step()`` allocates at its first step.

    The same rule as ``Gefen._initialize`` for a plain tensor (``partition.block_size_for`` on
    the real g0, then ``state.allocate``), without the
    codebook histogram and the update, which do not change the state's size and take ~1.5 s
    per million elements here. The partition runs once for both bit widths (it does not
    depend on them), with a 2M-element working chunk instead of 256K (same sums, 3x faster).
    ``tests/test_bench_memory.py`` checks this equals a real ``Gefen.step()``."""
    from gefen_dist.method import partition
    from gefen_dist.method import state as gstate
    from gefen_dist.method.segments import whole_tensor

    segs = whole_tensor(tuple(grad.shape))  # one segment, or one per matrix of a batch
    old = partition._CHUNK
    partition._CHUNK = {
        **old,
        grad.device.type: max(partition.chunk_elements(grad.device), 1 << 21),
    }
    try:
        blocks = [partition.block_size_for(grad)] * len(segs)
    finally:
        partition._CHUNK = old
    out = {}
    for b in bits:
        st = gstate.allocate(segs, blocks, torch.zeros(2**b), grad.device)
        out[b] = dict(
            bytes=sum(t.numel() * t.element_size() for t in st.values()),
            proper=gstate.state_bytes(st),
            blocks=sorted(set(blocks)),
            chunks=1,
        )
    return out


def peer_state(name: str, opt_name: str, grad: torch.Tensor, info: dict) -> int:
    """Bytes of ``opt.state`` after one real step of peer ``opt_name`` on a lone parameter."""
    p = nn.Parameter(torch.zeros_like(grad))
    holder = _Holder(name, p)
    opt = peers.build(opt_name, holder, 1e-3, **info)
    p.grad = grad
    opt.step()
    n = peers.state_bytes(opt)
    p.grad = None
    return n


def measure_tensor(
    name: str, grad: torch.Tensor, optimizers: list[str], info: dict, chunk_numel: int = CHUNK_NUMEL
) -> dict[str, dict]:
    """State bytes of each optimizer for one tensor, given its real first gradient.

    Peers on a tensor over ``chunk_numel`` elements: it is split into K equal row chunks, one
    is stepped and its state counted K times (the peers' state depends on shape only, so K
    identical chunks hold the same; per-tensor constants and Adafactor's/SM3's column
    accumulators are then counted K times, a few KiB)."""
    out: dict[str, dict] = {}
    bits = [int(o[5:]) for o in optimizers if o in ("gefen4", "gefen8")]
    if bits:
        for b, rec in gefen_state(grad, bits).items():
            out[f"gefen{b}"] = rec
    for opt_name in optimizers:
        if opt_name in out:
            continue
        k = _chunks(grad.shape[0], grad.numel(), chunk_numel) if grad.dim() > 1 else 1
        piece = grad[: grad.shape[0] // k] if k > 1 else grad
        try:
            out[opt_name] = dict(bytes=k * peer_state(name, opt_name, piece, info), chunks=k)
        except peers.Unavailable as e:
            out[opt_name] = dict(error=str(e))
        except RuntimeError as e:  # a peer whose step cannot take this shape (Adam-mini: 3-D)
            out[opt_name] = dict(error=f"{name} {tuple(grad.shape)}: {type(e).__name__}: {e}")
    return {o: out[o] for o in optimizers}


def _is_layer(name: str) -> bool:
    return ".h.0." in name or ".layers.0." in name


def measure_model(
    s: Shape, optimizers: list[str], batch: int = 2, seq: int = 128, full: bool = False
) -> dict:
    """Measure one model: one layer (or, with ``full``, every layer) at full width."""
    t0 = time.perf_counter()
    model, emb, head = build_model(s, s.n_layer if full else 1)
    info = dict(dim=s.d, n_heads=s.n_head, n_kv_heads=s.n_kv_head or s.n_head)
    ids = tokens(s.vocab, batch, min(seq, s.ctx))
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    grads = first_gradients(model, s, ids, emb, head)
    print(
        f"  {s.name}: backward done at {time.perf_counter() - t0:.0f} s",
        file=sys.stderr,
        flush=True,
    )
    del model
    rows = []
    for name in list(grads):
        g = grads.pop(name)
        mult = 1 if full or not _is_layer(name) else s.n_layer
        t1 = time.perf_counter()
        res = measure_tensor(name, g, optimizers, info)
        print(
            f"  {name} {tuple(g.shape)}: {time.perf_counter() - t1:.1f} s",
            file=sys.stderr,
            flush=True,
        )
        rows.append(
            dict(name=name, shape=shapes[name], numel=g.numel(), times=mult, **{"state": res})
        )
        del g
    totals: dict[str, dict] = {}
    for o in optimizers:
        errs = [r["state"][o]["error"] for r in rows if "error" in r["state"][o]]
        if errs:
            totals[o] = dict(error=errs[0])
            continue
        totals[o] = dict(bytes=sum(r["state"][o]["bytes"] * r["times"] for r in rows))
    params = sum(r["numel"] * r["times"] for r in rows)
    return dict(
        model=asdict(s),
        params=params,
        tokens=list(ids.shape),
        full=full,
        tensors=rows,
        totals=totals,
        wall_s=time.perf_counter() - t0,
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    )


def _child_env() -> dict:
    # torchao's update is skipped (see module docstring); dynamo off keeps its import cheap
    return {
        **os.environ,
        "TORCHDYNAMO_DISABLE": "1",
        "OMP_NUM_THREADS": "2",
        "TRANSFORMERS_VERBOSITY": "error",
    }


def _skip_torchao_update() -> None:
    try:
        import torchao.optim.adam as ta
    except Exception:  # torchao missing: peers.build reports it Unavailable
        return
    ta.single_param_adam = lambda *a, **k: None


def run_model(
    name: str, optimizers: list[str], out: Path, full: bool = False, batch: int = 2, seq: int = 128
) -> dict:
    """Measure ``name`` in a fresh subprocess (its own peak RSS); returns its record."""
    path = out / f"{name}{'_full' if full else ''}.json"
    cmd = [
        sys.executable,
        "-m",
        "gefen_dist.bench.memory",
        "--child",
        name,
        "--json",
        str(path),
        "--optimizers",
        ",".join(optimizers),
        "--batch",
        str(batch),
        "--seq",
        str(seq),
    ]
    if full:
        cmd.append("--all-layers")
    subprocess.run(cmd, check=True, env=_child_env())
    return json.loads(path.read_text())


def gib(b: float) -> float:
    return b / GiB


def table(records: list[dict], optimizers: list[str]) -> str:
    """Markdown: GiB of state per model and optimizer, AdamW multiple, paper anchor."""
    head = "| model | params | " + " | ".join(peers.PEERS[o].label for o in optimizers)
    lines = [head + " | peak RSS |", "|---|---:|" + "---:|" * (len(optimizers) + 1)]
    for r in records:
        cells = []
        for o in optimizers:
            t = r["totals"][o]
            cells.append("n/a" if "error" in t else f"{gib(t['bytes']):.3f}")
        name = r["model"]["name"] + (" (all layers)" if r["full"] else "")
        lines.append(
            f"| {name} | {r['params'] / 1e6:,.0f}M | "
            + " | ".join(cells)
            + f" | {gib(r['peak_rss_bytes']):.1f} |"
        )
    lines.append("")
    lines.append("Bytes per parameter:")
    lines.append("")
    lines.append(head + " |")
    lines.append("|---|---:|" + "---:|" * len(optimizers))
    for r in records:
        cells = []
        for o in optimizers:
            t = r["totals"][o]
            cells.append("n/a" if "error" in t else f"{t['bytes'] / r['params']:.3f}")
        name = r["model"]["name"] + (" (all layers)" if r["full"] else "")
        lines.append(f"| {name} | {r['params'] / 1e6:,.0f}M | " + " | ".join(cells) + " |")
    for r in records:
        for o in optimizers:
            if "error" in r["totals"][o]:
                lines.append("")
                lines.append(
                    f"n/a, {r['model']['name']}, {peers.PEERS[o].label}: "
                    f"{r['totals'][o]['error'][:300]}"
                )
    for r in records:
        anchor = PAPER.get(r["model"]["name"])
        if anchor and not r["full"]:
            t = r["totals"]
            ours = ", ".join(
                f"{peers.PEERS[o].label} {gib(t[o]['bytes']):.2f}"
                for o in ("adamw", "gefen8", "gefen4")
                if "bytes" in t.get(o, {})
            )
            lines.append("")
            lines.append(
                f"Paper, {r['model']['name']}: AdamW {anchor['adamw']} GiB -> Gefen "
                f"{anchor['gefen']} GiB. Measured here: {ours} GiB."
            )
    return "\n".join(lines)


def blocks_table(records: list[dict]) -> str:
    """Gefen's chosen block sizes per tensor of layer 0 and the vocabulary matrices."""
    lines = ["| model | tensor | shape | Gefen 4-bit B | 8-bit B |", "|---|---|---|---|---|"]
    for r in records:
        if r["full"]:
            continue
        for t in r["tensors"]:
            st = t["state"]
            b4 = st.get("gefen4", {}).get("blocks", "-")
            b8 = st.get("gefen8", {}).get("blocks", "-")
            lines.append(
                f"| {r['model']['name']} | {t['name']} | {tuple(t['shape'])} | {b4} | {b8} |"
            )
    return "\n".join(lines)


def plot(records: list[dict], optimizers: list[str], path: Path) -> None:
    """Grouped bars, log GiB, one group per model, the paper's anchor as markers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [r for r in records if not r["full"]]
    fig, ax = plt.subplots(figsize=(13, 6))
    width = 0.85 / len(optimizers)
    cmap = plt.get_cmap("tab10")
    for j, o in enumerate(optimizers):
        xs, ys = [], []
        for i, r in enumerate(recs):
            t = r["totals"][o]
            if "bytes" in t:
                xs.append(i + (j - (len(optimizers) - 1) / 2) * width)
                ys.append(gib(t["bytes"]))
        hatch = "//" if o.startswith("gefen") else None
        ax.bar(
            xs,
            ys,
            width,
            label=peers.PEERS[o].label,
            color=cmap(j % 10),
            hatch=hatch,
            edgecolor="black",
            linewidth=0.4,
        )
    for i, r in enumerate(recs):
        anchor = PAPER.get(r["model"]["name"])
        if anchor:
            ax.plot([i - 0.45, i + 0.45], [anchor["adamw"]] * 2, "k--", lw=1)
            ax.plot([i - 0.45, i + 0.45], [anchor["gefen"]] * 2, "k:", lw=1.5)
            ax.annotate(
                f"paper: AdamW {anchor['adamw']} GiB",
                (i, anchor["adamw"] * 1.15),
                ha="center",
                fontsize=8,
            )
            ax.annotate(
                f"paper: Gefen {anchor['gefen']} GiB",
                (i, anchor["gefen"] * 1.15),
                ha="center",
                fontsize=8,
            )
    ax.set_xticks(range(len(recs)))
    ax.set_xticklabels([f"{r['model']['name']}\n{r['params'] / 1e9:.2f}B params" for r in recs])
    ax.set_yscale("log")
    ax.set_ylabel("optimizer state (GiB, log scale)")
    ax.set_title(
        "Optimizer state by model: each tensor's state measured after one real step on "
        "its real first gradient;\nlayer 0 x number of layers (an extrapolation), "
        "plus embeddings and head",
        fontsize=11,
    )
    ax.grid(axis="y", which="both", alpha=0.3)
    ax.legend(ncol=3, fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/bench/memory")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--optimizers", default=",".join(peers.DEFAULT))
    ap.add_argument(
        "--full",
        default="gpt2-124m",
        help="models also measured with every layer (check of the layer scaling)",
    )
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    ap.add_argument("--all-layers", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument(
        "--replot",
        action="store_true",
        help="rewrite memory.md and memory.png from --out's memory.json",
    )
    args = ap.parse_args(argv)
    optimizers = [o for o in args.optimizers.split(",") if o]
    if args.child:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
        _skip_torchao_update()
        rec = measure_model(
            MODELS[args.child], optimizers, args.batch, args.seq, full=args.all_layers
        )
        Path(args.json).write_text(json.dumps(rec, indent=1))
        return
    out = Path(args.out)
    if args.replot:
        data = json.loads((out / "memory.json").read_text())
        records = []
        for r in data["records"]:  # the per-model files are the source (a model may be rerun)
            f = out / f"{r['model']['name']}{'_full' if r['full'] else ''}.json"
            records.append(json.loads(f.read_text()) if f.exists() else r)
        _write(out, records, data["optimizers"])
        return
    out.mkdir(parents=True, exist_ok=True)
    records = []
    todo = [(m, False) for m in args.models.split(",") if m]
    todo += [(m, True) for m in args.full.split(",") if m]
    for m, full in todo:
        t = time.perf_counter()
        print(f"measuring {m}{' (all layers)' if full else ''} ...", flush=True)
        records.append(run_model(m, optimizers, out, full, args.batch, args.seq))
        print(
            f"  done in {time.perf_counter() - t:.0f} s, peak RSS "
            f"{gib(records[-1]['peak_rss_bytes']):.2f} GiB",
            flush=True,
        )
    _write(out, records, optimizers)


def _write(out: Path, records: list[dict], optimizers: list[str]) -> None:
    """memory.md, memory.json and memory.png from the per-model records."""
    md = table(records, optimizers)
    rev = store.revision()
    meta = dict(
        command="python -m gefen_dist.bench memory "
        + " ".join(sys.argv[2:] if sys.argv[1:2] == ["memory"] else sys.argv[1:]),
        revision=rev["code"],
        head=rev["head"],
        machine=f"{platform.machine()}, {store.cpu_model()}, {os.cpu_count()} cores",
        torch=torch.__version__,
    )
    head = (
        f"Command: `{meta['command'].strip()}`  \nCode revision (last commit touching "
        f"`gefen_dist/` or `csrc/`): `{meta['revision']}`, HEAD `{meta['head']}`  \nMachine: "
        f"{meta['machine']}, torch {meta['torch']}\n\n"
    )
    blocks = "\n\nGefen's blocks:\n\n" + blocks_table(records) + "\n"
    (out / "memory.md").write_text(head + md + blocks)
    (out / "memory.json").write_text(
        json.dumps(dict(meta=meta, records=records, paper=PAPER, optimizers=optimizers), indent=1)
    )
    plot(records, optimizers, out / "memory.png")
    print(md)


if __name__ == "__main__":
    main()
