"""The CUDA step's tables, kept from one step to the next (``kept_plan`` says why and what must
hold). Here: the rewrite of the update's plan (``native_cuda.StepPlan``, flat arrays) and the
factor pass's (``native_cuda.CrossPlan``), then their launches; the factors the update's rows
point at stay in the factor plan's buffers, which the plan keeps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import native_cuda
from . import segment_table as table
from .kept_plan import KeptPlan

if TYPE_CHECKING:
    from .optimizer import Gefen


class CudaPlan(KeptPlan):
    """One device's step plans, and for each row the parameter (an index into ``params``) and
    the element offset its addresses come from."""

    def __init__(
        self,
        opt: Gefen,
        origins: list[tuple],
        device: torch.device,
        step: native_cuda.StepPlan,
        cross: native_cuda.CrossPlan,
        cross_items: list[int],
        cuda_items: list[int],
    ) -> None:
        """``origins``: per item of the step, (group index, parameter, element offset);
        ``cross_items``/``cuda_items``: the items behind the factor plan's work list and behind
        the step plan's."""
        super().__init__(opt, origins, device)
        self.step, self.step_rows = step, self.rows([cuda_items[w] for w, _, _ in step.rows])
        self.cross, self.cross_rows = cross, self.rows([cross_items[w] for w in cross.order])

    @staticmethod
    def eligible(opt: Gefen, items: list[tuple]) -> bool:
        """Every item on the CUDA kernels, none spread over ranks, no DTensor, no maximize."""
        return KeptPlan.fits(opt, items, "cuda")

    def refresh(self, opt: Gefen) -> bool:
        """Count this step and rewrite the plans' addresses, step keys and hyperparameters, or
        False where they do not fit it (nothing done then)."""
        addr = self.gather(opt)
        if addr is None:
            return False
        per = self.per_parameter(opt)
        ints, floats, hc = self.step.ints, self.step.floats, table.HYP_COLS
        for (k, off), (_, ia, fa) in zip(self.step_rows, self.step.rows, strict=True):
            (pa, ga), (sp, sg), (hr, _, key) = addr[k], self.sizes[k], per[k]
            ints[ia + table.P_COL] = pa + off * sp
            ints[ia + table.G_COL] = ga + off * sg
            ints[ia + table.KEY_COL] = key
            floats[fa : fa + hc] = hr
        meta, hyps = self.cross.meta, self.cross.hyps
        for r, (k, off) in enumerate(self.cross_rows):
            meta[r][0] = addr[k][1] + off * self.sizes[k][1]  # Cross's kXG
            hyps[r] = per[k][1].tolist()
        return True

    def run(self, opt: Gefen) -> bool:
        """This step on the kept plans (the factor pass, then the update), or False."""
        if not self.refresh(opt):
            return False
        native_cuda.launch_cross(self.cross, self.device)
        native_cuda.launch_step(self.step, self.device)
        return True
