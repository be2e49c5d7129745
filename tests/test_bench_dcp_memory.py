"""``gefen_dist.bench.dcp_memory`` on a small GPT (its smoke shape), saved and loaded on 2 ranks:
the report is written, and the plain DCP loop reads each rank's share of the optimizer state
where the consolidating path reads all of it on every rank (what the benchmark is for; its
figures at 124M parameters are results/checkpoints/dcp_memory.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.dist


def test_the_plain_loop_reads_a_share_and_consolidation_reads_the_whole(tmp_path):
    cmd = [
        sys.executable, "-m", "gefen_dist.bench.dcp_memory", "run", "--ck", str(tmp_path / "ck"),
        "--out", str(tmp_path / "out"), "--shape", "2,2,64,256", "--worlds", "2",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "dcp_memory.json").read_text())
    assert (tmp_path / "out" / "dcp_memory.md").read_text().startswith("# Host memory")
    whole = report["save"]["checkpoint"]["tensor_bytes"]["optim"]
    loads = {(x["path"], x["malloc"]): x for x in report["loads"]}
    assert len(loads) == 4 and all(x["world"] == 2 for x in loads.values())
    for (path, _), x in loads.items():
        for r in x["ranks"]:
            assert r["state_bytes"] > 0 and r["growth"] > 0
            if path == "old":
                assert r["optim_read_bytes"] == whole
            else:  # half the codes, and the block values of the saved piece its rows meet
                assert whole / 2 <= r["optim_read_bytes"] <= whole * (1 / 2 + 0.15)
