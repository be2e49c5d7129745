"""Resumable results store: one JSON record per (task, optimizer, seed) run, appended as each
run finishes, so an interrupted comparison resumes where it stopped.

Versions are never mixed silently. A record is reused only when its key matches: task,
optimizer, seed, a hash of the settings (sizes, hyperparameters, lr scale; for an lr-sweep run
also its lr factor, which the key also spells out, so a sweep record can never be taken for
a fixed-lr one nor the other way round) and the code
revision, which is the last git commit that touched the package's code: ``gefen_dist/`` and
``csrc/``, whose C++ kernel is the update on the CPU (results and docs excluded, so committing a
report does not invalidate it), marked ``-dirty`` with a hash of the uncommitted diff when
either has local changes. Records of other
revisions stay in the file as history; the report is built from the current revision only and
says how many it left out.
"""

from __future__ import annotations

import hashlib
import json
import platform
import subprocess
from pathlib import Path
from typing import Any

_PKG = Path(__file__).resolve().parents[1]
# What the records' numbers depend on, relative to the checkout's root: the package, and the
# C++ kernel's source, which sits outside it (a wheel carries its copy in gefen_dist/_csrc/).
CODE_PATHS = ("gefen_dist", "csrc")


def _git(root: Path, *args: str) -> str:
    try:
        p = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return p.stdout.strip() if p.returncode == 0 else ""


def revision(root: Path | None = None) -> dict[str, str]:
    """{'code': revision records are keyed by, 'head': HEAD at run time}. ``root``: the
    checkout (default: the one this package is imported from)."""
    root = root or _PKG.parent
    head = _git(root, "rev-parse", "HEAD")
    if not head:
        # not a git checkout: the package's own sources, the kernel's copy included
        h = hashlib.sha256()
        pkg = root / CODE_PATHS[0]
        for f in sorted([*pkg.rglob("*.py"), *pkg.rglob("*.cpp")]):
            h.update(f.read_bytes())
        return dict(code="src-" + h.hexdigest()[:12], head="")
    code = _git(root, "log", "-1", "--format=%H", "--", *CODE_PATHS) or head
    diff = _git(root, "diff", "HEAD", "--", *CODE_PATHS)
    untracked = _git(root, "ls-files", "--others", "--exclude-standard", "--", *CODE_PATHS)
    rev = code[:12]
    if diff or untracked:
        h = hashlib.sha256(diff.encode())
        for name in sorted(untracked.split()):
            if name.endswith((".py", ".cpp")):
                h.update(name.encode() + (root / name).read_bytes())
        rev += "-dirty-" + h.hexdigest()[:8]
    return dict(code=rev, head=head[:12])


def cpu_model() -> str:
    """The CPU's model name: torch's CPU kernels differ between CPUs, and so do high-lr runs."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def settings_hash(settings: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]


def key(
    task: str,
    optimizer: str,
    seed: int,
    settings: dict[str, Any],
    rev: dict[str, str],
    lr_factor: float | None = None,
) -> str:
    """``lr_factor`` marks an lr-sweep run; fixed-lr keys keep the format they always had, so
    their stored records stay valid."""
    lr = "" if lr_factor is None else f"lr*{lr_factor:g}|"
    return f"{task}|{optimizer}|{lr}{seed}|{settings_hash(settings)}|{rev['code']}"


def record(
    k: str,
    task: str,
    optimizer: str,
    seed: int,
    settings: dict[str, Any],
    rev: dict[str, str],
    body: dict[str, Any],
) -> dict[str, Any]:
    import time

    import torch

    return dict(
        key=k,
        revision=rev["code"],
        head=rev["head"],
        task=task,
        optimizer=optimizer,
        seed=seed,
        settings=settings,
        settings_hash=settings_hash(settings),
        torch=torch.__version__,
        machine=f"{platform.machine()} {platform.system()}",
        cpu=cpu_model(),
        time=time.strftime("%Y-%m-%dT%H:%M:%S"),
        **body,
    )


class Store:
    """Append-only JSON lines; the last record of a key wins."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        self._recs: dict[str, dict[str, Any]] = {}
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                if line.strip():
                    r = json.loads(line)
                    self._recs[r["key"]] = r

    def get(self, k: str) -> dict[str, Any] | None:
        return self._recs.get(k)

    def add(self, rec: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        self._recs[rec["key"]] = rec

    def records(self) -> list[dict[str, Any]]:
        return list(self._recs.values())

    def other_revisions(self, rev: dict[str, str]) -> dict[str, int]:
        """Records left out of a report because another code revision produced them."""
        out: dict[str, int] = {}
        for r in self._recs.values():
            if r["revision"] != rev["code"]:
                out[r["revision"]] = out.get(r["revision"], 0) + 1
        return out
