"""The learning-rate schedule of the demo, the main job, the benchmark suite and launch/train.py.

Why one function: their runs are compared with each other and with AdamW's, step for step, so
they must all scale the lr by the same numbers; three copies of the formula could drift apart.
"""

from __future__ import annotations

import math


def warmup_cosine(step: int, steps: int, warmup: int, floor: float) -> float:
    """The lr's multiplier at 0-based ``step`` of ``steps``: linear warmup over ``warmup``
    steps (1/warmup at step 0, 1 at the last warmup step), then a cosine from 1 down to
    ``floor`` at the last step."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
