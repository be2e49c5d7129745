"""Plain DCP resumes Gefen under FSDP2 and HSDP at another layout, with no consolidation.

Four torchrun launches (``tests/dist/dcp_reshard.py``) save the demo GPT under FSDP2 on 1, 2 and
4 ranks and under HSDP on a 2 x 2 mesh (10 steps at 4 bits, checkpoint at step 5), and resume
each elsewhere exactly as a user does: ``get_state_dict`` on a fresh model and optimizer,
``dcp.load`` with no planner, ``set_state_dict``. Covered: FSDP2 2 -> 1, 1 -> 2, 2 -> 4, 4 -> 2,
1 -> 4, HSDP -> FSDP2 at 4 and at 2, FSDP2 -> HSDP, and each layout back into itself.

How close, and why:

- At the saving layout every rank's Gefen state is the one it saved, bit for bit, and the
  losses repeat the uninterrupted run's exactly: each rank reads its own pieces.
- Elsewhere the first resumed loss is the saved model's, to the ranks' summation order (bound
  1e-6, ``tests/test_elastic.py``'s), and the rest stay within the elastic bound 5e-4
  (``tests/test_fsdp_elastic.py``'s), against the saving run's own uninterrupted losses; block
  pieces that a boundary of either layout cuts are merged or split (``method.portable``).
- Every layout keeps the single-process block sizes, which DCP's template alone would not give
  (it is built by a zero-gradient step).
"""

from __future__ import annotations

import pytest
from dist_util import read_results, resume_drift, torchrun

pytestmark = pytest.mark.dist

STEPS, SAVE_AT, BITS = 10, 5, 4
FIRST_TOL, NEW_LAYOUT_TOL = 1e-6, 5e-4
# (saved checkpoint, resumed layout, world) per launch, in launch order: each launch's saves
# come first, its resumes read only checkpoints saved by then
LAUNCHES = [
    (2, ["fsdp2"], [("fsdp2-w2", "fsdp2")]),
    (1, ["fsdp2"], [("fsdp2-w2", "fsdp2")]),
    (
        4,
        ["fsdp2", "hsdp2"],
        [
            ("fsdp2-w2", "fsdp2"),
            ("fsdp2-w1", "fsdp2"),
            ("hsdp2-w4", "fsdp2"),
            ("fsdp2-w4", "hsdp2"),
            ("hsdp2-w4", "hsdp2"),
        ],
    ),
    (2, [], [("fsdp2-w1", "fsdp2"), ("fsdp2-w4", "fsdp2"), ("hsdp2-w4", "fsdp2")]),
]
RESUMES = [(saved, layout, world) for world, _, rs in LAUNCHES for saved, layout in rs]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("dcp_reshard")
    out, ck = str(d / "out"), str(d / "ck")
    (d / "ck").mkdir()
    saves, resumed = {}, {}
    for world, layouts, resumes in LAUNCHES:
        jobs: list[str] = []
        for layout in layouts:
            jobs += ["save", out, ck, layout, str(STEPS), str(SAVE_AT), str(BITS), "+"]
        for saved, layout in resumes:
            jobs += ["resume", out, ck, saved, layout, str(SAVE_AT), str(STEPS), str(BITS), "+"]
        torchrun("dcp_reshard.py", *jobs[:-1], nproc=world, timeout=900)
        for layout in layouts:
            name = f"{layout}-w{world}"
            saves[name] = read_results(d / "out" / f"save-{name}", ranks=world)
        for saved, layout in resumes:
            name = f"resume-{saved}-to-{layout}-w{world}"
            resumed[(saved, layout, world)] = read_results(d / "out" / name, ranks=world)
    return saves, resumed


def _id(case):
    saved, layout, world = case
    return f"{saved}-to-{layout}-w{world}"


def _drift(runs, case) -> list[float]:
    saves, resumed = runs
    return resume_drift(saves[case[0]][0]["losses"], resumed[case][0]["losses"], SAVE_AT)


def test_report(runs, capsys):
    """The figures docs/checkpoints.md quotes (``pytest tests/test_dcp_reshard.py -s``)."""
    _, resumed = runs
    with capsys.disabled():
        print("\nsaved -> resumed: first, largest relative loss difference; bytes read per rank")
        for case in RESUMES:
            d = _drift(runs, case)
            share = max(r["read_bytes"] / r["saved_bytes"] for r in resumed[case])
            print(f"  {_id(case)}: {d[0]:.1e}, {max(d):.1e}; {share:.2f} of the saved state")


@pytest.mark.parametrize("case", RESUMES, ids=[_id(c) for c in RESUMES])
def test_each_rank_reads_its_share_and_the_block_values_around_it(runs, case):
    """No rank reads the whole saved optimizer state (what consolidation costs): its rows'
    share of the per-element fields, and the block values of the saved ranges its rows meet,
    which can add one whole saved range (at B >= 64 block values are at most 8 / 64 bytes per
    element against the codes' 1): bound 1 / shards + 0.15 of the saved bytes, where shards
    is the number of pieces a tensor is cut into (HSDP's replicas each read a shard's)."""
    _, resumed = runs
    _, layout, world = case
    shards = world // 2 if layout == "hsdp2" else world
    for r in resumed[case]:
        assert 0 < r["read_bytes"] <= r["saved_bytes"] * (1 / shards + 0.15), r


@pytest.mark.parametrize("case", RESUMES, ids=[_id(c) for c in RESUMES])
def test_plain_dcp_resumes_at_any_layout_within_the_bound(runs, case):
    saves, resumed = runs
    saved, layout, world = case
    got = resumed[case]
    base = saves[saved][0]
    drift = resume_drift(base["losses"], got[0]["losses"], SAVE_AT)
    assert got[0]["blocks"] == base["blocks"]
    if saved == f"{layout}-w{world}":
        assert all(r["state_as_saved"] for r in got), "a rank's state is not the one it saved"
        assert max(drift) == 0.0
        return
    assert drift[0] <= FIRST_TOL
    assert max(drift) <= NEW_LAYOUT_TOL, f"max relative loss drift {max(drift):.2e}"


def test_every_layout_saves_the_single_process_blocks(runs):
    saves, _ = runs
    blocks = [r[0]["blocks"] for r in saves.values()]
    assert len(saves) == 4
    assert all(b == blocks[0] for b in blocks)
    assert {bs for bs in blocks[0].values()} - {1}, "no tensor kept blocks: nothing was tested"
