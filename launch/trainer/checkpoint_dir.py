"""The checkpoint directory on disk: which saves count as checkpoints, and the atomic commit that
makes a save one.

A save can be cut short by a killed rank at any point, and must then never pass for a complete
one, whatever the framework wrote (DCP's ``.metadata``, DeepSpeed's ``latest``). So every save of
step S goes into ``DIR/.step_S.tmp/``; after a barrier that every rank reaches only once its files
are written, rank 0 fsyncs them, writes and fsyncs the marker ``COMPLETE`` (the step, the world
size, an HSDP run's mesh, each file's size) and renames the directory to ``DIR/step_S/``
(zero-padded to six digits). A directory counts as a checkpoint only under that name with a
marker whose files are all there, so a torn save is ignored on resume, and removed when the next
run starts. A checkpoint directory of the older flat layout (``trainer_rank0.pt`` in DIR itself)
still loads.

Only files here: no process group and no framework, so that ``launch/chaos.py`` and the tests
read a directory exactly as ``--resume`` does, in one process.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Protocol

TRAINER_FILE = "trainer_rank{}.pt"
STEP_DIR = "step_{:06d}"
STEP_RE = re.compile(r"step_(\d{6,})")
TORN_RE = re.compile(r"\.step_\d{6,}\.(tmp|old)")
DONE = "COMPLETE"


class Checkpoint(NamedTuple):
    """A complete checkpoint: the ``step`` it saved, in directory ``path``."""

    step: int
    path: Path


@dataclass(frozen=True)
class Marker:
    """What ``COMPLETE`` records: the step, the world size and (HSDP) the mesh that saved, and
    every file of the save with its size in bytes, by path relative to the checkpoint."""

    step: int
    world_size: int
    files: dict[str, int] = field(default_factory=dict)
    mesh: list[int] | None = None

    def to_json(self) -> str:
        head: dict = dict(step=self.step, world_size=self.world_size)
        if self.mesh is not None:
            head["mesh"] = list(self.mesh)
        return json.dumps(dict(**head, files=self.files), indent=1)


class KillPoint(Protocol):
    """The fault hook's point inside the commit (``trainer.faults.Chaos``)."""

    def at(self, phase: str) -> None: ...


def read_marker(d: str | Path) -> Marker | None:
    """The marker of checkpoint ``d``, or None where it has none (a legacy flat checkpoint)."""
    path = Path(d) / DONE
    if not path.exists():
        return None
    raw = json.loads(path.read_text())
    return Marker(step=int(raw["step"]), world_size=int(raw["world_size"]), files=raw["files"],
                  mesh=raw.get("mesh"))  # fmt: skip


def is_complete(d: str | Path) -> bool:
    """Whether ``d`` holds a finished save: its marker, and every file the marker lists at the
    size it lists (a file lost or cut later makes it as unusable as a torn save)."""
    try:
        marker = json.loads((Path(d) / DONE).read_text())
        return all((Path(d) / rel).stat().st_size == size for rel, size in marker["files"].items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def complete_checkpoints(root: str | Path) -> list[Checkpoint]:
    """Every complete checkpoint under ``root``, oldest first."""
    try:
        entries = list(Path(root).iterdir())
    except OSError:
        return []
    found = [Checkpoint(int(m.group(1)), e) for e in entries if (m := STEP_RE.fullmatch(e.name))]
    return sorted(c for c in found if is_complete(c.path))


def torn_checkpoints(root: str | Path) -> list[Path]:
    """Saves that never completed (or a replaced checkpoint not yet removed) under ``root``."""
    try:
        return sorted(e for e in Path(root).iterdir() if TORN_RE.fullmatch(e.name))
    except OSError:
        return []


def find_checkpoint(d: str | Path) -> Path | None:
    """The checkpoint ``--resume d`` loads: ``d`` itself where it is a complete one, else the
    newest complete one in it; a flat-layout directory of earlier revisions counts as complete,
    since the script never writes that layout any more (a torn save is never named so)."""
    d = Path(d)
    if is_complete(d):
        return d
    found = complete_checkpoints(d)
    if found:
        return found[-1].path
    legacy = (d / TRAINER_FILE.format(0)).is_file() and not (d / DONE).exists()
    if legacy and not TORN_RE.fullmatch(d.name) and not STEP_RE.fullmatch(d.name):
        return d
    return None


def remove_torn(root: Path) -> list[str]:
    """Rank 0, before the run's first save: the directories killed saves left behind."""
    gone = []
    for t in torn_checkpoints(root):
        shutil.rmtree(t, ignore_errors=True)
        gone.append(t.name)
    return gone


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(
    d: Path,
    final: Path,
    step: int,
    world: int,
    chaos: KillPoint,
    mesh: tuple[int, int] | None = None,
) -> None:
    """Rank 0 makes a written save ``d`` the checkpoint ``final``: the files and the marker on
    disk before the rename, and the rename on disk before training goes on, so that neither a
    kill nor a power cut can leave a ``step_NNNNNN`` directory whose marker names files that are
    not there."""
    files = {}
    for f in sorted(p for p in d.rglob("*") if p.is_file()):
        _fsync(f)
        files[str(f.relative_to(d))] = f.stat().st_size
    for sub in sorted({f.parent for f in d.rglob("*") if f.is_file()}):
        _fsync(sub)
    marker = Marker(step=step, world_size=world, files=files,
                    mesh=None if mesh is None else list(mesh))  # fmt: skip
    with open(d / DONE, "w") as f:
        f.write(marker.to_json())
        f.flush()
        os.fsync(f.fileno())
    _fsync(d)
    chaos.at("commit")
    old = final.with_name(f".{final.name}.old")
    if final.exists():  # a resume from an older checkpoint saves this step again
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(d, final)
    _fsync(final.parent)
    shutil.rmtree(old, ignore_errors=True)
