"""The optimizers Gefen is compared with, built one way and measured one way.

Why one module: a comparison is only fair when every optimizer sees the same parameters, the
same hyperparameters and the same lr schedule, and when its state is counted the same way. Peers
come from their PyPI packages; one that is missing or fails to build raises ``Unavailable`` with
the reason, so a report lists it as skipped instead of dying.

Counting: every tensor reachable from ``opt.state`` (quantised tensor subclasses unpacked into
the plain tensors that hold their storage), each storage once (bitsandbytes and torchao share
their quantisation maps), step counters and maps included. Nothing is estimated.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


class Unavailable(RuntimeError):
    """A peer that cannot run here; the message says why."""


@dataclass(frozen=True)
class Peer:
    name: str
    label: str
    momentum: bool
    """Keeps a first moment (the peers Gefen's memory goal is measured against)."""
    package: str
    build: Callable[..., torch.optim.Optimizer] = field(repr=False)
    lr_scale: float = 1.0
    """Multiplies the task's AdamW lr; 1 for every AdamW-like method (same lr, same schedule)."""


def _adamw(params, model, lr, betas, eps, weight_decay, **_):
    return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


def _named(params, model):
    """Named parameters when ``params`` are the model's own, so memory_report names the
    tensors; ``params`` otherwise."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return named if [id(p) for p in params] == [id(p) for _, p in named] else params


def _gefen(bits):
    def build(params, model, lr, betas, eps, weight_decay, **_):
        from gefen_dist import Gefen

        return Gefen(
            _named(params, model), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bits=bits
        )

    return build


def _gefen_bf16(stochastic: bool):
    """Gefen 4-bit on pure-bf16 weights: the model is cast to bf16 here (weights, hence
    gradients and activations; no fp32 master), written back to nearest or, with
    ``stochastic``, with ``bf16_stochastic_round`` (docs/bf16.md)."""

    def build(params, model, lr, betas, eps, weight_decay, **_):
        from gefen_dist import Gefen

        model.to(torch.bfloat16)  # in place: ``params`` are the same Parameter objects
        return Gefen(
            _named(params, model),
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            bits=4,
            bf16_stochastic_round=stochastic,
        )

    return build


def _bnb8(params, model, lr, betas, eps, weight_decay, **_):
    bnb = _import("bitsandbytes")
    return bnb.optim.AdamW8bit(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


def _torchao(bits):
    def build(params, model, lr, betas, eps, weight_decay, **_):
        optim = _import("torchao.optim")
        cls = optim.AdamW8bit if bits == 8 else optim.AdamW4bit
        return cls(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

    return build


def _adam_mini(
    params, model, lr, betas, eps, weight_decay, dim=None, n_heads=None, n_kv_heads=None, **_
):
    mod = _import("adam_mini")
    kw = {}
    if dim is not None:
        kw = dict(dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads or n_heads)
    # Adam-mini reads the module names to find embeddings, heads and attention
    return mod.Adam_mini(
        model.named_parameters(),
        lr=lr,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
        verbose=False,
        **kw,
    )


def _adafactor(params, model, lr, betas, eps, weight_decay, **_):
    return torch.optim.Adafactor(params, lr=lr, weight_decay=weight_decay)


def _sm3(params, model, lr, betas, eps, weight_decay, **_):
    mod = _import("pytorch_optimizer")
    return mod.SM3(params, lr=lr, momentum=betas[0])


LR_SCALE_NOTE = (
    "checked on the gpt2 and resnet tasks at half length, seed 0, lr x {1, 10, 30, 100}: "
    "Adafactor's lr is relative to each parameter's RMS (torch.optim.Adafactor), x30 was best "
    "on both (gpt2 val 4.20/2.18/2.08/2.84, resnet 1.46/0.027/0.016/0.023; AdamW 2.77, 0.046); "
    "SM3 accumulates squared gradients without decay (Adagrad-like), x10 best on gpt2 "
    "(3.44/3.34/3.52/3.82), x30 on resnet (1.04/0.064/0.027/0.038); x10 kept"
)
"""Why Adafactor and SM3 run with the lr scale they do (the report quotes it)."""

PEERS: dict[str, Peer] = {
    p.name: p
    for p in (
        Peer("adamw", "AdamW", True, "torch", _adamw),
        Peer("gefen8", "Gefen 8-bit", True, "gefen_dist", _gefen(8)),
        Peer("gefen4", "Gefen 4-bit", True, "gefen_dist", _gefen(4)),
        Peer("gefen4_bf16", "Gefen 4-bit, bf16 weights", True, "gefen_dist", _gefen_bf16(False)),
        Peer(
            "gefen4_bf16_sr",
            "Gefen 4-bit, bf16 weights, stochastic rounding",
            True,
            "gefen_dist",
            _gefen_bf16(True),
        ),
        Peer("bnb_adamw8bit", "bitsandbytes AdamW8bit", True, "bitsandbytes", _bnb8),
        Peer("torchao_adamw8bit", "torchao AdamW8bit", True, "torchao", _torchao(8)),
        Peer("torchao_adamw4bit", "torchao AdamW4bit", True, "torchao", _torchao(4)),
        Peer("adam_mini", "Adam-mini", True, "adam-mini", _adam_mini),
        Peer("adafactor", "Adafactor (torch, no momentum)", False, "torch", _adafactor, 30.0),
        Peer("sm3", "SM3 (momentum 0.9)", True, "pytorch-optimizer", _sm3, 10.0),
    )
}

DEFAULT: tuple[str, ...] = tuple(n for n in PEERS if not n.startswith("gefen4_bf16"))
"""What the suite, the memory and the capacity benchmarks compare unless told otherwise: the
optimizers on fp32 weights. The bf16-weight variants change the model too (``docs/bf16.md``)."""


def build(
    name: str,
    model: nn.Module,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    params: Iterable[Any] | None = None,
    **model_info: Any,
) -> torch.optim.Optimizer:
    """Build optimizer ``name`` over ``model``'s trainable parameters.

    ``model_info`` (``dim``, ``n_heads``, ``n_kv_heads``) is what Adam-mini needs to find
    attention heads; the others ignore it. Raises ``Unavailable`` when the package is missing
    or the optimizer refuses the model."""
    if name not in PEERS:
        raise ValueError(f"unknown optimizer {name!r}; known: {', '.join(PEERS)}")
    peer = PEERS[name]
    if params is None:
        params = [p for p in model.parameters() if p.requires_grad]
    try:
        return peer.build(
            params, model, lr * peer.lr_scale, tuple(betas), eps, weight_decay, **model_info
        )
    except Unavailable:
        raise
    except Exception as e:  # a peer that refuses this model is skipped, with its reason
        raise Unavailable(f"{peer.label}: {type(e).__name__}: {e}") from e


def _import(module: str):
    import importlib

    try:
        return importlib.import_module(module)
    except Exception as e:
        raise Unavailable(f"{module} does not import: {type(e).__name__}: {e}") from e


def set_lr(opt: torch.optim.Optimizer, factor: float) -> None:
    """Set every group's lr to ``factor`` x its initial lr, whether lr is a float or (torchao,
    Adam-mini) a tensor the optimizer checks stays a tensor."""
    for g in opt.param_groups:
        base = g.setdefault("initial_lr", float(g["lr"]))
        if isinstance(g["lr"], torch.Tensor):
            g["lr"].fill_(base * factor)
        else:
            g["lr"] = base * factor


def _leaves(t: torch.Tensor) -> list[torch.Tensor]:
    from gefen_dist.distributed.sharding import is_dtensor, local

    if is_dtensor(t):  # FSDP2 state: count this rank's shard, not the global tensor
        return _leaves(local(t))
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return [leaf for n in names for leaf in _leaves(getattr(t, n))]
    return [t]


def _walk(obj: Any) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield from _leaves(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _walk(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _walk(v)


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of storage held by ``opt.state``, every storage counted once."""
    seen: dict[tuple[str, int], int] = {}
    for t in _walk(list(opt.state.values())):
        if t.device.type == "meta":
            seen[("meta", id(t))] = t.numel() * t.element_size()
            continue
        s = t.untyped_storage()
        key = (str(t.device), s.data_ptr())
        seen[key] = max(seen.get(key, 0), s.nbytes())
    return sum(seen.values())


def weight_bytes(model: nn.Module) -> tuple[int, int]:
    """Bytes of the trainable weights and of their gradients (a gradient takes its weight's
    dtype): with the optimizer state, the whole training state."""
    ps = [p for p in model.parameters() if p.requires_grad]
    return sum(p.numel() * p.element_size() for p in ps), sum(
        p.numel() * p.element_size() for p in ps if p.grad is not None
    )


def trainable_numel(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
