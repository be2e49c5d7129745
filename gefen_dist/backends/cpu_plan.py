"""The C++ CPU step's tables, kept from one step to the next (``kept_plan`` says why and what
must hold). Here: the rewrite of the update's table (``native_cpu.StepTable``) and the factor
pass's (``native_cpu.CrossTable``, empty where every factored tensor is held whole: the update
takes those tensors' sums itself), flat arrays the C++ calls read by address, and the calls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import native_cpu
from . import segment_table as table
from .kept_plan import KeptPlan

if TYPE_CHECKING:
    from ..optimizer import Gefen


class CpuPlan(KeptPlan):
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
        super().__init__(opt, origins, torch.device("cpu"))
        self.step, self.step_rows = step, self.rows([cpu_items[w] for w in step.index])
        self.cross, self.cross_rows = cross, self.rows(cross_items)

    @staticmethod
    def eligible(opt: Gefen, items: list[tuple]) -> bool:
        """``KeptPlan.fits`` on the C++ kernel."""
        return KeptPlan.fits(opt, items, "cpu")

    def run(self, opt: Gefen) -> bool:
        """This step on the kept tables, step counts included, or False where they do not fit
        it (nothing done then: the caller counts the steps and takes the long way)."""
        addr = self.gather(opt)
        if addr is None:
            return False
        per = self.per_parameter(opt)
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
        if len(self.cross):
            self.cross.sums.zero_()
            self.cross.run()
        self.step.run()
        return True
