"""What a step's kept tables check and rewrite from one step to the next.

Why: on a model of small tensors (the demo GPT: 3M parameters in 52 tensors) the Python that
gathers each tensor's segments and builds a step's tables cost a quarter of the step on the CPU,
and on a GPU such Python is the whole step for a model of a few hundred million parameters.
Between two steps of a training loop nothing in those tables changes but the gradients'
addresses (``zero_grad(set_to_none=True)`` frees them), the parameters' if something swapped
their storage, the step counts and the hyperparameters. So after a step that ran entirely on
the C++ backend the optimizer keeps its tables (``cpu_plan.CpuPlan``);
at the next, ``gather`` checks that the same parameters, in the same order and groups, have
gradients, with the same state, dtypes and sizes, on the plan's device and contiguous, and
``per_parameter`` counts the steps and gives each parameter its rows; the backend's plan then
rewrites the addresses, step keys and hyperparameter rows in place and runs. Anything else (a
parameter without its gradient, a reloaded or re-initialised state, another backend, a tensor
spread over ranks, ``maximize``, another ``bf16_stochastic_round``) takes the long way, which
builds a new plan.
"""

from __future__ import annotations

import operator
from array import array
from typing import NamedTuple

import torch
from torch.optim import Optimizer

from ..distributed import sharding
from ..method.codes import step_key
from ..method.hyper import Hyper
from ..method.state import LayoutCol
from . import native_cpu
from . import segment_table as table
from .work import Origin, StepItem


class Row(NamedTuple):
    """Where a table row's addresses come from: a parameter (index into ``KeptPlan.params``)
    and the segment's element offset in it."""

    param: int
    offset: int


class PerParameter(NamedTuple):
    """A parameter's rows this step, one of each per (group, step) value."""

    hyper: array
    """The update's hyperparameter row (``segment_table.hyper_row``)."""
    cross_hyper: array
    """The factor pass's (``segment_table.cross_hyper_row``)."""
    key: int
    """The step key (``codes.step_key``)."""


class _Kept(NamedTuple):
    """The tensors a parameter's rows point into: a new one (a load, a re-initialisation)
    means new addresses, so the long way."""

    state: dict
    codes: torch.Tensor
    codebook: torch.Tensor
    step: torch.Tensor


class KeptPlan:
    """The parameters behind a step's tables, and what must hold for the tables to serve the
    next step. ``opt`` is read through torch's Optimizer attributes only (``state``,
    ``param_groups``); ``backend`` is the optimizer's setting the tables were built under."""

    def __init__(
        self, opt: Optimizer, backend: str, origins: list[Origin], device: torch.device
    ) -> None:
        self.backend, self.device = backend, device
        self.params, self.groups, self.states = [], [], []
        self.dtypes, self.numels, self.sizes = [], [], []
        self._where: dict[int, int] = {}
        self._origins = origins
        for o in origins:
            p = o.param
            if id(p) in self._where:
                continue
            self._where[id(p)] = len(self.params)
            st = opt.state[p]
            self.params.append(p)
            self.groups.append(o.group)
            self.states.append(_Kept(st, st["codes"], st["codebook"], st["step"]))
            self.dtypes.append((p.dtype, p.grad.dtype))
            self.numels.append(p.numel())
            self.sizes.append((p.element_size(), p.grad.element_size()))
        # which state dict each parameter has: checked by identity in one pass over the state,
        # not by a lookup per parameter (Tensor.__hash__ runs in Python: 0.3 us each)
        self.keys, self.values = list(opt.state.keys()), list(opt.state.values())
        # in the tables' parameter dtype column (segment_table.DType.BF16_SR)
        self.rounding = [g.get("bf16_stochastic_round", False) for g in opt.param_groups]
        self.counts = array("q", [0] * len(self.params))  # the step counts' addresses
        self.steps = array("f", [0.0] * len(self.params))  # and their values after the step

    def rows(self, items: list[int]) -> list[Row]:
        """The ``Row`` behind each of ``items`` (indices of origins)."""
        return [
            Row(self._where[id(self._origins[i].param)], self._origins[i].offset) for i in items
        ]

    @staticmethod
    def fits(opt: Optimizer, items: list[StepItem], impl: str) -> bool:
        """Every item on backend ``impl``, none spread over ranks or sharing its v_cross with
        another piece (``state.cross_column``), no DTensor, no maximize."""
        cross = LayoutCol.CROSS
        return (
            bool(items)
            and all(it.impl == impl and it.spread is None for it in items)
            and all(bool((st["layout"][:, cross] >= 0).all()) for st in opt.state.values() if st)
            and not any(g["maximize"] for g in opt.param_groups)
            and not any(sharding.is_dtensor(p) for g in opt.param_groups for p in g["params"])
        )

    def gather(self, opt: Optimizer, backend: str) -> list[tuple[int, int]] | None:
        """Each parameter's (parameter, gradient) address for this step, the step counts'
        addresses into ``counts``; None where the tables do not fit this step."""
        state = opt.state
        if (
            backend != self.backend
            or len(state) != len(self.keys)
            or len(opt.param_groups) != len(self.rounding)
            or not all(map(operator.is_, state.keys(), self.keys))
            or not all(map(operator.is_, state.values(), self.values))
        ):
            return None
        n, k = len(self.params), 0
        addr: list[tuple[int, int]] = []
        counts, f32 = self.counts, torch.float32
        cpu, device = self.device.type == "cpu", self.device
        for gi, group in enumerate(opt.param_groups):
            if group["maximize"] or group.get("bf16_stochastic_round", False) != self.rounding[gi]:
                return None
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                if k == n or p is not self.params[k] or gi != self.groups[k]:
                    return None
                kept = self.states[k]
                st, count = kept.state, kept.step
                pt, gt = self.dtypes[k]
                if (
                    st["codes"] is not kept.codes
                    or st["codebook"] is not kept.codebook
                    or st["step"] is not count
                    or count.dtype is not f32
                    or not count.is_cpu
                    or p.dtype is not pt
                    or g.dtype is not gt
                    or p.numel() != self.numels[k]
                    or g.numel() != self.numels[k]
                    or not (p.is_cpu and g.is_cpu if cpu else p.device == g.device == device)
                    or not p.is_contiguous()
                    or not g.is_contiguous()
                ):
                    return None
                addr.append((p.data_ptr(), g.data_ptr()))
                counts[k] = count.data_ptr()
                k += 1
        return addr if k == n else None

    def per_parameter(self, opt: Optimizer) -> list[PerParameter]:
        """Counts this step (on the CPU one C call to the kernel's library, which ran the last
        step; elsewhere torch's add and a read of each count), then per parameter: its update
        hyperparameter row, its factor pass's row and its step key, one of each per (group,
        step) value."""
        if self.device.type == "cpu":
            native_cpu.count_steps(self.counts, self.steps)
        else:
            counts = [s.step for s in self.states]
            torch._foreach_add_(counts, 1)
            self.steps = array("f", [float(t) for t in counts])
        rows: dict[tuple[int, int], PerParameter] = {}  # by (group, step)
        per: list[PerParameter] = []
        for gi, t in zip(self.groups, (int(t) for t in self.steps), strict=True):
            r = rows.get((gi, t))
            if r is None:
                h = Hyper.of(opt.param_groups[gi], t)
                hr = array("f", table.hyper_row(h))
                r = rows[(gi, t)] = PerParameter(
                    hr, array("f", table.cross_hyper_row(h)), step_key(t)
                )
            per.append(r)
        return per
