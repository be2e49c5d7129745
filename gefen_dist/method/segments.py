"""Segments: the unit the state manager works on.

A segment is a contiguous run of one original tensor's elements inside the buffer the optimizer is
handed. A plain parameter is one segment; an FSDP flat shard or a DeepSpeed ZeRO partition is
several, and a tensor split over ranks is a segment on each rank. Blocks are laid in the original
tensor's coordinates (block k covers elements [kB, (k+1)B) of the flattened tensor) and cut at
segment boundaries, so every rank that holds a piece of a tensor agrees on where blocks lie without
talking to the others, and no block ever crosses a segment or a shard.

Column blocks (block size -P, see ``partition``) are cut the same way: a segment's block k holds
its elements i with i = k mod P, so each segment (each rank's piece) keeps its own v and absmax
per column it holds.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from .partition import matrix_batch


@dataclass(frozen=True)
class Segment:
    """Where one original tensor's piece sits in the optimizer's buffer.

    ``offset``: first element inside the buffer; ``numel``: length of the run; ``start``: index of
    the run's first element in the original tensor, flattened; ``shape``: the original tensor's
    shape (the partition reads its structure from it); ``name``: for error messages.
    """

    offset: int
    numel: int
    start: int
    shape: tuple[int, ...]
    name: str = ""

    def __post_init__(self) -> None:
        total = 1
        for s in self.shape:
            total *= s
        if self.offset < 0 or self.numel < 0 or self.start < 0:
            raise ValueError(f"segment {self.name!r}: offset, numel and start must be >= 0")
        if self.start + self.numel > total:
            raise ValueError(
                f"segment {self.name!r}: elements [{self.start}, {self.start + self.numel}) "
                f"lie outside a tensor of shape {self.shape}"
            )

    @property
    def tensor_numel(self) -> int:
        total = 1
        for s in self.shape:
            total *= s
        return total


def encode(segments: Iterable[Segment], names: Iterable[str] | None = None) -> list[list[Any]]:
    """Segments as checkpoints store them: plain rows [offset, numel, start, shape, name], so that
    reading a checkpoint needs no gefen_dist class. ``names`` replaces the segments' own names
    (DeepSpeed stores each piece's tensor label)."""
    segs = list(segments)
    labels = [s.name for s in segs] if names is None else list(names)
    if len(labels) != len(segs):
        raise ValueError(f"encode: {len(segs)} segments but {len(labels)} names")
    return [
        [s.offset, s.numel, s.start, list(s.shape), n] for s, n in zip(segs, labels, strict=True)
    ]


def decode(rows: Iterable[Sequence[Any]]) -> list[Segment]:
    """``encode``'s rows (lists, or the tuples older checkpoints hold) as segments."""
    return [Segment(int(o), int(n), int(s), tuple(shape), name) for o, n, s, shape, name in rows]


@dataclass(frozen=True)
class Run:
    """Equal-length consecutive blocks of a segment: ``count`` blocks of ``length`` elements that
    start at element ``elem`` of the segment and at block ``block`` of the segment's blocks."""

    elem: int
    block: int
    length: int
    count: int


def num_blocks(start: int, numel: int, block_size: int) -> int:
    if numel == 0:
        return 0
    if block_size < 0:
        return min(numel, -block_size)
    return (start + numel - 1) // block_size - start // block_size + 1


def block_runs(start: int, numel: int, block_size: int) -> list[Run]:
    """Split a segment into at most three runs (cut head block, whole blocks, cut tail block), so
    the update can view each run as a (count, length) matrix."""
    if numel == 0:
        return []
    end = start + numel
    runs: list[Run] = []
    elem = block = 0
    head = (-start) % block_size
    if head:
        length = min(head, numel)
        runs.append(Run(0, 0, length, 1))
        elem, block = length, 1
    whole = (end - (start + elem)) // block_size
    if whole:
        runs.append(Run(elem, block, block_size, whole))
        elem += whole * block_size
        block += whole
    if elem < numel:
        runs.append(Run(elem, block, numel - elem, 1))
    return runs


@dataclass(frozen=True)
class Chunk:
    """Elements [elem, end) of a segment: blocks ``blocks`` of ``length`` elements each."""

    elem: int
    end: int
    blocks: slice
    length: int

    @property
    def rows(self) -> int:
        return self.blocks.stop - self.blocks.start


def block_chunks(start: int, numel: int, block_size: int, max_elems: int) -> Iterator[Chunk]:
    """A segment's blocks in chunks of equal-length whole blocks, at most max(max_elems, one
    block) elements each, so work on a chunk can view it as a (rows, length) matrix and never
    allocates more than a chunk's worth."""
    for run in block_runs(start, numel, block_size):
        rows = max(1, max_elems // run.length)
        for r0 in range(0, run.count, rows):
            r1 = min(r0 + rows, run.count)
            yield Chunk(
                run.elem + r0 * run.length,
                run.elem + r1 * run.length,
                slice(run.block + r0, run.block + r1),
                run.length,
            )


def column_chunks(numel: int, period: int, max_elems: int) -> Iterator[tuple[int, int, int]]:
    """A column-blocked segment (block k: its elements i = k mod period) in chunks of whole rows
    of its (rows, period) view, at most max(max_elems, one row) elements each, the short last
    row on its own: (lo, hi, width), elements [lo, hi) viewing as (-1, width), column j of the
    view being block j."""
    step = max(1, max_elems // period) * period
    for a in range(0, numel, step):
        b = min(a + step, numel)
        whole = a + (b - a) // period * period
        if whole > a:
            yield a, whole, period
        if b > whole:
            yield whole, b, b - whole


def by_matrix(segments: Iterable[Segment]) -> list[Segment]:
    """``segments`` cut where the matrices of a batch-of-matrices tensor meet
    (``partition.matrix_batch``: grouped expert weights), so that every segment lies in one
    matrix. Why: a segment's column blocks hold its elements i = k mod P, and the columns of a
    batch are one matrix's (partition, "Batches of matrices"); cut so, the state, the kernels,
    the checkpoints and the elastic reload treat each piece as they treat any segment. A
    function of the shapes alone, so every rank and every reload cuts alike."""
    out: list[Segment] = []
    for seg in segments:
        batch = matrix_batch(seg.shape)
        if batch is None or seg.numel == 0:
            out.append(seg)
            continue
        for _, lo, hi in batch.runs(seg.start, seg.numel):
            out.append(Segment(seg.offset + lo - seg.start, hi - lo, lo, seg.shape, seg.name))
    return out


def whole_tensor(shape: tuple[int, ...], name: str = "") -> list[Segment]:
    """The segments one process keeps for a whole tensor of ``shape`` (a plain parameter, a
    consolidated checkpoint's entry): one, or one per matrix of a batch (``by_matrix``)."""
    total = 1
    for s in shape:
        total *= s
    return by_matrix([Segment(0, total, 0, tuple(shape), name)])


def tensor_keys(segments: Sequence[Segment]) -> list[Hashable]:
    """Which tensor each segment of one buffer (in offset order) is a piece of: its name, or,
    unnamed, the index of the first segment of its run, where ``by_matrix`` cut one unnamed
    piece into several (same shape, each continuing the last in the buffer and the tensor).
    The first step chooses one block size per tensor, and ``state.cross_column`` keeps one
    v_cross per tensor, by these keys."""
    out: list[Hashable] = []
    for k, seg in enumerate(segments):
        prev = segments[k - 1] if k else None
        if seg.name:
            out.append(seg.name)
        elif (
            prev is not None
            and not prev.name
            and prev.shape == seg.shape
            and seg.start > 0
            and seg.start == prev.start + prev.numel
            and seg.offset == prev.offset + prev.numel
            and matrix_batch(seg.shape) is not None
        ):
            out.append(out[-1])
        else:
            out.append(k)
    return out


def plain_segments(numel: int, shape: tuple[int, ...], name: str = "") -> list[Segment]:
    return [Segment(offset=0, numel=numel, start=0, shape=tuple(shape), name=name)]
