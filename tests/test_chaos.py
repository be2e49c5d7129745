"""A run killed at seeded points resumes to the same bits (launch/chaos.py), and the checkpoint
layout that makes it so: a save cut short is never taken for a complete one."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from dist_util import free_port

pytestmark = pytest.mark.unit

LAUNCH = Path(__file__).parent.parent / "launch"
sys.path.insert(0, str(LAUNCH))
import chaos  # noqa: E402
import train  # noqa: E402

# What each framework itself would take for a finished save (DeepSpeed's tag file, DCP's
# metadata): present in a torn directory, and still not resumed from.
OWN_MARKER = {"fsdp2": "dcp/.metadata", "deepspeed": "latest"}


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize(
    "launcher,kills,seed,phases",
    # the two seeds' plans kill in all four phases between them, and in a save under each
    [("fsdp2", 3, 5, ["save", "commit", "step"]), ("deepspeed", 2, 2, ["forward", "save"])],
    ids=["fsdp2", "deepspeed-zero2"],
)
def test_a_run_killed_at_random_points_resumes_to_the_same_bits(
    launcher, kills, seed, phases, tmp_path
):
    """12 steps, a checkpoint every 2, one rank SIGKILLed inside a phase per launch: the last
    launch ends with every rank's parameter and optimizer-state digest, and every step's
    losses, equal to those of a run never killed. ``max_wall`` keeps a loaded machine inside
    the budget by starting fewer killed launches (at least one must have run), and a launch
    that hangs before its kill, as DeepSpeed's startup does when another session removes its
    shared-memory buffers, runs once more (run_chaos's docstring)."""
    s = chaos.run_chaos(launcher, kills, seed, tmp_path, steps=12, every=2, max_wall=150,
                        timeout=240)  # fmt: skip
    assert not s.get("error"), (s.get("error"), s.get("launches"))
    assert [k["phase"] for k in s["plan"]] == phases
    assert s["kills_fired"] == kills or (s["stopped_early_for_wall_time"] and s["kills_fired"])
    assert s["digest_identical"] and s["curve_identical"], json.dumps(s, indent=1)[-4000:]
    digests = s["digest"]
    assert len(digests) == 2 and digests[0]["state_tensors"] > 0
    # per rank: ZeRO-2 replicates the parameters and splits the optimizer, FSDP2 splits both
    assert (digests[0]["params"] == digests[1]["params"]) == (launcher == "deepspeed")
    assert digests[0]["optimizer"] != digests[1]["optimizer"]
    killed = [r for r in s["launches"] if r["label"].startswith("kill_")]
    for r in killed:
        assert r["fired"] and not r["timed_out"] and not r["stragglers"], r
        k = r["kill"]
        saved_before = max((t for t in range(1, k["step"]) if chaos.saves_at(t, 12, 2)), default=0)
        torn = r["torn_after"].get(f".step_{k['step']:06d}.tmp")
        if k["phase"] == "commit" and k["rank"] == 1:  # raced rank 0's rename: either is fine
            assert r["newest_complete_after"] in (saved_before, k["step"]), r
        else:  # every save before the kill completed, and none after it
            assert r["newest_complete_after"] == saved_before, r
        if k["phase"] == "save":  # cut short, though the framework's own files are all there
            assert OWN_MARKER[launcher] in torn, r
        if k["phase"] == "commit" and k["rank"] == 0:  # the marker written, the rename not done
            assert train.DONE in torn, r
    # each launch resumed from where the one before it left its newest complete checkpoint
    later = s["launches"][2:]
    for before, after in zip(killed, later, strict=False):
        assert after["resumed_from"] == before["newest_complete_after"], (before, after)
    assert s["launches"][-1]["label"] == "final" and s["launches"][-1]["rc"] == 0
    # the last launch cleared the torn saves and left the last step's checkpoint
    ck = tmp_path / "ck"
    assert not train.torn_checkpoints(ck) and train.find_checkpoint(ck).name == "step_000012"


def test_the_kill_plan_follows_the_seed_alone():
    """The same seed, the same kills; steps strictly increase (so every kill fires whatever the
    one before left), and a save or commit kill falls on a step that saves."""
    assert chaos.PHASES == train.CHAOS_PHASES
    for seed in range(20):
        plan = chaos.plan_kills(seed, 3, 12, 2)
        assert plan == chaos.plan_kills(seed, 3, 12, 2)
        steps = [s for _, s, _ in plan]
        assert steps == sorted(set(steps)) and 1 <= steps[0] and steps[-1] <= 12
        for rank, step, phase in plan:
            assert rank in (0, 1) and phase in chaos.PHASES
            assert phase not in chaos.SAVING or chaos.saves_at(step, 12, 2)
    many = chaos.plan_kills(7, 10, 30, 2)
    assert len({s for _, s, _ in many}) == 10
    with pytest.raises(ValueError, match="kills"):
        chaos.plan_kills(0, 13, 12, 2)


def _save(root: Path, step: int, payload: bytes = b"x" * 10) -> Path:
    """A checkpoint committed by train.py's own commit, without a process group."""
    tmp = root / f".step_{step:06d}.tmp"
    (tmp / "dcp").mkdir(parents=True)
    (tmp / "dcp" / ".metadata").write_bytes(payload)
    (tmp / train.TRAINER_FILE.format(0)).write_bytes(payload)
    final = root / train.STEP_DIR.format(step)
    train._commit(tmp, final, step, 2, train.Chaos(None, 0))
    return final


def test_only_a_complete_checkpoint_is_resumed_from(tmp_path):
    root = tmp_path / "ck"
    two = _save(root, 2)
    marker = json.loads((two / train.DONE).read_text())
    assert marker["step"] == 2 and marker["world_size"] == 2
    assert marker["files"] == {"dcp/.metadata": 10, train.TRAINER_FILE.format(0): 10}
    four = _save(root, 4)
    assert train.find_checkpoint(root) == four and train.find_checkpoint(two) == two
    # a file of the newest cut after the fact: that one no longer counts
    (four / "dcp" / ".metadata").write_bytes(b"x")
    assert not train.is_complete(four) and train.find_checkpoint(root) == two
    # torn saves, whatever they hold: the framework's own files, every trainer file, even the
    # marker (rank 0 killed between writing it and the rename)
    torn = root / ".step_000006.tmp"
    (torn / "dcp").mkdir(parents=True)
    for name in ("dcp/.metadata", "latest", train.TRAINER_FILE.format(0), train.DONE):
        (torn / name).write_text("{}")
    (root / "step_000008").mkdir()  # no marker
    (root / "step_000008" / train.TRAINER_FILE.format(0)).write_bytes(b"x")
    assert train.find_checkpoint(root) == two
    assert train.find_checkpoint(torn) is None
    assert train.find_checkpoint(root / "step_000008") is None
    assert [t.name for t in train.torn_checkpoints(root)] == [torn.name]
    assert train.remove_torn(root) == [torn.name] and not torn.exists()
    # saving a step again (a resume from an older checkpoint) replaces it whole
    again = _save(root, 2, b"y" * 12)
    assert again == two and train.is_complete(two)
    assert json.loads((two / train.DONE).read_text())["files"]["dcp/.metadata"] == 12
    assert not list(root.glob(".step_*"))


def test_a_flat_checkpoint_of_earlier_revisions_still_loads(tmp_path):
    (tmp_path / train.TRAINER_FILE.format(0)).write_bytes(b"x")
    assert train.find_checkpoint(tmp_path) == tmp_path


def test_resume_from_a_directory_of_torn_saves_only_is_refused(tmp_path):
    torn = tmp_path / ".step_000002.tmp"
    torn.mkdir()
    (torn / train.TRAINER_FILE.format(0)).write_bytes(b"x")
    with pytest.raises(train.ConfigError, match="'checkpoint.resume'.*no complete checkpoint"):
        train.load_config({"checkpoint": {"resume": str(tmp_path)}})


@pytest.mark.parametrize(
    "given,named",
    [({"checkpoint": {"every": -1}}, "checkpoint.every"),
     ({"checkpoint": {"every": 2}}, "checkpoint.every")],
)  # fmt: skip
def test_a_bad_checkpoint_every_is_named(given, named):
    with pytest.raises(train.ConfigError, match=f"'{named}'"):
        train.load_config(given)


@pytest.mark.parametrize(
    "spec,parsed",
    [("1:6:save", (1, 6, "save")), ("0:3:forward", (0, 3, "forward")), ("", None),
     ("1:6", "error"), ("1:x:step", "error"), ("1:6:backward", "error")],
)  # fmt: skip
def test_the_chaos_hook_is_parsed_or_refused(spec, parsed):
    if parsed == "error":
        with pytest.raises(train.ConfigError, match=train.CHAOS_ENV):
            train.parse_chaos(spec)
    else:
        assert train.parse_chaos(spec) == parsed


@pytest.mark.slow
def test_a_bad_chaos_hook_stops_the_script_before_any_process_group():
    """A typo in the test hook must fail the chaos test at once, not let the rank live."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": "0", "LOCAL_RANK": "0",
           "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           train.CHAOS_ENV: "0:2:backward"}  # fmt: skip
    p = subprocess.run([sys.executable, str(LAUNCH / "train.py"), "--set", "steps=2"], env=env,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert p.returncode == 2 and train.CHAOS_ENV in p.stderr, p.stderr[-2000:]
    assert "Traceback" not in p.stderr, p.stderr[-2000:]
