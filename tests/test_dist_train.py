"""The README's distributed examples (launch/dist_train.py), run as written, 2 CPU ranks."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from dist_util import free_port

SCRIPT = Path(__file__).parent.parent / "launch" / "dist_train.py"


def _launch(mode: str, out: Path) -> dict:
    args = [str(SCRIPT), "--mode", mode, "--steps", "3", "--n-layer", "1", "--json", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if mode == "deepspeed":
        cmd = ["deepspeed", "--num_gpus", "2", f"--master_port={free_port()}", *args]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            f"--master_port={free_port()}",
            *args,
        ]
        if mode == "accelerate":
            env["ACCELERATE_USE_CPU"] = "true"
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("mode", ["ddp", "fsdp1", "fsdp2", "deepspeed", "accelerate"])
def test_readme_example_trains_with_a_fraction_of_adamw_state(mode, tmp_path):
    res = _launch(mode, tmp_path / "out.json")
    assert len(res["ranks"]) == 2
    for r in res["ranks"]:
        assert 0 < r["state_bytes"] < 0.25 * r["adamw_bytes"]
    if mode in ("ddp", "accelerate"):  # replicated: both ranks hold the whole state
        assert res["ranks"][0]["state_bytes"] == res["ranks"][1]["state_bytes"]
    assert res["final_loss"] < 5.6  # ln(256) = 5.55 at init; 3 steps move it down
