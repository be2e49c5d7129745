"""The C++ CPU step's tables, kept from one step to the next.

Why: on a model of small tensors (the demo GPT: 3M parameters in 52 tensors) the Python that
gathers each tensor's segments, builds the two tables (the factor pass's and the update's) and
dispatches them cost a quarter of the step. Between two steps of a training loop nothing in those
tables changes but the gradients' addresses (``zero_grad(set_to_none=True)`` frees them), the
parameters' if something swapped their storage, the step counts and the hyperparameters. So after
a step that ran entirely on the C++ kernel the optimizer keeps its tables; at the next it checks
that the same parameters, in the same order and groups, have gradients, with the same state,
dtypes and sizes, on the CPU and contiguous, then counts the steps (one C call instead of
torch._foreach_add_ over every step scalar and an item() of each), rewrites the addresses,
step keys and hyperparameter rows in place and calls the kernel. Anything else (a parameter
without its gradient, a reloaded or re-initialised state, another backend, a tensor spread
over ranks, ``maximize``) takes the long way, which builds a new plan.
"""

from __future__ import annotations

import operator
from array import array
from typing import TYPE_CHECKING

import torch

from . import native_cpu, sharding
from . import segment_table as table
from .codes import step_key
from .reference import Hyper

if TYPE_CHECKING:
    from .optimizer import Gefen


class CpuPlan:
    """One step's tables, and for each row the parameter (an index into ``params``) and the
    element offset its addresses come from."""

    def __init__(
        self,
        opt: Gefen,
        origins: list[tuple],
        step: native_cpu.StepTable,
        cross: native_cpu.CrossTable,
        cross_items: list[int],
        cpu_items: list[int],
    ) -> None:
        """``origins``: per item of the step, (group index, parameter, element offset);
        ``cross_items``/``cpu_items``: the items behind the factor pass's rows and behind the
        update table's work list."""
        self.backend = opt.backend
        self.params, self.groups, self.states = [], [], []
        self.dtypes, self.numels, self.sizes = [], [], []
        where: dict[int, int] = {}
        for gi, p, _ in origins:
            if id(p) in where:
                continue
            where[id(p)] = len(self.params)
            st = opt.state[p]
            self.params.append(p)
            self.groups.append(gi)
            # the tensors the tables point into: a new one (a load, a re-initialisation) means
            # new addresses, so the long way
            self.states.append((st, st["codes"], st["codebook"], st["step"]))
            self.dtypes.append((p.dtype, p.grad.dtype))
            self.numels.append(p.numel())
            self.sizes.append((p.element_size(), p.grad.element_size()))
        # which state dict each parameter has: checked by identity in one pass over the state,
        # not by a lookup per parameter (Tensor.__hash__ runs in Python: 0.3 us each)
        self.keys, self.values = list(opt.state.keys()), list(opt.state.values())
        self.counts = array("q", [0] * len(self.params))  # the step counts' addresses
        self.steps = array("f", [0.0] * len(self.params))  # and their values after the step

        def rows(items: list[int]) -> list[tuple[int, int]]:
            return [(where[id(origins[i][1])], origins[i][2]) for i in items]

        self.step, self.step_rows = step, rows([cpu_items[w] for w in step.index])
        self.cross, self.cross_rows = cross, rows(cross_items)

    @staticmethod
    def eligible(opt: Gefen, items: list[tuple]) -> bool:
        """Every item on the C++ kernel, none spread over ranks, no DTensor, no maximize."""
        return (
            bool(items)
            and all(it[0] == "cpu" and it[8] is None for it in items)
            and not any(g["maximize"] for g in opt.param_groups)
            and not any(sharding.is_dtensor(p) for g in opt.param_groups for p in g["params"])
        )

    def run(self, opt: Gefen) -> bool:
        """This step on the kept tables, step counts included, or False where they do not fit
        it (nothing done then: the caller counts the steps and takes the long way)."""
        state = opt.state
        if (
            opt.backend != self.backend
            or len(state) != len(self.keys)
            or not all(map(operator.is_, state.keys(), self.keys))
            or not all(map(operator.is_, state.values(), self.values))
        ):
            return False
        n, k = len(self.params), 0
        addr: list[tuple[int, int]] = []
        counts, f32 = self.counts, torch.float32
        for gi, group in enumerate(opt.param_groups):
            if group["maximize"]:
                return False
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                if k == n or p is not self.params[k] or gi != self.groups[k]:
                    return False
                st, codes, book, count = self.states[k]
                pt, gt = self.dtypes[k]
                if (
                    st["codes"] is not codes
                    or st["codebook"] is not book
                    or st["step"] is not count
                    or count.dtype is not f32
                    or not count.is_cpu
                    or p.dtype is not pt
                    or g.dtype is not gt
                    or p.numel() != self.numels[k]
                    or g.numel() != self.numels[k]
                    or not (p.is_cpu and g.is_cpu)
                    or not p.is_contiguous()
                    or not g.is_contiguous()
                ):
                    return False
                addr.append((p.data_ptr(), g.data_ptr()))
                counts[k] = count.data_ptr()
                k += 1
        if k != n:
            return False
        native_cpu.count_steps(counts, self.steps)
        steps = [int(t) for t in self.steps]
        rows: dict[tuple[int, int], tuple] = {}  # (group, step) -> hyper rows, step key
        per: list[tuple] = []
        for gi, t in zip(self.groups, steps, strict=True):
            r = rows.get((gi, t))
            if r is None:
                h = Hyper.of(opt.param_groups[gi], t)
                hr = array("f", table.hyper_row(h))
                r = rows[(gi, t)] = (hr, array("f", native_cpu.cross_hyper_row(h)), step_key(t))
            per.append(r)
        meta, hyp, cols = self.step.meta, self.step.hyp, table.META_COLS
        for r, (k, off) in enumerate(self.step_rows):
            (pa, ga), (sp, sg), (hr, _, key) = addr[k], self.sizes[k], per[k]
            meta[r * cols + table.P_COL] = pa + off * sp
            meta[r * cols + table.G_COL] = ga + off * sg
            meta[r * cols + table.KEY_COL] = key
            hyp[r * table.HYP_COLS : (r + 1) * table.HYP_COLS] = hr
        cmeta, chyp = self.cross.meta, self.cross.hyp
        ccols, chc = native_cpu.CrossTable.COLS, native_cpu.CrossTable.HYP_COLS
        for r, (k, off) in enumerate(self.cross_rows):
            cmeta[r * ccols] = addr[k][1] + off * self.sizes[k][1]
            chyp[r * chc : (r + 1) * chc] = per[k][1]
        self.cross.sums.zero_()
        self.cross.run()
        self.step.run()
        return True
