"""Kill one rank of a ``launch/train.py`` run at seeded points, resume, and check the bits.

A run that checkpoints every few steps should survive losing a rank at any point, the middle of
a save included, and end where it would have ended had nothing happened. This driver launches
the run under its launcher (torchrun for FSDP2, the deepspeed launcher for ZeRO-2) on 2 CPU
ranks with ``GEFEN_CHAOS_KILL`` set, so that one rank sends itself SIGKILL inside the forward,
the optimizer step, the save or its commit (``launch/trainer/faults.py``); the launcher tears
the other rank down, and the driver relaunches with ``--resume`` from the newest complete
checkpoint, kill after kill. A last launch runs to the end, and a run never killed, started
from the same config, is the yardstick: both write a digest of every rank's parameters and
optimizer state (``--digest``), and the two must agree, as must every step's losses.

    python launch/chaos.py --launcher fsdp2 --kills 10 --seed 1 --out DIR

writes ``DIR/summary.json`` (and each launch's log) and exits 1 unless the bits agree.
``docs/chaos.md`` has the kill points, the checkpoint protocol and one run's figures.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRAIN = HERE / "train.py"
CONFIGS = HERE.parent / "configs" / "run"
RUN_CONFIGS = {"fsdp2": "fsdp2.yaml", "deepspeed": "deepspeed_zero2.yaml"}
PHASES = ("forward", "step", "save", "commit")
SAVING = ("save", "commit")
# the model and data of tests/test_dist_train.py's resume test: startup dominates, not steps
TINY = {"eval_every": 1, "model.n_layer": 1, "model.n_embd": 32, "model.block_size": 16,
        "data.batch_size": 2, "data.val_batches": 1, "data.max_bytes": 65536}  # fmt: skip
WORLD = 2


def _train_module():
    """launch/train.py's own reading of a checkpoint directory, so that the driver's idea of
    "newest complete" can never drift from the one ``--resume`` acts on."""
    sys.path.insert(0, str(HERE))
    import train

    return train


def saves_at(step: int, steps: int, every: int) -> bool:
    return step % every == 0 or step == steps


def plan_kills(seed: int, kills: int, steps: int, every: int, world: int = WORLD) -> list:
    """(rank, step, phase) per kill, from ``seed`` alone. Kill i falls in the i-th of ``kills``
    equal windows of the run, so steps strictly increase: each kill then fires whatever the
    previous one left (a commit killed on rank 1 races rank 0's rename), and the kills spread
    over the run rather than bunching where a uniform draw puts them. A save or commit kill
    takes a step that saves; a window without one gets a forward or step kill."""
    if not 1 <= kills <= steps:
        raise ValueError(f"kills must be in [1, steps={steps}], got {kills}")
    rng = random.Random(seed)
    plan = []
    for i in range(kills):
        window = range(i * steps // kills + 1, (i + 1) * steps // kills + 1)
        phase = rng.choice(PHASES)
        eligible = [s for s in window if saves_at(s, steps, every)] if phase in SAVING else []
        if phase in SAVING and not eligible:
            phase = rng.choice(("forward", "step"))
        step = rng.choice(eligible or list(window))
        plan.append((rng.randrange(world), step, phase))
    return plan


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(launcher: str, port: int, args: list[str]) -> list[str]:
    if launcher == "deepspeed":
        return ["deepspeed", "--num_gpus", str(WORLD), f"--master_port={port}", str(TRAIN), *args]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD),
            f"--master_port={port}", str(TRAIN), *args]  # fmt: skip


def _remove_shm_buffers(port: int) -> None:
    """DeepSpeed's CPU all-reduce leaves a shared-memory buffer per rank, named by user, address
    and port, in /dev/shm (RAM), and more so when a rank is killed: remove this launch's only,
    never another job's."""
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def launch(launcher: str, args: list[str], log: Path, kill: str = "", timeout: float = 300):
    """One launch in its own session, so that whatever of it outlives the launcher (a rank the
    launcher failed to tear down) is seen and ended by its group id, and nothing else is."""
    port = free_port()
    # the ranks import this checkout's gefen_dist, not whichever one pip installed
    path = os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    env.pop("GEFEN_CHAOS_KILL", None)
    if kill:
        env["GEFEN_CHAOS_KILL"] = kill
    t0 = time.perf_counter()
    with open(log, "w") as f:
        p = subprocess.Popen(command(launcher, port, args), stdout=f, stderr=subprocess.STDOUT,
                             env=env, start_new_session=True)  # fmt: skip
        try:
            rc, timed_out = p.wait(timeout=timeout), False
        except subprocess.TimeoutExpired:
            rc, timed_out = None, True
    wall = time.perf_counter() - t0
    stragglers = False
    try:
        os.killpg(p.pid, 0)
        stragglers = True
    except ProcessLookupError:
        pass
    if stragglers or timed_out:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    if launcher == "deepspeed":
        _remove_shm_buffers(port)
    return dict(rc=rc, wall_s=round(wall, 2), timed_out=timed_out, stragglers=stragglers)


def kill_line(rank: int, step: int, phase: str) -> str:
    """What launch/train.py prints as a chaos kill fires."""
    return f"chaos: rank {rank} sends itself SIGKILL in the {phase} of step {step}"


def _framework_marker(torn: Path) -> list[str]:
    """What the framework itself would take as a finished save inside a torn directory."""
    names = ("latest", "dcp/.metadata", "COMPLETE")
    return [n for n in names if (torn / n).is_file()]


def run_chaos(
    launcher: str,
    kills: int,
    seed: int,
    out: Path,
    steps: int | None = None,
    every: int = 2,
    max_wall: float | None = None,
    timeout: float = 240,
    retries: int = 1,
) -> dict:
    """The whole experiment (module docstring); returns the summary it writes to
    ``out/summary.json``. ``max_wall`` stops starting killed launches once that many seconds
    have gone, so that a slow machine shortens the run instead of overrunning a budget.

    A launch that outlives ``timeout`` before its kill fired is run again, up to ``retries``
    times, and the summary lists it under ``hung``: on a machine shared with other test
    sessions, one that removes the DeepSpeed shared-memory buffers it did not create (as
    tests/conftest.py does) while a launch starts leaves a rank waiting in DeepSpeed's
    ``shm_initialize`` for its peer's buffer forever. A launch that hangs after its kill (the
    launcher failing to tear the other rank down) is not run again: that is a finding."""
    train = _train_module()
    steps = steps or max(12, 3 * kills)
    out = Path(out)
    ck = out / "ck"
    if ck.exists():  # an earlier run's checkpoints would be resumed from
        raise FileExistsError(f"{ck} exists: give chaos.py a fresh --out")
    out.mkdir(parents=True, exist_ok=True)
    sets = {**TINY, "steps": steps}
    base = ["--config", str(CONFIGS / RUN_CONFIGS[launcher]), "--no-progress"]
    base += [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    saving = ["--set", f"checkpoint.dir={ck}", "--set", f"checkpoint.every={every}"]
    plan = plan_kills(seed, kills, steps, every)
    t_start = time.perf_counter()
    records = []

    def attempt(label: str, args: list[str], kill: tuple | None, resuming: bool) -> dict:
        said = kill_line(*kill) if kill else None
        hung = []
        for n in range(retries + 1):
            done = train.complete_checkpoints(ck) if resuming else []
            resume = ["--resume", str(ck)] if done else []
            log = out / (f"{label}.log" if n == 0 else f"{label}.retry{n}.log")
            spec = ":".join(map(str, kill)) if kill else ""
            rec = launch(launcher, [*args, *resume], log, spec, timeout)
            text = log.read_text(errors="replace")
            fired = bool(said) and said in text and rec["rc"] != 0
            rec.update(label=label, resumed_from=done[-1][0] if done else 0, hung=list(hung),
                       fired=fired)  # fmt: skip
            if not rec["timed_out"] or fired:
                return rec
            hung.append(log.name)
        return rec

    ref_json = out / "reference.json"
    ref = attempt("reference", [*base, "--digest", "--out", str(ref_json)], None, False)
    records.append(ref)
    if ref["rc"] != 0:
        return _finish(out, dict(launcher=launcher, ok=False, error="the reference run failed",
                                 launches=records))  # fmt: skip

    fired, stopped_early = 0, False
    for i, (rank, step, phase) in enumerate(plan):
        if max_wall is not None and time.perf_counter() - t_start > max_wall:
            stopped_early = True
            break
        rec = attempt(f"kill_{i}", [*base, *saving], (rank, step, phase), resuming=True)
        rec["kill"] = dict(rank=rank, step=step, phase=phase)
        after = train.complete_checkpoints(ck)
        torn = train.torn_checkpoints(ck)
        rec.update(
            newest_complete_after=after[-1].step if after else 0,
            torn_after={t.name: _framework_marker(t) for t in torn},
        )
        records.append(rec)
        if rec["timed_out"] or not rec["fired"]:
            error = (
                f"kill {rank}:{step}:{phase} "
                + ("fired, and the launch outlived it" if rec["fired"] else "did not fire")
                + f" (see {out}/kill_{i}*.log)"
            )
            return _finish(out, dict(launcher=launcher, ok=False, launches=records, error=error))
        fired += 1

    final_json = out / "final.json"
    fin = attempt("final", [*base, *saving, "--digest", "--out", str(final_json)], None, True)
    records.append(fin)
    if fin["rc"] != 0:
        return _finish(out, dict(launcher=launcher, ok=False, launches=records,
                                 error="the final launch failed"))  # fmt: skip
    a, b = (json.loads(p.read_text()) for p in (final_json, ref_json))
    curve_same = a["curve"] == b["curve"]
    digest_same = a["digest"] == b["digest"]
    summary = dict(
        launcher=launcher,
        config=str(CONFIGS / RUN_CONFIGS[launcher]),
        sets=sets,
        seed=seed,
        steps=steps,
        every=every,
        kills_planned=kills,
        kills_fired=fired,
        stopped_early_for_wall_time=stopped_early,
        plan=[dict(rank=r, step=s, phase=p) for r, s, p in plan],
        curve_identical=curve_same,
        digest_identical=digest_same,
        ok=curve_same and digest_same,
        digest=b["digest"],
        final_val_loss=a["final_val_loss"],
        launches=records,
        wall_s=round(time.perf_counter() - t_start, 1),
        machine=_machine(),
        command=" ".join(
            [
                "python",
                "launch/chaos.py",
                "--launcher",
                launcher,
                "--kills",
                str(kills),
                "--seed",
                str(seed),
                "--steps",
                str(steps),
                "--every",
                str(every),
                "--out",
                str(out),
            ]
        ),  # fmt: skip
    )
    return _finish(out, summary)


def _finish(out: Path, summary: dict) -> dict:
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def _machine() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    import torch

    try:
        ds = version("deepspeed")
    except PackageNotFoundError:  # the FSDP2 run needs none
        ds = None
    return dict(cpus=os.cpu_count(), platform=platform.platform(), python=platform.python_version(),
                torch=torch.__version__, deepspeed=ds)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--launcher", choices=sorted(RUN_CONFIGS), required=True)
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, help="training steps (default: max(12, 3 * kills))")
    ap.add_argument("--every", type=int, default=2, help="checkpoint every this many steps")
    ap.add_argument("--max-wall", type=float, help="start no killed launch after this many s")
    ap.add_argument("--timeout", type=float, default=240, help="seconds one launch may take")
    ap.add_argument("--retries", type=int, default=1,
                    help="runs again a launch that timed out before its kill fired")  # fmt: skip
    ap.add_argument("--out", required=True, help="directory for the logs, checkpoints, summary")
    args = ap.parse_args(argv)
    s = run_chaos(args.launcher, args.kills, args.seed, Path(args.out), args.steps, args.every,
                  args.max_wall, args.timeout, args.retries)  # fmt: skip
    if s.get("error"):
        print(f"error: {s['error']}", file=sys.stderr)
    else:
        print(
            f"{s['launcher']}: {s['kills_fired']} of {s['kills_planned']} kills over {s['steps']} "
            f"steps (checkpoint every {s['every']}), seed {s['seed']}: parameters and optimizer "
            f"state {'identical' if s['digest_identical'] else 'DIFFERENT'}, losses "
            f"{'identical' if s['curve_identical'] else 'DIFFERENT'}; {s['wall_s']} s"
        )
    return 0 if s.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
