"""A DeepSpeed JSON config that names Gefen: ``"optimizer": {"type": "Gefen", "params": {...}}``.

Launchers that build the optimizer from the config (``deepspeed.initialize`` without
``optimizer=``, Accelerate's ``DummyOptim``, the Hugging Face Trainer's ``--deepspeed``) then
get Gefen; ``patches`` makes DeepSpeed call ``from_config`` for that type (in any case).
``params`` are Gefen's keyword arguments; any other key is refused with the list of valid ones
(DeepSpeed would pass it on as a TypeError), and so is a value of the wrong JSON type, by its
key (an "auto" only Accelerate or the Trainer resolve).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ...optimizer import Gefen
from ...validation import is_real

__all__ = ["OPTIMIZER_TYPE", "from_config"]

OPTIMIZER_TYPE = "gefen"
"""``optimizer.type`` of a DeepSpeed config that selects Gefen (matched in any case)."""


def _config_keys() -> list[str]:
    sig = inspect.signature(Gefen.__init__)
    return [n for n in sig.parameters if n not in ("self", "params")]


_NUMBERS = ("lr", "eps", "weight_decay")
_FLAGS = ("amsgrad", "maximize", "capturable", "differentiable", "foreach", "fused")
_AUTO_FILLED_BY = {
    "lr": "Accelerate (from DummyOptim) and the Hugging Face Trainer",
    "weight_decay": "Accelerate (from DummyOptim) and the Hugging Face Trainer",
    "betas": "the Hugging Face Trainer",
    "eps": "the Hugging Face Trainer",
}


def _is_number(v: Any) -> bool:
    return isinstance(v, torch.Tensor) or is_real(v)


def _check_types(kwargs: dict[str, Any]) -> None:
    """Name the key of a value of the wrong JSON type: Gefen would fail on it with no word of
    the config (or, for a truthy string such as "auto" in a flag, not fail at all)."""
    for key, v in kwargs.items():
        if key in _NUMBERS:
            ok, want = _is_number(v), "a number"
        elif key == "betas":
            pair = isinstance(v, (list, tuple)) and len(v) == 2
            ok, want = pair and all(_is_number(b) for b in v), "a pair of numbers [beta1, beta2]"
        elif key == "bits":
            ok, want = isinstance(v, int) and not isinstance(v, bool), "the integer 4 or 8"
        elif key in _FLAGS:
            ok = isinstance(v, bool) or (v is None and key in ("foreach", "fused"))
            want = "true or false"
        else:
            continue
        if ok:
            continue
        msg = f"DeepSpeed config optimizer {{'type': 'Gefen'}}: {key!r} must be {want}, got {v!r}"
        values = v if isinstance(v, (list, tuple)) else [v]
        if any(isinstance(x, str) and x == "auto" for x in values):
            who = _AUTO_FILLED_BY.get(key)
            msg += (
                f' ("auto" is filled in by {who}; the plain deepspeed launcher and '
                "deepspeed.initialize take the value as written)"
                if who
                else f' (no launcher fills in "auto" for {key!r})'
            )
        raise ValueError(msg)


def from_config(params: Any, config_params: dict[str, Any] | None) -> Gefen:
    """Build Gefen from a DeepSpeed config's ``optimizer.params`` (lists become tuples: JSON has
    no tuples and ``betas`` is one). Unknown keys, and values of the wrong JSON type (an "auto"
    no launcher resolved, ``null``), raise ValueError naming the key."""
    kwargs = dict(config_params or {})
    valid = _config_keys()
    unknown = sorted(k for k in kwargs if k not in valid)
    if unknown:
        raise ValueError(
            f"DeepSpeed config optimizer {{'type': 'Gefen'}}: unknown params {unknown}; Gefen "
            f"takes {valid} (AdamW's arguments plus bits); gradient clipping is DeepSpeed's "
            "top-level 'gradient_clipping'"
        )
    _check_types(kwargs)
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in kwargs.items()}
    return Gefen(params, **kwargs)
