"""What one step hands the backends, as named records.

Why NamedTuples and not dataclasses: a step builds one record per segment of every parameter
(hundreds to thousands per step), and a NamedTuple costs what the plain tuple it replaces cost,
while every reader names the field it reads. The same records go to every backend (C++, Triton,
the reference), so a field means one thing everywhere.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..method.hyper import Hyper
from ..method.state import SegmentState


class StepItem(NamedTuple):
    """One segment's work this step, before the cross factors are known (``Gefen.step``)."""

    impl: str
    """'cpu' (C++), 'triton' or 'reference': the backend that steps it (``dispatch``)."""
    p: torch.Tensor
    """The parameter's piece the segment covers: a flat contiguous view."""
    g: torch.Tensor
    """The gradient's piece, as ``p``."""
    seg: SegmentState
    hyper: Hyper
    levels: torch.Tensor
    """The codebook of m (``method/codes``)."""
    mids: torch.Tensor
    """Midpoints of ``levels``, which encoding searches."""
    bits: int
    spread: str | None
    """The name under which its cross sums are all-reduced, for a piece of a tensor spread over
    the optimizer's process group; None for a tensor held whole (``Gefen.spread_name``)."""


class Origin(NamedTuple):
    """Where a ``StepItem`` came from, which the kept plans rewrite from step to step."""

    group: int
    """Index of the param group."""
    param: torch.Tensor
    offset: int
    """The segment's first element in the local parameter."""


class SegmentWork(NamedTuple):
    """One segment's update, as a backend's ``step`` takes it."""

    p: torch.Tensor
    g: torch.Tensor
    seg: SegmentState
    hyper: Hyper
    levels: torch.Tensor
    mids: torch.Tensor
    bits: int
    factor: torch.Tensor | None = None
    """This step's cross factor of the segment's tensor (``backends/cross.py``). None: the
    backend takes it from the segment's own g (exact for a tensor held whole, which is the only
    case the optimizer leaves to it), or there is none (no ``v_cross``)."""
    v_done: bool = False
    """The factor pass has already folded this step's g^2 into the segment's block v
    (contiguous blocks on the C++ kernel), so the update does not fold it again."""


class CrossWork(NamedTuple):
    """One segment's part in the factor pass (``cross_table`` of either native backend)."""

    g: torch.Tensor
    seg: SegmentState
    hyper: Hyper
    whole: bool
    """The segment holds its tensor whole: its own sums are its tensor's, so the pass also
    gives its factor; otherwise the pass gives its sums and counts for the all-reduce."""


class CrossResult(NamedTuple):
    """What the factor pass gives one ``CrossWork``: the fp64 sums and counts of its v_cross
    entries (None where ``whole`` on the C++ kernel: they never leave it), and its factor where
    ``whole`` (else None)."""

    sums: torch.Tensor | None
    counts: torch.Tensor | None
    factor: torch.Tensor | None


class CrossDest(NamedTuple):
    """Where a spread tensor's only piece on a device writes its sums and counts: its slot in
    the all-reduce's buffer (fp64, contiguous, of its v_cross's length)."""

    sums: torch.Tensor
    counts: torch.Tensor


class FactorWork(NamedTuple):
    """A factor to compute from sums already reduced over ranks (``cross_factor``)."""

    seg: SegmentState
    hyper: Hyper
    sums: torch.Tensor
    counts: torch.Tensor
