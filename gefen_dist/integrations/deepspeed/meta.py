"""The entry a rank's ``Gefen.state_dict()`` gains under DeepSpeed, as checkpoints store it.

``{META_KEY: {"wrapper": kind, "rank": r, "world_size": n, "flats": [...]}}``, one ``flats``
item per partition in state-dict order: ``{"buffer": i, "group": g, "segments": [row, ...]}``,
each row a plain list (``method.segments.encode``, labelled by tensor) so that a checkpoint
needs no gefen_dist class to be read. Checkpoints saved before ``flats`` was recorded lack it, and
before ``group`` was, lack that (the buffer index stood for the group).
"""

from __future__ import annotations

from typing import Any

__all__ = ["META_KEY", "placement"]

META_KEY = "gefen_deepspeed"
"""Key of the entry ``Gefen.state_dict()`` gains under DeepSpeed: wrapper, rank and world size."""


def placement(kind: str, rank: int, world_size: int) -> dict[str, Any]:
    """The entry's placement keys: which wrapper, and which rank of how many."""
    return {"wrapper": kind, "rank": rank, "world_size": world_size}
