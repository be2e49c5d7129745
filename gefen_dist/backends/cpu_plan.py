"""The C++ CPU step's tables, kept from one step to the next (``kept_plan`` says why and what
must hold). Here: the rewrite of the update's table (``native_cpu.StepTable``) and the factor
pass's (``native_cpu.CrossTable``, empty where every factored tensor is held whole: the update
takes those tensors' sums itself), flat arrays the C++ calls read by address, and the calls.
"""

from __future__ import annotations

import torch
from torch.optim import Optimizer

from . import native_cpu
from .cross import StepFactors
from .kept_plan import KeptPlan
from .segment_table import Cross, CrossHyp, Hyp, Meta
from .work import Origin, StepItem


class CpuPlan(KeptPlan):
    """One step's tables, and for each row the parameter and the element offset its addresses
    come from (``KeptPlan.Row``)."""

    def __init__(
        self,
        opt: Optimizer,
        backend: str,
        origins: list[Origin],
        step: native_cpu.StepTable,
        factors: StepFactors,
        cpu_items: list[int],
    ) -> None:
        """``cpu_items``: the item behind each entry of the update table's work list."""
        super().__init__(opt, backend, origins, torch.device("cpu"))
        self.step, self.step_rows = step, self.rows([cpu_items[w] for w in step.index])
        self.cross, self.cross_rows = factors.table, self.rows(factors.table_items)

    @staticmethod
    def eligible(opt: Optimizer, items: list[StepItem]) -> bool:
        """``KeptPlan.fits`` on the C++ kernel."""
        return KeptPlan.fits(opt, items, "cpu")

    def run(self, opt: Optimizer, backend: str) -> bool:
        """This step on the kept tables, step counts included, or False where they do not fit
        it (nothing done then: the caller counts the steps and takes the long way)."""
        addr = self.gather(opt, backend)
        if addr is None:
            return False
        per = self.per_parameter(opt)
        meta, hyp = self.step.meta, self.step.hyp
        cols, hcols = len(Meta), len(Hyp)
        p_col, g_col, key_col = int(Meta.P), int(Meta.G), int(Meta.STEP_KEY)  # plain ints: hot
        for r, row in enumerate(self.step_rows):
            (pa, ga), (sp, sg), mine = addr[row.param], self.sizes[row.param], per[row.param]
            meta[r * cols + p_col] = pa + row.offset * sp
            meta[r * cols + g_col] = ga + row.offset * sg
            meta[r * cols + key_col] = mine.key
            hyp[r * hcols : (r + 1) * hcols] = mine.hyper
        cmeta, chyp = self.cross.meta, self.cross.hyp
        ccols, chc, cg_col = len(Cross), len(CrossHyp), int(Cross.G)
        for r, row in enumerate(self.cross_rows):
            (_, ga), (_, sg) = addr[row.param], self.sizes[row.param]
            cmeta[r * ccols + cg_col] = ga + row.offset * sg
            chyp[r * chc : (r + 1) * chc] = per[row.param].cross_hyper
        if len(self.cross):
            self.cross.sums.zero_()
            self.cross.run()
        self.step.run()
        return True
