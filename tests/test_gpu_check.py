"""launch/gpu_check.py, the kit a lent GPU runs once, tested here end to end: its Triton kernels
run under Triton's interpreter on CPU tensors (--interpret), so the kit is known to work before a
GPU ever runs it, and to leave a readable report when it is killed part-way or runs out of time.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.triton, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
KIT = ROOT / "launch" / "gpu_check.py"
DEVICE_TRITON = "3.6.0"  # the H200's; launch/install.sh puts it in .triton-3.6.0
sys.path.insert(0, str(ROOT / "launch"))
import gpu_check  # noqa: E402

sys.path.remove(str(ROOT / "launch"))


def _start(out: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    """The kit under the interpreter in its own process group (as ``timeout`` runs it), its
    output in files beside ``out`` (a pipe nobody reads would stall it)."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(KIT), "--interpret", "--out", str(out), *args]
    logs = out.parent / f"{out.name}.stdout", out.parent / f"{out.name}.stderr"
    with open(logs[0], "w") as so, open(logs[1], "w") as se:
        return subprocess.Popen(
            cmd, stdout=so, stderr=se, env=env, cwd=ROOT, start_new_session=True
        )


def _report(out: Path) -> dict:
    return json.loads((out / "gpu_check.json").read_text())


def _wait_for(out: Path, proc: subprocess.Popen, checks: int, timeout: float = 600) -> dict:
    """The report once it holds ``checks`` finished checks (it is rewritten after each)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert proc.poll() is None, (out.parent / f"{out.name}.stderr").read_text()[-3000:]
        if (out / "gpu_check.json").exists():
            rep = _report(out)
            if len(rep["checks"]) >= checks:
                return rep
        time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"no {checks} checks in {timeout} s")


def _gone(pid: int, timeout: float = 5) -> bool:
    """The process has ended (a zombie counts: it runs nothing)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.1)
    return False


def _names(rep: dict) -> list[str]:
    done = [c["item"] for c in [rep["probe"], *rep["checks"], *rep["timings"]] if c]
    return done + [n["item"] for n in rep["not_run"]]


# ------------------------------------------------------------------------------ a whole run


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    """One whole run with no size given (``--interpret`` picks the small ones), after a clean
    exit: its report and markdown."""
    out = tmp_path_factory.mktemp("gpu_check") / "out"
    proc = _start(out)
    rc = proc.wait(timeout=3000)
    err = (out.parent / "out.stderr").read_text()
    assert rc == 0, err[-3000:]
    rep = _report(out)
    rep["_md"] = (out / "gpu_check.md").read_text()
    rep["_stdout"] = (out.parent / "out.stdout").read_text()
    rep["_log"] = (out / "gpu_check.log").read_text()
    return rep


def test_the_checks_run_and_pass_under_the_interpreter(report):
    assert report["status"] == "complete" and report["not_run"] == []
    assert report["interpret"] and "interpreter" in report["probe"]["device"].lower()
    assert report["probe"]["ok"] and report["probe"]["smoke_ok"]
    checks = report["checks"]
    assert report["checks_ok"] and all(c["ok"] for c in checks), [c for c in checks if not c["ok"]]
    layouts = {c.get("layout") for c in checks}
    assert set(gpu_check.LAYOUT_NAMES) <= layouts
    for bits in (4, 8):  # every dtype meets every width over the layouts
        got = {c["dtype"] for c in checks if c.get("bits") == bits}
        assert got == {"torch.float32", "torch.bfloat16", "torch.float16"}, (bits, got)
    assert {c["backend"] for c in checks if "backend" in c} == {"triton"}
    (hist,) = [c for c in checks if c["item"] == "histogram"]
    assert hist["equal"] and hist["kernel_equal"]
    (whole,) = [c for c in checks if c["item"] == "optimizer"]
    assert whole["layouts_equal"] and whole["codebooks_equal"] and whole["resumed_equal"]
    assert whole["state_bytes_equal"] and report["goals"]["state_bytes_as_cpu"]["met"]
    (moe,) = [c for c in checks if c["item"] == "optimizer/moe"]  # grouped experts
    assert moe["ok"] and moe["batches"] > 0 and moe["factored_per_matrix"] > 0
    # every compiled variant the launchers use ran at least once
    assert report["kernels"]["missing"] == [] and report["kernels"]["ran"] == 14
    assert "Checks: " in report["_md"] and "kernel variants launched 14/14" in report["_md"]


def test_the_timings_of_both_sets_and_no_goal_judged_under_the_interpreter(report):
    """The timing half too (a lent GPU runs it once, unseen before): every optimizer of the
    1B-parameter set's table and GPT-2's set get a construction, first-step and median step
    time; no speed goal is judged on the interpreter's times."""
    timings = report["timings"]
    done = {t["item"] for t in timings if "median_ms" in t}
    for dtype in ("float32", "bfloat16"):
        assert {f"step/matrices/{dtype}/{n}" for n in ("adamw_fused", "gefen4", "gefen8")} <= done
    assert {f"step/gpt2_124m/float32/{n}" for n in ("adamw_fused", "gefen4", "gefen8")} <= done
    assert report["sizes"]["rows"] == 16 and report["sizes"]["gpt2"] == "tiny"
    assert {t["params"] for t in timings if "/matrices/" in t["item"] and "params" in t} == {4096}
    assert {t["backend"] for t in timings if "backend" in t} == {"triton"}
    timed = [t for t in timings if "median_ms" in t]
    for t in timed:
        assert 0 < t["host_ms"] <= t["median_ms"] and t["device_ops"] is None, t
        assert t["build_s"] >= 0 and t["first_step_s"] > 0
        assert t["first_step_x"] == pytest.approx(1e3 * t["first_step_s"] / t["median_ms"])
    speed = [k for k in report["goals"] if "_x_" in k or "copy" in k or "first_step" in k]
    assert len(speed) == 8
    assert all(report["goals"][k]["met"] is None for k in speed)
    assert report["goals"]["train_ddp_resumes"] == dict(met=None, why="runs on a GPU only")
    assert "| gpt2_124m | float32 | gefen4" in report["_md"]


def test_every_result_is_one_json_line_in_order(report):
    """Printed as it finished, in the order the items run (most informative first)."""
    lines = [json.loads(x) for x in report["_stdout"].splitlines() if x.startswith("{")]
    printed = [x["item"] for x in lines]
    assert printed == _names(report)
    want = [it.name for it in gpu_check.items("cpu", interpret=True)]
    assert printed == want
    assert want[0] == "probe" and want[1].startswith("equal/")
    assert want.index("optimizer") < want.index("step/matrices/float32/adamw_fused")


# ------------------------------------------------------------------ killed part-way, deadline


@pytest.mark.parametrize("how", ["SIGINT", "SIGKILL"])
def test_a_run_killed_part_way_leaves_a_readable_report(tmp_path, how):
    """SIGINT to the kit's process group (what ``timeout -s INT`` sends) once two checks have
    finished: the kit stops its worker, records the item in progress as interrupted and the
    rest as not run, and exits 2. SIGKILL: the report holds what finished (each write is a
    rename, never half a file) and the worker dies with its parent."""
    out = tmp_path / "out"
    proc = _start(out, "--only", "equal")
    seen = _wait_for(out, proc, checks=2)
    if how == "SIGINT":
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 2
    else:
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
    rep = _report(out)
    assert [c["item"] for c in rep["checks"][: len(seen["checks"])]] == [
        c["item"] for c in seen["checks"]
    ]
    finished = [c for c in rep["checks"] if "stopped" not in c]
    assert len(finished) >= 2 and all(c["ok"] for c in finished)
    assert _gone(rep["workers"][-1]["pid"])
    if how == "SIGKILL":
        assert rep["status"] == "running"
        return
    assert rep["status"] == "interrupted: SIGINT"
    assert rep["workers"][-1]["ended"] == "interrupted: SIGINT"
    stopped = [c for c in rep["checks"] if "stopped" in c]
    assert all(c["stopped"] == "interrupted: SIGINT" and "ok" not in c for c in stopped)
    assert rep["not_run"] and {n["why"] for n in rep["not_run"]} == {"interrupted: SIGINT"}
    assert _names(rep) == [it.name for it in gpu_check.select(
        gpu_check.items("cpu", interpret=True), "equal")]  # fmt: skip
    assert "interrupted: SIGINT" in (out / "gpu_check.md").read_text()


def test_the_deadline_stops_the_item_in_progress_and_the_rest(tmp_path):
    """``--budget-s`` far below the run's length: the item running at the deadline is stopped
    there, nothing starts after it, the kit exits 2 with a report that says so."""
    out = tmp_path / "out"
    budget = 25
    t0 = time.monotonic()
    proc = _start(out, "--budget-s", str(budget))
    rc = proc.wait(timeout=300)
    took = time.monotonic() - t0
    rep = _report(out)
    assert rc == 2, (out.parent / "out.stderr").read_text()[-3000:]
    assert rep["status"] == "deadline" and rep["elapsed_s"] <= budget + 5
    assert took <= budget + 30  # the interpreter's start and the kill, not another item
    assert rep["not_run"] and {n["why"] for n in rep["not_run"]} == {"deadline"}
    stopped = [c for c in [rep["probe"], *rep["checks"]] if c and "stopped" in c]
    assert all(c["stopped"] == "deadline" for c in stopped)
    assert _names(rep) == [it.name for it in gpu_check.items("cpu", interpret=True)]
    assert "deadline" in (out / "gpu_check.md").read_text()


# -------------------------------------------------------------------- the device's triton


# one item per kernel variant group: B = 1, blocks of every width class, the factor pass,
# columns, the histogram
COVER = [
    "equal/prime/4b",
    "equal/odd_start_odd_block/4b",
    "equal/long_block/4b",
    "equal/short_blocks/4b",
    "equal/columns/4b",
    "equal/flat_shard/4b",
    "histogram",
]


def test_the_kernels_checks_pass_under_the_devices_triton(tmp_path):
    """The H200 has triton 3.6.0: its interpreter runs every kernel variant against the
    reference here too (it once failed there with numpy >= 2.4 on a loop bound)."""
    site = ROOT / f".triton-{DEVICE_TRITON}"
    assert (site / "triton" / "__init__.py").exists(), (
        f"triton {DEVICE_TRITON} is not in {site}: run bash launch/install.sh"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]))
    out = tmp_path / "out"
    proc = _start(out, "--only", ",".join(COVER), env=env)
    rc = proc.wait(timeout=900)
    rep = _report(out)
    assert rc == 0, (out.parent / "out.stderr").read_text()[-3000:]
    assert rep["probe"]["triton"] == DEVICE_TRITON == rep["host"]["packages"]["triton"]
    assert len(rep["checks"]) == len(COVER) and all(c["ok"] for c in rep["checks"])
    assert rep["kernels"]["missing"] == []


# -------------------------------------------------------------------------- in-process parts


def test_the_interpreter_picks_small_sizes_and_a_device_the_1b_set():
    small = gpu_check.sizes(None, None, interpret=True)
    assert (small.rows, small.tensors, small.steps, small.gpt2) == (16, 16, 2, "tiny")
    assert small.small_layouts
    big = gpu_check.sizes(None, None, interpret=False)
    assert big.tensors * big.rows**2 == 16 * 8192**2 and big.gpt2 == "124m"
    assert not big.small_layouts and big.steps == 20
    with pytest.raises(SystemExit, match="--scale must be > 0"):
        gpu_check.sizes(0.0, None, interpret=True)


def test_items_run_most_informative_first_on_a_gpu():
    names = [it.name for it in gpu_check.items("cuda", interpret=False)]
    order = ["probe", "equal/prime/4b/float32", "histogram", "optimizer", "optimizer/moe",
             "step/matrices/float32/adamw_fused", "step/matrices/float32/gefen4",
             "step/matrices/bfloat16/adamw_fused", "step/matrices/bfloat16/gefen4",
             "step/matrices/float32/gefen8", "step/matrices/bfloat16/gefen8", "train/ddp",
             "train/fsdp2", "step/gpt2_124m/float32/adamw_fused",
             "step/matrices/float32/bnb_adamw8bit"]  # fmt: skip
    assert [names.index(n) for n in order] == sorted(names.index(n) for n in order)
    assert sum(n.startswith("equal/") for n in names) == 8 * 2 * 3  # every combination
    train = [it for it in gpu_check.items("cuda", interpret=False) if it.name.startswith("train")]
    assert all(it.args["timeout_s"] <= 90 for it in train)
    with pytest.raises(SystemExit, match="--only 'nothing' matches no item"):
        gpu_check.select(gpu_check.items("cuda", interpret=False), "nothing")


def test_goals_judge_the_ratios_and_what_did_not_run():
    def t(opt, dtype, ms):
        return dict(item=f"step/matrices/{dtype}/{opt}", median_ms=ms, bytes_per_s=ms and 7e11 / ms,
                    first_step_x=3.0)  # fmt: skip

    rep = dict(interpret=False, device="cuda", probe=dict(copy_bytes_per_s=4e12), checks=[],
               timings=[t("adamw_fused", "float32", 10.0), t("gefen4", "float32", 5.0),
                        t("gefen8", "float32", 9.0)])  # fmt: skip
    g = gpu_check.goals(rep)
    assert g["gefen4_float32_x_adamw"] == dict(value=0.5, limit=0.6, met=True)
    assert g["gefen8_float32_x_adamw"]["met"] is False  # 0.9 > 0.8
    assert g["gefen4_float32_copy_share"]["met"] is False  # 1.4e11 B/s of 4e12
    assert g["gefen4_float32_first_step_x"]["met"] is True
    assert g["gefen4_bfloat16_x_adamw"]["met"] is None
    assert g["train_fsdp2_resumes"] == dict(met=None, why="did not run")
    assert g["state_bytes_as_cpu"]["met"] is None


def test_check_train_saves_and_resumes_on_cpu():
    """check_train, which the kit runs only on a GPU (one NCCL rank), here on the CPU (gloo):
    four steps saving at step 2, then a launch resumed from it."""
    import torch

    sys.path.insert(0, str(ROOT / "launch"))
    try:
        import gpu_items
    finally:
        sys.path.remove(str(ROOT / "launch"))
    got = gpu_items.check_train(torch.device("cpu"), "fsdp2", timeout_s=300)
    assert got["ok"] and got["resumed_from_step"] == 2, got
    assert got["saving"]["rc"] == got["resumed"]["rc"] == 0
    assert got["resumed_equal"] and got["max_val_loss_diff"] == 0.0 and got["val_loss"] > 0
