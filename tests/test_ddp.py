"""Gefen under DistributedDataParallel on 2 gloo ranks (tests/dist/ddp_equivalence.py).

DDP needs no integration: replicated parameters and all-reduced gradients mean every rank runs
the single-process optimizer on the same numbers. With the whole batch on every rank ("same")
the all-reduced mean is bitwise the single-process gradient and the run must be identical; with
the batch split ("split") only fp32 rounding of the average differs: the codebook must be the
one a single process learns from that averaged gradient, exactly, and the loss follow the
whole-batch run within 2e-4 (as test_fsdp.py).
"""

from __future__ import annotations

import pytest
from dist_util import read_results, torchrun

pytestmark = pytest.mark.dist

STEPS = 5


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    torchrun("ddp_equivalence.py", str(out), str(STEPS))
    return read_results(out, ranks=2)


@pytest.mark.parametrize("mode", ["same", "split"])
def test_every_rank_holds_the_same_optimizer_state(ddp, mode):
    r0, r1 = (r[mode] for r in ddp)
    assert r0["digest"] == r1["digest"]
    assert r0["codebooks"] == r1["codebooks"] and len(r0["codebooks"]) == 1
    assert r0["blocks"] == r1["blocks"]


@pytest.mark.parametrize("mode", ["same", "split"])
def test_blocks_and_codebook_are_the_single_process_ones(ddp, mode):
    ref = ddp[0]["ref"]
    run = ddp[0][mode]
    assert run["blocks"] == ref["blocks"]
    assert any(bs > 1 for bs in run["blocks"].values())
    # the codebook one process learns from the run's own first (averaged) gradient, bit for
    # bit; with the whole batch on every rank that is also the single-process run's
    assert run["codebooks"] == run["solo_codebooks"] and len(run["codebooks"]) == 1
    if mode == "same":
        assert run["codebooks"] == ref["codebooks"]


def test_same_batch_run_is_the_single_process_run(ddp):
    run = ddp[0]["same"]
    assert run["losses"] == ddp[0]["ref"]["losses"]
    assert max(run["param_drift"].values()) == 0.0


def test_split_batch_run_follows_the_single_process_run(ddp):
    run, ref = ddp[0]["split"], ddp[0]["ref"]
    drift = max(abs(a - b) for a, b in zip(run["losses"], ref["losses"], strict=True))
    assert drift <= 2e-4


def test_resume_from_rank0_checkpoint_is_bit_exact(ddp):
    for r in ddp:
        res = r["resume"]
        assert res["state_exact"] and res["params_exact"]
        assert res["resumed_losses"] == res["losses"]
