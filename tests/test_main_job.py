"""The README's main job, ``launch/main_job.py --quick``, end to end on 2 CPU ranks (gloo)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.slow]

ROOT = Path(__file__).parent.parent


def test_quick_main_job_writes_a_sane_report(tmp_path):
    """Gefen and AdamW each train in their own 2-rank launch; the report must show the claim."""
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "launch" / "main_job.py"), "--quick", "--out", str(out),
           "--no-progress"]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    for name in ("report.md", "results.json", "loss_curves.png", "state_per_rank.png"):
        assert (out / name).stat().st_size > 0, name
    for png in ("loss_curves.png", "state_per_rank.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    res = json.loads((out / "results.json").read_text())
    gefen, adamw = res["gefen"], res["adamw"]
    assert gefen["config"]["sharding"] == adamw["config"]["sharding"]
    assert len(gefen["ranks"]) == len(adamw["ranks"]) == 2
    for g, a in zip(gefen["ranks"], adamw["ranks"], strict=True):
        assert g["state_params"] == a["state_params"] > 0
        assert 0 < g["state_bytes"] < 0.2 * a["state_bytes"], (g, a)
        assert g["peak_rss_bytes"] > 0 and g["step_time_median_s"] > 0
    for r in (gefen, adamw):
        losses = [c["val_loss"] for c in r["curve"]]
        assert all(math.isfinite(x) for x in losses)
        assert r["final_val_loss"] < losses[0] - 0.5  # ln 256 = 5.55 at init
        train = [c["train_loss"] for c in r["curve"][1:]]
        assert all(math.isfinite(x) for x in train) and train[-1] < train[0]
    # the claim: no worse than AdamW by more than 0.3; on the better side only a sanity bound
    # (since the factor's one-step lag, Gefen leads this 60-step run by 0.31, before by 0.23)
    assert -0.5 < gefen["final_val_loss"] - adamw["final_val_loss"] < 0.3
    report = (out / "report.md").read_text()
    assert "| gefen | 1 |" in report and "loss_curves.png" in report
