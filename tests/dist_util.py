"""Run a script on 2 CPU ranks (gloo) under torchrun or the deepspeed launcher, from a test."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from needs import extra

DIST = Path(__file__).parent / "dist"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(extra: dict | None) -> dict:
    # the checkout holding these tests comes first, so a second checkout tests its own code,
    # not the one pip installed in editable mode
    here = Path(__file__).resolve().parent
    path = os.pathsep.join([str(here), str(here.parent)])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    env.update(extra or {})
    return env


def _run(cmd: list[str], env: dict, timeout: int) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-8000:]}"
        )
    return p


def torchrun(script: str, *args: str, nproc: int = 2, env=None, timeout: int = 300):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        f"--master_port={free_port()}",
        str(DIST / script),
        *args,
    ]
    return _run(cmd, _env(env), timeout)


def deepspeed_run(script: str, *args: str, nproc: int = 2, env=None, timeout: int = 600):
    extra("deepspeed")  # its launcher, not a missing command's FileNotFoundError
    cmd = [
        "deepspeed",
        f"--num_gpus={nproc}",
        f"--master_port={free_port()}",
        str(DIST / script),
        *args,
    ]
    return _run(cmd, _env(env), timeout)


def read_results(out_dir: Path, ranks: int) -> list[dict]:
    """What each of ``ranks`` ranks wrote to ``out_dir``/rank{r}.json, in rank order. A rank that
    died, or never wrote, fails here by number: results read from the ranks that did report
    would pass on half (or none) of the run."""
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks: the number of ranks that must report, got {ranks!r}")
    out_dir = Path(out_dir)
    want = [out_dir / f"rank{r}.json" for r in range(ranks)]
    missing = [f.name for f in want if not f.is_file()]
    unexpected = sorted({f.name for f in out_dir.glob("rank*.json")} - {f.name for f in want})
    if missing or unexpected:
        raise AssertionError(
            f"{out_dir}: {ranks} ranks were to report, {ranks - len(missing)} did"
            + (f"; missing {', '.join(missing)}" if missing else "")
            + (f"; unexpected {', '.join(unexpected)}" if unexpected else "")
        )
    return [json.loads(f.read_text()) for f in want]


def duplicated_cross_bytes(memory_reports: list[dict]) -> int:
    """Bytes of v_cross beyond one copy per tensor: every rank that holds a piece of a tensor
    spread over ranks keeps all of its v_cross (``Gefen.memory_report``'s spread_v_cross)."""
    kept: dict[str, list[int]] = {}
    for rep in memory_reports:
        for name, entries in rep["spread_v_cross"].items():
            kept.setdefault(name, []).append(entries)
    return 4 * sum(sum(e) - max(e) for e in kept.values())


def resume_drift(uninterrupted: list[float], resumed: list[float], save_at: int) -> list[float]:
    """Each resumed step's relative loss difference from the run that never stopped, from the
    step after the checkpoint at ``save_at`` on; the two runs must cover the same steps."""
    base = uninterrupted[save_at:]
    assert len(resumed) == len(base), (len(resumed), len(base))
    return [abs(a - b) / b for a, b in zip(resumed, base, strict=True)]
