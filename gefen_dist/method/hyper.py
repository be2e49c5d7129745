"""A param group's values at one step, as the update reads them."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class Hyper:
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: int
    bf16_stochastic_round: bool = False

    @classmethod
    def of(cls, group: dict, step: int) -> Hyper:
        """A param group's values at ``step`` (a tensor lr read as its number)."""
        beta1, beta2 = group["betas"]
        return cls(
            lr=float(group["lr"]),
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            step=step,
            bf16_stochastic_round=bool(group.get("bf16_stochastic_round", False)),
        )

    @property
    def step_size(self) -> float:
        return self.lr / (1.0 - self.beta1**self.step)

    @property
    def bc1(self) -> float:
        """1 - beta1^t: m / bc1 is the bias-corrected m-hat the update's overshoot rule reads."""
        return 1.0 - self.beta1**self.step

    @property
    def bc2_sqrt(self) -> float:
        return math.sqrt(1.0 - self.beta2**self.step)

    @property
    def g_floor(self) -> float:
        """sqrt(1 - beta2) / sqrt(1 - beta2^t): AdamW's sqrt(v-hat) is never below this times the
        step's |g| (its v takes 1 - beta2 of g^2), so no shared denominator may be either."""
        return math.sqrt(1.0 - self.beta2) / self.bc2_sqrt
