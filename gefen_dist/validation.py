"""A param group's settings, checked before anything is built from them.

Why here and not at use: a value that only fails later (``bits=4.0`` at the codebook,
``lr="3e-4"`` at the first scheduler) would stop a run after its process groups and first
gradients, far from the line that set it; refused at construction, the error names the setting.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import torch


def check_hyper(g: dict[str, Any]) -> None:
    """Raise, naming the setting, unless every value of group ``g`` is one Gefen can run."""
    lr = real("lr", g["lr"], tensor=True)
    betas = g["betas"]
    if isinstance(betas, (str, bytes)) or not isinstance(betas, Sequence) or len(betas) != 2:
        raise ValueError(f"Invalid betas: {betas!r} (must be a pair (beta1, beta2))")
    b1, b2 = (real(f"betas[{i}]", b, tensor=True) for i, b in enumerate(betas))
    eps, wd = real("eps", g["eps"]), real("weight_decay", g["weight_decay"])
    if not lr >= 0.0:
        raise ValueError(f"Invalid lr: {lr} (must be >= 0)")
    if not 0.0 <= b1 < 1.0:
        raise ValueError(f"Invalid betas[0]: {b1} (must be in [0, 1))")
    if not 0.0 <= b2 < 1.0:
        raise ValueError(f"Invalid betas[1]: {b2} (must be in [0, 1))")
    if not eps >= 0.0:
        raise ValueError(f"Invalid eps: {eps} (must be >= 0)")
    if not wd >= 0.0:
        raise ValueError(f"Invalid weight_decay: {wd} (must be >= 0)")
    bits = g["bits"]
    if isinstance(bits, bool) or not isinstance(bits, numbers.Integral) or bits not in (4, 8):
        raise ValueError(f"Invalid bits: {bits!r} (must be the integer 4 or 8)")
    sr = g.get("bf16_stochastic_round", False)
    if not isinstance(sr, bool):
        raise ValueError(
            f"Invalid bf16_stochastic_round: {sr!r} ({type(sr).__name__}; must be True or False)"
        )


def is_real(value: Any) -> bool:
    """A plain number for a setting; bool is an int to Python, never a learning rate."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def real(name: str, value: Any, tensor: bool = False) -> float:
    if tensor and isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"{name} must be a number or a one-element tensor, got shape {tuple(value.shape)}"
            )
        return float(value)
    if not is_real(value):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    return float(value)
