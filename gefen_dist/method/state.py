"""The segment state manager: one parameter's Gefen state, laid out over its segments.

Per parameter (the buffer the optimizer is handed) the state is a handful of flat tensors, each
the concatenation of its segments' pieces in segment order:

- ``layout``  int64 (segments, 5): buffer offset, numel, start in the original tensor, block size
  (B > 1 contiguous blocks, 1 none, -P columns of a row of P elements), entries of v_cross
- ``codebook`` fp32 (2**bits,): the levels of m; its length says the bit width. One tensor
  shared by every state of that width on a device (``Gefen._shared_codebook``)
- ``codes``   uint8: m codes of segments with B > 1, each segment from a byte boundary, two per
  byte at 4 bits
- ``absmax``, ``v`` fp32, one per block of segments with B > 1 (blocks cut at segment ends),
  but where segments are the rows of a piece of a column-blocked tensor (a RowwiseParallel
  shard: some columns of every row, one segment per row): those rows share their columns' v and
  absmax, as the piece's rows would in one segment (``block_owners``)
- ``v_cross`` fp32, the second moment's factor across the blocks of the segment's tensor, all
  ``cross_length`` entries of it (``reference``, the factor): one copy per buffer of each
  tensor, on every rank that holds a piece of it. A segment whose tensor an earlier segment of
  the buffer already holds (a row of a tensor-parallel shard: ``sharding``) keeps none of its
  own: its layout row says -(k + 1) entries, k the segment whose copy it uses
- ``exp_avg``, ``exp_avg_sq`` bf16, one per element of segments with B = 1 (AdamW's m and v,
  rounded stochastically: ``reference.dense_update``)
- ``step``    fp32 scalar, as AdamW

None of these has the parameter's shape or size (but for a parameter that is all B = 1), and all
are plain tensors, so a state dict loads with ``torch.load(..., weights_only=True)``. What a
loaded state may hold beyond this structure, and why: ``load_check``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import IntEnum
from typing import NamedTuple

import torch

from . import load_check
from .codes import code_bytes
from .partition import MAX_BLOCK, matrix_batch
from .segments import Segment, num_blocks, tensor_keys

STATE_KEYS = load_check.KEYS
CROSS_FLOOR = 1e-2
"""The least a position's factor c may be (``backends.reference``, the factor: why)."""
MIN_CROSS_BLOCKS = 16
"""A tensor of fewer blocks keeps no ``v_cross``."""
GROWING_KEYS = ("codes", "absmax", "v", "v_cross", "exp_avg", "exp_avg_sq")
DENSE_DTYPE = torch.bfloat16


class LayoutCol(IntEnum):
    """The columns of ``layout``, a saved format (``docs/history.md`` before changing it)."""

    OFFSET = 0
    NUMEL = 1
    START = 2
    BLOCK = 3
    CROSS = 4
    """Entries of v_cross the segment keeps, or -(k + 1): it uses segment k's copy."""


LAYOUT_COLS = len(LayoutCol)


class LayoutRow(NamedTuple):
    """One row of ``layout``, read by name."""

    offset: int
    numel: int
    start: int
    block: int
    cross: int

    @property
    def cross_entries(self) -> int:
        """v_cross entries this segment keeps itself (0 where it uses another's copy)."""
        return max(self.cross, 0)

    @property
    def cross_copy_of(self) -> int | None:
        """The earlier segment whose v_cross this one uses, or None (it keeps its own, or none)."""
        return -self.cross - 1 if self.cross < 0 else None


def layout_rows(state: Mapping[str, torch.Tensor]) -> list[LayoutRow]:
    return [LayoutRow(*r) for r in state["layout"].tolist()]


class SegmentView(NamedTuple):
    """A segment's views into its parameter's state, and where it lies in the buffer."""

    offset: int
    seg: SegmentState


class StepView(NamedTuple):
    """What the update steps as one segment (``step_views``): views, buffer offset, and the
    first layout row it covers."""

    offset: int
    first: int
    seg: SegmentState


def _cross_entries(seg: Segment, block_size: int) -> int:
    return cross_length(block_size, seg.tensor_numel) if seg.numel else 0


def bits_of(codebook: torch.Tensor) -> int:
    return {16: 4, 256: 8}.get(codebook.numel(), 0)


def cross_column(segments: list[Segment], block_sizes: list[int]) -> list[int]:
    """The layout's v_cross column: each segment's entries, or -(k + 1) where segment k of the
    same buffer holds a piece of the same tensor (``segments.tensor_keys``, same shape and
    block size) and with it the copy both use. The factor is the tensor's, so pieces of one
    tensor in one buffer need one copy: a row-sharded tensor-parallel weight is a segment per
    row, a batch of matrices one per matrix (``segments.by_matrix``), and a copy per piece
    would cost more than AdamW's state."""
    first: dict[tuple, int] = {}
    out = []
    tensors = tensor_keys(segments)
    for k, (seg, bs) in enumerate(zip(segments, block_sizes, strict=True)):
        n = _cross_entries(seg, bs)
        key = (tensors[k], tuple(seg.shape), bs)
        if n:
            have = first.setdefault(key, k)
            if have != k:
                n = -(have + 1)
        out.append(n)
    return out


def block_owners(rows: list[LayoutRow], bits: int) -> list[int]:
    """For each layout row (offset, numel, start, block, v_cross entries), the segment whose
    block v and absmax it uses: its own, or the first of a run of row pieces of one
    column-blocked tensor (same columns of consecutive rows, one after the other in the buffer,
    one v_cross, codes on whole bytes). A column block holds a column of the tensor, and the
    run holds the same columns of its rows: one v and absmax per column serve them all, as for
    the rows of an FSDP shard, where one per row piece would keep more state than AdamW."""
    out: list[int] = []
    for k, row in enumerate(rows):
        out.append(k)
        if k == 0 or row.block >= 0 or row.cross >= 0 or row.numel == 0 or (row.numel * bits) % 8:
            continue
        prev = rows[k - 1]
        width = -row.block
        prev_copy = k - 1 if prev.cross > 0 else prev.cross_copy_of
        if (
            prev.block == row.block
            and prev.numel == row.numel
            and row.start == prev.start + width
            and row.offset == prev.offset + row.numel
            and row.start % width + row.numel <= width
            and row.cross_copy_of == prev_copy
        ):
            out[k] = out[k - 1]
    return out


def step_views(
    state: dict[str, torch.Tensor], segments: list[Segment] | None = None
) -> list[StepView]:
    """(buffer offset, first segment, views) for what the update steps as one segment: each
    segment, but a run of row pieces sharing their blocks (``block_owners``) as one piece of a
    tensor of their width (R rows of C columns, at its row r0: start r0 * C, blocks -C), which
    their contiguous memory is: per column one v and absmax, per row the tensor's v_cross.
    ``segments`` (the layout's, in its order) give each view its tensor's ``cross_groups``."""
    views = segment_views(state)
    rows = layout_rows(state)
    bits = bits_of(state["codebook"])
    owners = block_owners(rows, bits)
    out: list[StepView] = []
    k = 0
    while k < len(views):
        end = k + 1
        while end < len(views) and owners[end] == k:
            end += 1
        offset, st = views[k]
        if end - k > 1:
            width, n = -rows[k].block, rows[k].numel
            count = (end - k) * n
            nc = code_bytes(n, bits)
            at = st.codes.data_ptr() - state["codes"].data_ptr()
            st = SegmentState(
                rows[k].start // width * n,
                count,
                -n,
                codes=state["codes"][at : at + (end - k) * nc],
                absmax=st.absmax,
                v=st.v,
                v_cross=st.v_cross,
            )
        if segments is not None and st.v_cross is not None:
            st.cross_groups = cross_groups(segments[k], rows[k].block)
        out.append(StepView(offset, k, st))
        k = end
    return out


def allocate(
    segments: list[Segment], block_sizes: list[int], codebook: torch.Tensor, device: torch.device
) -> dict[str, torch.Tensor]:
    bits = bits_of(codebook)
    n_codes = n_blocks = n_dense = 0
    cross = cross_column(segments, block_sizes)
    rows = [
        LayoutRow(s.offset, s.numel, s.start, bs, nx)
        for s, bs, nx in zip(segments, block_sizes, cross, strict=True)
    ]
    owners = block_owners(rows, bits)
    for k, (seg, bs) in enumerate(zip(segments, block_sizes, strict=True)):
        if bs == 1:
            n_dense += seg.numel
        else:
            n_codes += code_bytes(seg.numel, bits)
            if owners[k] == k:
                n_blocks += num_blocks(seg.start, seg.numel, bs)
    f32 = dict(dtype=torch.float32, device=device)
    layout = torch.tensor(rows, dtype=torch.int64, device="cpu").view(-1, LAYOUT_COLS)
    n_cross = sum(n for n in cross if n > 0)
    return {
        "step": torch.tensor(0.0, dtype=torch.float32, device="cpu"),
        "layout": layout,
        "codebook": codebook.to(**f32),
        "codes": torch.zeros(n_codes, dtype=torch.uint8, device=device),
        "absmax": torch.zeros(n_blocks, **f32),
        "v": torch.zeros(n_blocks, **f32),
        "v_cross": torch.zeros(n_cross, **f32),
        "exp_avg": torch.zeros(n_dense, dtype=DENSE_DTYPE, device=device),
        "exp_avg_sq": torch.zeros(n_dense, dtype=DENSE_DTYPE, device=device),
    }


def segment_views(state: Mapping[str, torch.Tensor]) -> list[SegmentView]:
    """Each segment's views, in layout order."""
    bits = bits_of(state["codebook"])
    out: list[SegmentView] = []
    c = b = x = d = 0
    rows = layout_rows(state)
    owners = block_owners(rows, bits)
    for k, (offset, numel, start, bs, nx) in enumerate(rows):
        if bs == 1:
            st = SegmentState(
                start,
                numel,
                1,
                exp_avg=state["exp_avg"][d : d + numel],
                exp_avg_sq=state["exp_avg_sq"][d : d + numel],
            )
            d += numel
        else:
            nc, nb = code_bytes(numel, bits), num_blocks(start, numel, bs)
            st = SegmentState(
                start,
                numel,
                bs,
                codes=state["codes"][c : c + nc],
                absmax=state["absmax"][b : b + nb],
                v=state["v"][b : b + nb],
                v_cross=state["v_cross"][x : x + nx] if nx > 0 else None,
            )
            copy_of = rows[k].cross_copy_of
            if copy_of is not None:  # an earlier segment of the same tensor holds the copy
                st.v_cross = out[copy_of].seg.v_cross
            if owners[k] != k:  # a row of a run: the first row's column blocks
                st.absmax, st.v = out[owners[k]].seg.absmax, out[owners[k]].seg.v
                nb = 0
            c, b, x = c + nc, b + nb, x + rows[k].cross_entries
        out.append(SegmentView(offset, st))
    return out


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    """Bytes of optimizer state proper: what grows with the model (not layout or codebook)."""
    return sum(state[k].numel() * state[k].element_size() for k in GROWING_KEYS if k in state)


def upgrade(state: dict, segments: list[Segment]) -> dict:
    """A state saved by an earlier version, in today's format. Before ``v_cross`` existed (a
    4-column layout): given its column of v_cross entries and zeros for them; the factor is a
    ratio, so it is exact again after one step (``reference``). Before pieces of one tensor
    shared one copy (``cross_column``): the first piece's copy kept, the others dropped (every
    step wrote the same values into each). Before B = 1 state was bf16:
    fp32 ``exp_avg``/``exp_avg_sq`` rounded to the nearest bf16 once. A tensor saved as a
    strided view (torch.save keeps strides) is copied contiguous: the kernels read state as flat
    memory. Anything that does not fit is left for ``check_loaded`` to name, and nothing is
    written into the tensors given (a refused load leaves them as they were)."""
    if not isinstance(state, Mapping):
        return state
    state = {
        k: v.contiguous() if _dense(v) and not v.is_contiguous() else v for k, v in state.items()
    }
    for k in ("exp_avg", "exp_avg_sq"):
        if _dense(state.get(k)) and state[k].dtype == torch.float32:
            state[k] = state[k].to(DENSE_DTYPE)
    layout = state.get("layout")
    if "v_cross" not in state and _rows(layout, 4, segments) and _dense(state.get("v")):
        rows = layout.tolist()  # the 4 columns before CROSS
        entries = [
            _cross_entries(s, int(r[LayoutCol.BLOCK])) for s, r in zip(segments, rows, strict=True)
        ]
        state = {
            **state,
            "layout": torch.cat(
                [layout, torch.tensor(entries, dtype=layout.dtype, device=layout.device)[:, None]],
                dim=1,
            ),
            "v_cross": torch.zeros(sum(entries), dtype=torch.float32, device=state["v"].device),
        }
    return _one_copy(state, segments)


def _rows(layout: object, cols: int, segments: list[Segment]) -> bool:
    return (
        _dense(layout)
        and layout.dtype == torch.int64
        and layout.dim() == 2
        and layout.shape == (len(segments), cols)
    )


def _one_copy(state: dict, segments: list[Segment]) -> dict:
    """``state`` with one v_cross copy per tensor where it holds one per piece (``upgrade``);
    as it is where its layout is anything else (``check_loaded`` names what is wrong)."""
    layout, vx = state.get("layout"), state.get("v_cross")
    if not _rows(layout, LAYOUT_COLS, segments) or not _dense(vx):
        return state
    rows = layout_rows(state)
    want = cross_column(segments, [r.block for r in rows])
    saved = [r.cross for r in rows]
    if saved == want or sum(saved) != vx.numel():
        return state
    keep, at = [], 0
    for n, w in zip(saved, want, strict=True):
        if n != (w if w >= 0 else saved[-w - 1]):
            return state
        if w > 0:
            keep.append(vx[at : at + n])
        at += n
    new = layout.clone()
    new[:, LayoutCol.CROSS] = torch.tensor(want, dtype=layout.dtype)
    return {**state, "layout": new, "v_cross": torch.cat(keep) if keep else vx[:0].clone()}


def _dense(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.layout == torch.strided and t.device.type != "meta"


def check_loaded(state: dict, segments: list[Segment], bits: int, name: str) -> None:
    """Raise ValueError (TypeError for a value that is not a tensor) naming the parameter and
    the key when a saved state does not fit the parameter or holds what no run writes
    (``load_check``): the load pre-hook calls this for every parameter before installing any."""
    load_check.check_entry(state, name)
    load_check.check_step(state["step"], name)
    where = f"Gefen state of {name}"
    layout = state["layout"]
    if layout.dim() != 2 or layout.shape[1] != LAYOUT_COLS:
        raise ValueError(
            f"{where}: 'layout' is {tuple(layout.shape)}, expected (segments, {LAYOUT_COLS})"
        )
    rows = layout_rows(state)
    saved = [(r.offset, r.numel, r.start) for r in rows]
    here = [(s.offset, s.numel, s.start) for s in segments]
    if saved != here:
        raise ValueError(
            f"{where}: its 'layout' was saved for segments (offset, numel, start) {saved}, "
            f"but the parameter here has {here}: a different model or sharding"
        )
    load_check.check_codebook(state["codebook"], bits, name)
    blocks = [r.block for r in rows]
    for seg, bs in zip(segments, blocks, strict=True):
        row = seg.tensor_numel // seg.shape[0] if len(seg.shape) > 1 and seg.shape[0] else 0
        batch = matrix_batch(seg.shape)
        periods = sorted({row, batch.cols} if batch is not None else {row})
        if not (1 <= bs <= MAX_BLOCK or (bs < 0 and row and -bs in periods)):
            allowed = " or ".join(f"-{p}" for p in periods)
            columns = f", or {allowed} for its columns" if row else ""
            raise ValueError(
                f"{where}: its 'layout' gives block size {bs} for a tensor of shape "
                f"{seg.shape} (must be 1 to {MAX_BLOCK}{columns})"
            )
    ref = allocate(segments, blocks, state["codebook"].float(), torch.device("meta"))
    got, want = (t[:, LayoutCol.CROSS].tolist() for t in (layout, ref["layout"]))
    if got != want:
        raise ValueError(
            f"{where}: its 'layout' gives v_cross entries per segment {got}, "
            f"expected {want} for these tensors and block sizes"
        )
    for k in GROWING_KEYS:
        t = state[k]
        if t.shape != ref[k].shape:
            raise ValueError(
                f"{where}: {k!r} is {t.dtype} {tuple(t.shape)}, expected {ref[k].dtype} "
                f"{tuple(ref[k].shape)} for the segments and block sizes of its 'layout'"
            )
    load_check.check_distinct(state, name)
    load_check.check_values(state, name)


@dataclass
class SegmentState:
    """Views into a parameter's state tensors for one segment (the module docstring)."""

    start: int
    numel: int
    block_size: int
    codes: torch.Tensor | None = None
    absmax: torch.Tensor | None = None
    v: torch.Tensor | None = None
    exp_avg: torch.Tensor | None = None
    exp_avg_sq: torch.Tensor | None = None
    v_cross: torch.Tensor | None = None
    cross_groups: int = 1
    """Equal slices of ``v_cross`` whose factor is normalised apart (``cross_groups``)."""


def cross_groups(seg: Segment, block_size: int) -> int:
    """Slices of a tensor's ``v_cross`` whose factor is normalised apart: the matrices of a batch
    of matrices with column blocks, 1 elsewhere. Such a tensor keeps one v_cross entry per row of
    each matrix, and a row's mean g^2 carries its matrix's scale, which the matrix's own column
    v already hold. Normalised over the whole tensor, a matrix of smaller gradients (an expert
    that fewer tokens reach) would be divided by its scale twice: its factor floored, its steps
    up to 1 / sqrt(CROSS_FLOOR) times AdamW's. Contiguous blocks keep one entry per position
    of the row, shared by every matrix: its mean g^2 is averaged over them, so their scales do
    not separate it."""
    batch = matrix_batch(seg.shape)
    if batch is None or block_size >= 0:
        return 1
    rows = cross_length(block_size, seg.tensor_numel)
    # one entry per matrix (columns across the matrices, which a checkpoint saved before the
    # batch rule may hold) leaves nothing to normalise apart
    return batch.count if rows and rows % batch.count == 0 and rows > batch.count else 1


def cross_length(block_size: int, tensor_numel: int) -> int:
    """Entries of a tensor's ``v_cross``: its B positions for contiguous blocks, its rows for
    column blocks; none for B = 1 or a tensor of fewer than MIN_CROSS_BLOCKS blocks, where the
    factor would cost more than 4 / MIN_CROSS_BLOCKS bytes per parameter (and a tensor of two or
    three blocks is better served by their own v's). A function of the tensor, not of the
    piece, so every rank that holds a piece keeps the same entries."""
    if block_size > 1:
        return block_size if -(-tensor_numel // block_size) >= MIN_CROSS_BLOCKS else 0
    if block_size < 0:
        rows = -(-tensor_numel // -block_size)
        return rows if -block_size >= MIN_CROSS_BLOCKS and rows > 1 else 0
    return 0
