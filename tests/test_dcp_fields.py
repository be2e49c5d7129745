"""Format 2's block-value tables read in one process (``integrations.dcp``), on a real state.

A tensor-parallel rank's piece of a column-blocked weight is one run per row, and its rows
share one v and absmax per column; the checkpoint stores them once, each later row naming the
first as its ``source``. Here a one-process state of such a weight (101 x 63, column blocks)
is written as that table, one row piece per row, and read back whole: the state it came from,
bit for bit. The earlier three-column table (no source) still loads, and a source that is not
an earlier row of the same columns is refused by name.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from gefen_dist import Gefen
from gefen_dist.integrations import dcp as fields
from gefen_dist.method import portable
from gefen_dist.method.segments import whole_tensor

pytestmark = pytest.mark.unit

SHAPE, NAME, RUN = (101, 63), "fc.weight", 0x5EED


@pytest.fixture(scope="module")
def column_state() -> dict[str, torch.Tensor]:
    """A state with column blocks: inputs of fixed gains from 0.7 to 1.4 in shuffled order, so
    g0 varies by column (``tests/dist/fsdp_common.Odd``'s weight)."""
    torch.manual_seed(0)
    fc = nn.Linear(SHAPE[1], SHAPE[0], bias=False)
    order = torch.randperm(SHAPE[1], generator=torch.Generator().manual_seed(0))
    gain = torch.logspace(-0.15, 0.15, SHAPE[1])[order]
    opt = Gefen([fc.weight], bits=4, lr=1e-2)
    for s in range(3):
        x = torch.randn(8, SHAPE[1], generator=torch.Generator().manual_seed(1000 + s))
        opt.zero_grad()
        torch.tanh(fc(x * gain)).square().mean().backward()
        opt.step()
    st = opt.state[fc.weight]
    assert int(st["layout"][0, 3]) == -SHAPE[1], "the weight should take column blocks"
    return st


def saved_as_rows(st: dict[str, torch.Tensor], table: list[list[int]]) -> dict:
    """``st`` as format 2's fields read whole, with ``table`` as its one range's pieces."""
    (ts,) = portable.export(st, whole_tensor(SHAPE, NAME))
    (piece,) = ts.pieces
    key = f"0.{SHAPE[0] * SHAPE[1]}"
    return {
        fields.FORMAT_KEY: torch.tensor([fields.FORMAT, RUN]),
        "step": st["step"],
        "codebook": st["codebook"],
        "block": torch.tensor(-SHAPE[1]),
        "v_cross": st["v_cross"],
        "codes": piece.codes.reshape(SHAPE),
        f"pieces.{key}": torch.tensor(table),
        f"v.{key}": piece.v,
        f"absmax.{key}": piece.absmax,
    }


def rows(source) -> list[list[int]]:
    return [[r * SHAPE[1], SHAPE[1], RUN, source(r)] for r in range(SHAPE[0])]


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_rows_that_share_the_first_row_s_column_values_restore_the_state_bit_for_bit(
    column_state,
):
    saved = saved_as_rows(column_state, rows(lambda r: 0))
    assert same(fields.whole_state(saved, SHAPE, NAME), column_state)


def test_a_three_column_table_of_one_piece_still_loads(column_state):
    saved = saved_as_rows(column_state, [[0, SHAPE[0] * SHAPE[1], RUN]])
    assert same(fields.whole_state(saved, SHAPE, NAME), column_state)


@pytest.mark.parametrize(
    "table",
    [
        rows(lambda r: r + 1 if r == 0 else 0),  # a later row
        rows(lambda r: 0 if r != 1 else 2),  # a row that itself takes another's
        [[0, 63, RUN, 0], [68, 40, RUN, 0]],  # a piece of other columns
    ],
    ids=["later", "not-own", "other-columns"],
)
def test_a_source_that_is_not_an_earlier_row_of_the_same_columns_is_refused(column_state, table):
    saved = saved_as_rows(column_state, table)
    with pytest.raises(ValueError, match=r"Gefen state for fc\.weight: pieces\.0\.6363 row \d+"):
        fields.whole_state(saved, SHAPE, NAME)
