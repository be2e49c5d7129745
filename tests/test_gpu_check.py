"""launch/gpu_check.py, the script a lent GPU runs, end to end here: its Triton kernels run under
Triton's interpreter on CPU tensors (--interpret), so the script is known to work before a GPU
ever runs it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytestmark = pytest.mark.triton

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    """One whole run, checks then timings, at a tiny scale: its report after a clean exit."""
    out = tmp_path_factory.mktemp("gpu_check")
    cmd = [sys.executable, str(ROOT / "launch" / "gpu_check.py"), "--out", str(out)]
    cmd += ["--interpret", "--scale", "0.000004", "--steps", "2"]  # 16 matrices of 16 x 16
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = json.loads((out / "gpu_check.json").read_text())
    rep["_md"] = (out / "gpu_check.md").read_text()
    return rep


def test_gpu_check_runs_its_checks_under_the_interpreter(report):
    checks = report["checks"]
    assert report["checks_ok"] and all(c["ok"] for c in checks)
    layouts = {c.get("layout") for c in checks}
    assert {"prime", "odd_start_odd_block", "long_block", "flat_shard", "columns"} <= layouts
    for bits in (4, 8):  # every dtype meets every width over the layouts
        got = {c["dtype"] for c in checks if c.get("bits") == bits}
        assert got == {"torch.float32", "torch.bfloat16", "torch.float16"}, (bits, got)
    assert {c["backend"] for c in checks if "backend" in c} == {"triton"}
    assert report["interpret"] and "interpreter" in report["device"].lower()
    assert any(c.get("check") == "histogram" for c in checks)
    (whole,) = [c for c in checks if c.get("check") == "optimizer"]
    assert whole["layouts_equal"] and whole["codebooks_equal"] and whole["resumed_equal"]
    assert "checks against the reference" in report["_md"].lower()


def test_gpu_check_times_both_sets_and_judges_no_goal_under_the_interpreter(report):
    """The timing half too (a lent GPU runs it once, unseen before): every optimizer of the
    1B-parameter set's table and GPT-2's 148 tensors get a step time; no goal is judged on
    the interpreter's times."""
    timings = report["timings"]
    done = {(t["set"], t["dtype"], t["optimizer"]) for t in timings if "median_ms" in t}
    for dtype in ("torch.float32", "torch.bfloat16"):
        assert {("matrices", dtype, n) for n in ("adamw_fused", "gefen4", "gefen8")} <= done
    assert {("gpt2_124m", "torch.float32", n) for n in ("adamw_fused", "gefen4")} <= done
    assert {t["tensors"] for t in timings if t["set"] == "gpt2_124m" and "tensors" in t} == {148}
    assert {t["backend"] for t in timings if "backend" in t} == {"triton"}
    timed = [t for t in timings if "median_ms" in t]
    assert all(0 < t["host_ms"] <= t["median_ms"] and t["device_ops"] is None for t in timed)
    assert report["goals"] == dict(
        judged=False, why="Triton interpreter on the CPU: not a GPU's times"
    )
    assert "| gpt2_124m | torch.float32 | gefen4" in report["_md"]


def test_gpu_checks_training_run_works_on_cpu():
    """check_train, which the script runs only on a GPU (on one NCCL rank), here on the CPU."""
    import torch

    sys.path.insert(0, str(ROOT / "launch"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(ROOT / "launch"))
    got = gpu_check.check_train(torch.device("cpu"), "fsdp2")
    assert got["ok"] and got["rc"] == 0 and got["val_loss"] > 0, got
