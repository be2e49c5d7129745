"""Gefen's state in the coordinates of each original tensor, which no layout owns.

A rank's state (``state.py``) is laid out over the segments of the buffer it was handed: pieces
of tensors cut where FSDP or ZeRO cut them, each with its own v and absmax per block piece. To
resume at another world size or wrapping, the pieces are taken out of their buffer into a
``TensorState`` per tensor (``export``), the pieces of all ranks are put together (``merge``),
and each new segment's state is cut from them (``restore``). The block size, the B = 1 choice,
the codebook, the step and ``v_cross`` belong to the tensor, not to a piece (every rank chose
them from the whole tensor), so they carry over as they are.

What carries over exactly and what is approximated, for a new block piece (a block of the
tensor, cut at the new segment's ends):

- **Exact**: a block piece that was saved as it is (same layout, or a block that no boundary
  cut in either layout); B = 1 elements (bf16 m and v, per element); ``v_cross``; codes whose
  block piece keeps its absmax.
- **Split** (the new piece lies inside one saved piece): it inherits the saved piece's v and
  absmax. m is exact (each code times the same absmax); v is the mean g^2 EMA of the larger
  piece instead of its own part's, which the next steps' EMA pulls towards its own at rate
  1 - beta2.
- **Merged** (the new piece covers parts of several saved pieces): v is their element-weighted
  mean, which is exactly the EMA of the merged piece's mean g^2 (the EMA is linear and every
  piece saw the same steps), up to one fp32 rounding; absmax is their max, and the codes of the
  pieces whose absmax was lower are requantised to the nearest level of the new scale (at most
  half a level spacing of the merged absmax of error in m, once).

``docs/checkpoints.md`` has the measured drift of a resume at another layout.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from .codes import midpoints, quantize, read_codes, write_codes
from .segments import Segment, num_blocks, whole_tensor
from .state import (
    allocate,
    bits_of,
    block_owners,
    check_loaded,
    cross_length,
    layout_rows,
    segment_views,
)

CHUNK = 1 << 20
"""Elements restored at a time: the per-element gathers take ~40 bytes each."""


@dataclass
class Piece:
    """Elements [start, start + numel) of a tensor: per-element codes (one per uint8, unpacked)
    and the v and absmax of each block piece, or B = 1's bf16 m and v."""

    start: int
    numel: int
    codes: torch.Tensor | None = None
    absmax: torch.Tensor | None = None
    v: torch.Tensor | None = None
    exp_avg: torch.Tensor | None = None
    exp_avg_sq: torch.Tensor | None = None
    codes_held: Sequence[Segment] | None = None
    """Where ``codes`` is not the piece's own (None: ``codes[i]`` is element ``start + i``): a
    loader's codes for its own elements, already at its layout (``integrations.dcp``), laid out
    as these runs of the tensor (offset into ``codes``, numel, start), sorted by start."""

    def codes_of(self, lo: int, hi: int) -> torch.Tensor:
        """The codes of elements [lo, hi), which lie in this piece and, where ``codes_held`` is
        set, in one of its runs."""
        if self.codes_held is None:
            return self.codes[lo - self.start : hi - self.start]
        k = bisect_right(self.codes_held, lo, key=lambda s: s.start) - 1
        run = self.codes_held[k] if k >= 0 else None
        if run is None or hi > run.start + run.numel:
            raise ValueError(f"elements [{lo}, {hi}) are not in one run this rank holds")
        at = run.offset + lo - run.start
        return self.codes[at : at + hi - lo]


@dataclass
class TensorState:
    """One original tensor's Gefen state, from any number of pieces (``pieces`` sorted by
    ``start``, not overlapping; together all of the tensor once ``complete``)."""

    name: str
    shape: tuple[int, ...]
    block_size: int
    step: float
    codebook: torch.Tensor
    v_cross: torch.Tensor
    pieces: list[Piece] = field(default_factory=list)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def complete(self) -> bool:
        return self.missing() == []

    def missing(self) -> list[tuple[int, int]]:
        """Element ranges of the tensor no piece holds."""
        out, pos = [], 0
        for p in self.pieces:
            if p.start > pos:
                out.append((pos, p.start))
            pos = max(pos, p.start + p.numel)
        if pos < self.numel:
            out.append((pos, self.numel))
        return out


def export(state: dict[str, torch.Tensor], segments: list[Segment]) -> list[TensorState]:
    """A rank's state of one buffer as the pieces of the tensors its named segments hold
    (unnamed segments are FSDP's padding: no tensor's state). Tensors are copied to the CPU."""
    bits = bits_of(state["codebook"])
    codebook = state["codebook"].detach().float().cpu()
    step = float(state["step"])
    out = []
    views = segment_views(state)
    if len(views) != len(segments):
        raise ValueError(f"state has {len(views)} segments, the layout given {len(segments)}")
    for view, seg in zip(views, segments, strict=True):
        st = view.seg
        if not seg.name or seg.numel == 0:
            continue
        if st.start != seg.start or st.numel != seg.numel:
            raise ValueError(
                f"{seg.name}: state layout holds elements [{st.start}, {st.start + st.numel}), "
                f"the segment [{seg.start}, {seg.start + seg.numel})"
            )
        cpu = lambda t: None if t is None else t.detach().cpu().clone()  # noqa: E731
        if st.block_size == 1:
            piece = Piece(
                seg.start, seg.numel, exp_avg=cpu(st.exp_avg), exp_avg_sq=cpu(st.exp_avg_sq)
            )
        else:
            codes = read_codes(st.codes.detach().cpu(), 0, seg.numel, bits).clone()
            piece = Piece(seg.start, seg.numel, codes=codes, absmax=cpu(st.absmax), v=cpu(st.v))
        nx = cross_length(st.block_size, seg.tensor_numel) if st.block_size != 1 else 0
        cross = cpu(st.v_cross) if st.v_cross is not None else torch.zeros(nx)
        out.append(TensorState(seg.name, seg.shape, st.block_size, step, codebook, cross, [piece]))
    return out


def merge(parts: Iterable[TensorState]) -> dict[str, TensorState]:
    """The pieces of each tensor put together, by name. Pieces of one tensor must agree on
    its shape, block size, step, codebook and v_cross (every rank keeps a copy of those), and
    must not overlap; a missing piece is left for the caller to name (``missing``)."""
    out: dict[str, TensorState] = {}
    for ts in parts:
        have = out.get(ts.name)
        if have is None:
            out[ts.name] = TensorState(
                ts.name, ts.shape, ts.block_size, ts.step, ts.codebook, ts.v_cross, list(ts.pieces)
            )
            continue
        for what, a, b in (
            ("shape", have.shape, ts.shape),
            ("block size", have.block_size, ts.block_size),
            ("step", have.step, ts.step),
        ):
            if a != b:
                raise ValueError(f"{ts.name}: its pieces disagree on the {what} ({a} and {b})")
        for what, a, b in (
            ("codebook", have.codebook, ts.codebook),
            ("v_cross", have.v_cross, ts.v_cross),
        ):
            if a.shape != b.shape or not torch.equal(a, b):
                raise ValueError(f"{ts.name}: its pieces hold different copies of {what}")
        have.pieces.extend(ts.pieces)
    for ts in out.values():
        ts.pieces.sort(key=lambda p: p.start)
        for a, b in zip(ts.pieces, ts.pieces[1:], strict=False):
            if a.start + a.numel > b.start:
                raise ValueError(
                    f"{ts.name}: two pieces hold elements from {b.start} (saved twice: "
                    "checkpoints of two runs mixed?)"
                )
    return out


def _covering(ts: TensorState, start: int, numel: int, starts: list[int]) -> list[Piece]:
    """The pieces that hold elements [start, start + numel), which must leave none out;
    ``starts``: the pieces' starts (they are sorted and do not overlap, so the pieces that meet
    a range are consecutive: a bisection, not a scan, for tensors saved as a piece per row)."""
    end = start + numel
    lo = max(bisect_right(starts, start) - 1, 0)
    got = [p for p in ts.pieces[lo : bisect_left(starts, end)] if p.start + p.numel > start]
    pos = start
    for p in got:
        if p.start > pos:
            break
        pos = p.start + p.numel
    if pos < end:
        raise ValueError(
            f"{ts.name}: the checkpoint holds no state for elements [{pos}, "
            f"{min(end, next((p.start for p in got if p.start > pos), end))}) of {ts.shape}: "
            "a rank's file or entry is missing"
        )
    return got


def _block_of(index: torch.Tensor, seg_start: int, block_size: int) -> torch.Tensor:
    """Each element's block within a segment that starts at ``seg_start`` (its block pieces
    cut at the segment's ends): the layout of ``segments.num_blocks``."""
    if block_size < 0:
        return (index - seg_start) % -block_size
    return index // block_size - seg_start // block_size


def restore(
    ts: TensorState, start: int, numel: int, starts: list[int] | None = None
) -> dict[str, torch.Tensor]:
    """The state of a new segment holding elements [start, start + numel) of the tensor:
    per-element codes (unpacked uint8), absmax and v per block piece, or exp_avg / exp_avg_sq
    for B = 1 (module docstring: what is exact). ``starts``: the pieces' starts, where the
    caller restores many segments of one tensor."""
    if starts is None:
        starts = [p.start for p in ts.pieces]
    pieces = _covering(ts, start, numel, starts)
    end = start + numel
    if ts.block_size == 1:
        m = torch.cat(
            [
                p.exp_avg[max(start, p.start) - p.start : min(end, p.start + p.numel) - p.start]
                for p in pieces
            ]
        )
        v = torch.cat(
            [
                p.exp_avg_sq[max(start, p.start) - p.start : min(end, p.start + p.numel) - p.start]
                for p in pieces
            ]
        )
        return dict(exp_avg=m, exp_avg_sq=v)
    bs = ts.block_size
    levels = ts.codebook.float()
    nb = num_blocks(start, numel, bs)
    v_sum = torch.zeros(nb, dtype=torch.float64)
    count = torch.zeros(nb, dtype=torch.float64)
    amax = torch.zeros(nb, dtype=torch.float32)
    saved_amax = torch.empty(numel, dtype=torch.float32)
    codes = torch.empty(numel, dtype=torch.uint8)
    for p in pieces:
        a, b = max(start, p.start), min(end, p.start + p.numel)
        for lo in range(a, b, CHUNK):
            hi = min(lo + CHUNK, b)
            idx = torch.arange(lo, hi)
            old = _block_of(idx, p.start, bs)
            new = _block_of(idx, start, bs)
            v_sum.index_add_(0, new, p.v[old].double())
            count.index_add_(0, new, torch.ones(hi - lo, dtype=torch.float64))
            amax.scatter_reduce_(0, new, p.absmax[old], "amax")
            saved_amax[lo - start : hi - start] = p.absmax[old]
            codes[lo - start : hi - start] = p.codes_of(lo, hi)
    v = (v_sum / count).float()
    mids = midpoints(levels)
    for lo in range(0, numel, CHUNK):
        hi = min(lo + CHUNK, numel)
        idx = torch.arange(start + lo, start + hi)
        scale = amax[_block_of(idx, start, bs)]
        moved = (saved_amax[lo:hi] != scale).nonzero().view(-1)
        if moved.numel():
            c = codes[lo:hi]
            c[moved] = _rescale(c[moved], saved_amax[lo:hi][moved], scale[moved], levels, mids)
    return dict(codes=codes, absmax=amax, v=v)


def _rescale(
    codes: torch.Tensor, old: torch.Tensor, new: torch.Tensor, levels: torch.Tensor, mids
) -> torch.Tensor:
    """Codes of m = level x ``old`` (per element) at the scale ``new``, to the nearest level:
    where a merged block's absmax is above a piece's own."""
    safe = torch.where(new > 0, new, torch.ones_like(new))
    return quantize(levels[codes.long()] * old / safe, mids).to(torch.uint8)


def install(
    tensors: dict[str, TensorState], segments: list[Segment], device: torch.device
) -> dict[str, torch.Tensor]:
    """A buffer's state for ``segments`` (this rank's layout) cut from the saved tensors: the
    inverse of ``export`` at the same layout, and a re-cut at another. Unnamed segments
    (padding) get a fresh B = 1 state."""
    named = [s for s in segments if s.name and s.numel]
    if not named:
        raise ValueError("no named segment to restore state into")
    first = tensors[_need(tensors, named[0]).name]
    block_sizes = []
    for s in segments:
        block_sizes.append(_need(tensors, s).block_size if s.name and s.numel else 1)
    st = allocate(segments, block_sizes, first.codebook, device)
    bits = bits_of(first.codebook)
    st["step"] = torch.tensor(first.step, dtype=torch.float32)
    owners = block_owners(layout_rows(st), bits)
    runs: dict[int, list] = {}  # first row of a run sharing blocks -> (view, restored) per row
    starts = {name: [p.start for p in ts.pieces] for name, ts in tensors.items()}
    for k, (sv, seg) in enumerate(zip(segment_views(st), segments, strict=True)):
        if not (seg.name and seg.numel):
            continue
        view = sv.seg
        ts = _need(tensors, seg)
        if ts.step != first.step or not torch.equal(ts.codebook, first.codebook):
            raise ValueError(f"{ts.name}: another step or codebook than {first.name} in one buffer")
        got = restore(ts, seg.start, seg.numel, starts[ts.name])
        if ts.block_size == 1:
            view.exp_avg.copy_(got["exp_avg"])
            view.exp_avg_sq.copy_(got["exp_avg_sq"])
            continue
        if view.v_cross is not None:
            view.v_cross.copy_(ts.v_cross)
        runs.setdefault(owners[k], []).append((view, got, seg.numel))
    levels = first.codebook.float()
    mids = midpoints(levels)
    for rows in runs.values():
        # rows sharing their columns' v and absmax: v the mean over the rows (one element of
        # each column per row, so the element-weighted mean), absmax the max, codes requantised
        # where a row's own absmax was lower (as ``restore`` merges pieces)
        amax = torch.stack([got["absmax"] for _, got, _ in rows]).amax(dim=0)
        v = torch.stack([got["v"].double() for _, got, _ in rows]).mean(dim=0).float()
        for view, got, n in rows:
            codes = got["codes"]
            if len(rows) > 1 and not torch.equal(got["absmax"], amax):
                codes = _rescale(codes, got["absmax"], amax, levels, mids)
            write_codes(view.codes, 0, n, codes.to(device), bits)
        rows[0][0].absmax.copy_(amax)
        rows[0][0].v.copy_(v)
    return st


def _need(tensors: dict[str, TensorState], seg: Segment) -> TensorState:
    ts = tensors.get(seg.name)
    if ts is None:
        raise ValueError(f"the checkpoint holds no state for {seg.name}")
    if tuple(ts.shape) != tuple(seg.shape):
        raise ValueError(
            f"{seg.name}: the checkpoint's tensor has shape {tuple(ts.shape)}, this one "
            f"{tuple(seg.shape)}: another model"
        )
    return ts


def describe(tensors: dict[str, TensorState], segments: list[Segment]) -> dict[str, int]:
    """How a restore into ``segments`` carries the block pieces over: counts of 'exact',
    'split' and 'merged' pieces (module docstring), for reports and tests."""
    out = {"exact": 0, "split": 0, "merged": 0}
    for seg in segments:
        if not (seg.name and seg.numel) or tensors[seg.name].block_size == 1:
            continue
        ts = tensors[seg.name]
        saved = [(p.start, p.numel) for p in ts.pieces]
        for lo, hi in _pieces_of(seg.start, seg.numel, ts.block_size):
            over = [_pieces_of(s, n, ts.block_size) for s, n in saved if s < hi and s + n > lo]
            mine = [r for rs in over for r in rs if r[0] < hi and r[1] > lo]
            if len(mine) == 1 and mine[0] == (lo, hi):
                out["exact"] += 1
            elif len(mine) == 1:
                out["split"] += 1
            else:
                out["merged"] += 1
    return out


def _pieces_of(start: int, numel: int, block_size: int) -> list[tuple[int, int]]:
    """The element ranges of a segment's contiguous block pieces (column blocks: the segment's
    whole range for each column, as an approximation of which pieces meet)."""
    if block_size < 0:
        return [(start, start + numel)]
    end, out = start + numel, []
    k = start // block_size
    while k * block_size < end:
        out.append((max(start, k * block_size), min(end, (k + 1) * block_size)))
        k += 1
    return out


def saved_whole(
    saved: dict[str, torch.Tensor], shape: tuple[int, ...], name: str
) -> list[Segment] | None:
    """The segments of a state saved for a whole tensor of ``shape`` (one process, or a
    consolidated checkpoint), read from its layout: ``whole_tensor``'s, or the one segment that
    gefen_dist kept for a batch of matrices before it cut them by matrix (``docs/history.md``);
    None where the layout is neither."""
    layout = saved.get("layout")
    if not isinstance(layout, torch.Tensor) or layout.dim() != 2 or layout.shape[1] < 3:
        return None
    rows = [tuple(r[:3]) for r in layout.tolist()]
    cut = whole_tensor(shape, name)
    if rows == [(s.offset, s.numel, s.start) for s in cut]:
        return cut
    total = cut[-1].start + cut[-1].numel if cut else 0
    if rows == [(0, total, 0)]:
        return [Segment(0, total, 0, tuple(shape), name)]
    return None


def fit(saved: dict[str, torch.Tensor], segments: list[Segment], bits: int, name: str) -> dict:
    """``saved`` (one parameter's state, as ``Gefen.state_dict`` wrote it) for this parameter's
    ``segments``: as it is where it was saved for the same layout; re-cut where it was saved
    for the whole tensor (one process, or a consolidated checkpoint) and this parameter holds
    a piece of it (FSDP2, or another world size). Anything else is left for
    ``state.check_loaded`` to refuse by name."""
    layout = saved.get("layout") if isinstance(saved, dict) else None
    if not isinstance(layout, torch.Tensor) or layout.dim() != 2 or layout.shape[1] < 3:
        return saved
    rows = [tuple(r[:3]) for r in layout.tolist()]
    if rows == [(s.offset, s.numel, s.start) for s in segments]:
        return saved
    tensors = {s.shape for s in segments if s.numel}
    if len(tensors) != 1:
        return saved
    (shape,) = tensors
    key = name or "tensor"
    saved_layout = saved_whole(saved, shape, key)
    if saved_layout is None:
        return saved
    mine = [Segment(s.offset, s.numel, s.start, s.shape, key) for s in segments]
    check_loaded(saved, saved_layout, bits, name)
    parts = export(saved, saved_layout)
    device = saved["codes"].device if isinstance(saved.get("codes"), torch.Tensor) else "cpu"
    return install(merge(parts), mine, torch.device(device))


__all__ = [
    "Piece",
    "TensorState",
    "describe",
    "export",
    "fit",
    "install",
    "merge",
    "restore",
    "saved_whole",
]
