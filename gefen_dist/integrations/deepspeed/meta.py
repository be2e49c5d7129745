"""The entry a rank's ``Gefen.state_dict()`` gains under DeepSpeed, as checkpoints store it.

``{META_KEY: {"wrapper": kind, "rank": r, "world_size": n, "flats": [...]}}``, one ``flats``
item per partition in state-dict order: ``{"buffer": i, "group": g, "segments": [row, ...]}``,
each row a plain list (``SegmentRow``'s fields in order) so that a checkpoint needs no
gefen_dist class to be read. Checkpoints saved before ``flats`` was recorded lack it, and
before ``group`` was, lack that (the buffer index stood for the group).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from ...method.segments import Segment

__all__ = ["META_KEY", "SegmentRow", "placement"]

META_KEY = "gefen_deepspeed"
"""Key of the entry ``Gefen.state_dict()`` gains under DeepSpeed: wrapper, rank and world size."""


class SegmentRow(NamedTuple):
    """One segment of a saved partition, and the tensor it belongs to ("" for padding)."""

    offset: int
    numel: int
    start: int
    shape: list[int]
    label: str

    @classmethod
    def of(cls, seg: Segment, label: str) -> list[Any]:
        """The row as stored: a list, in field order."""
        return list(cls(seg.offset, seg.numel, seg.start, list(seg.shape), label))

    @classmethod
    def read(cls, row: list[Any]) -> Segment:
        """A stored row as a segment named by its tensor ("" for padding)."""
        offset, numel, start, shape, label = row
        return Segment(offset, numel, start, tuple(shape), label)


def placement(kind: str, rank: int, world_size: int) -> dict[str, Any]:
    """The entry's placement keys: which wrapper, and which rank of how many."""
    return {"wrapper": kind, "rank": rank, "world_size": world_size}
