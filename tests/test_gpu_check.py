"""launch/gpu_check.py, the script a lent GPU runs, stays runnable: here on the CPU (C++ kernel)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_runs_its_checks_on_cpu(tmp_path):
    cmd = [
        sys.executable,
        str(ROOT / "launch" / "gpu_check.py"),
        "--out",
        str(tmp_path),
        "--device",
        "cpu",
        "--checks-only",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    checks = report["checks"]
    assert report["checks_ok"] and all(c["ok"] for c in checks)
    layouts = {c.get("layout") for c in checks}
    assert {"prime", "odd_start_odd_block", "long_block", "flat_shard"} <= layouts
    assert {c["backend"] for c in checks if "backend" in c} == {"native-cpu"}
    assert any(c.get("check") == "histogram" for c in checks)
    assert "checks against the reference" in (tmp_path / "gpu_check.md").read_text().lower()
