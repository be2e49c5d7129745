"""The README's distributed examples (launch/train.py with configs/run/*.yaml), as written, on
2 CPU ranks, and the run config's validation."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from dist_util import free_port

pytestmark = pytest.mark.unit

TRAIN = Path(__file__).parent.parent / "launch" / "train.py"
CONFIGS = Path(__file__).parent.parent / "configs" / "run"
# Accelerate's DeepSpeed on CPU ranks, under torchrun (README, "Accelerate")
LAUNCH_ENV = {
    "accelerate-deepspeed": {
        "ACCELERATE_USE_DEEPSPEED": "true",
        "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(CONFIGS.parent / "ds_zero2_auto_cpu.json"),
    }
}


def _launcher(name: str, cfg: Path, out: Path, *extra: str, nproc: int = 2) -> list[str]:
    args = [str(TRAIN), "--config", str(cfg), "--set", "steps=3", "--set", "model.n_layer=1",
            "--no-progress", "--out", str(out), *extra]  # fmt: skip
    port = str(free_port())
    if name == "deepspeed":
        return ["deepspeed", "--num_gpus", "2", f"--master_port={port}", *args]
    if name == "accelerate":
        return ["accelerate", "launch", "--multi_gpu", "--num_processes", "2",
                f"--main_process_port={port}", *args]  # fmt: skip
    if name.startswith("accelerate:"):  # an Accelerate config file instead of --multi_gpu
        return ["accelerate", "launch", "--config_file", name.split(":", 1)[1],
                f"--main_process_port={port}", *args]  # fmt: skip
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
            f"--master_port={port}", *args]  # fmt: skip


def _launch(
    launcher: str, config: str, out: Path, *extra: str, ok: bool = True, nproc: int = 2
) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **LAUNCH_ENV.get(launcher, {})}
    cmd = _launcher(launcher, CONFIGS / config, out, *extra, nproc=nproc)
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert (p.returncode == 0) == ok, p.stdout[-3000:] + p.stderr[-6000:]
    return p


RAN = {
    "ddp.yaml": {"distributed_type": "DDP"},
    "fsdp1.yaml": {"distributed_type": "FSDP1"},
    "fsdp2.yaml": {"distributed_type": "FSDP2"},
    "deepspeed_zero2.yaml": {"distributed_type": "DEEPSPEED", "zero_stage": 2},
    "accelerate.yaml": {"distributed_type": "MULTI_CPU"},  # Accelerate on CPUs: plain DDP
}


@pytest.mark.dist
@pytest.mark.parametrize(
    "launcher,config",
    [("torchrun", "ddp.yaml"), ("torchrun", "fsdp1.yaml"), ("torchrun", "fsdp2.yaml"),
     ("deepspeed", "deepspeed_zero2.yaml"), ("accelerate", "accelerate.yaml")],
)  # fmt: skip
def test_run_config_trains_under_each_launcher(launcher, config, tmp_path):
    """launch/train.py is one script for torchrun, deepspeed and accelerate launch."""
    out = tmp_path / "out.json"
    p = _launch(launcher, config, out)
    res = json.loads(out.read_text())
    assert res["world_size"] == 2 and res["config"]["model"]["n_layer"] == 1
    assert len(res["ranks"]) == 2  # every rank reported
    assert res["ran"]["device"].startswith("cpu") and res["ran"]["backend"] == "gloo"
    assert {k: res["ran"][k] for k in RAN[config]} == RAN[config]
    assert f"ran {RAN[config]['distributed_type']}" in p.stdout, p.stdout
    for r in res["ranks"]:
        assert 0 < r["state_bytes"] < 0.25 * r["adamw_bytes"]
    if config in ("ddp.yaml", "accelerate.yaml"):  # replicated: both ranks hold the whole state
        assert res["ranks"][0]["state_bytes"] == res["ranks"][1]["state_bytes"]
    assert res["final_val_loss"] < res["curve"][0]["val_loss"]


def _train_module():
    sys.path.insert(0, str(TRAIN.parent))
    import train

    return train


@pytest.mark.parametrize(
    "text,named",
    [
        ("optimizer: {bitz: 4}", "optimizer.bitz"),
        ("sharding: {mode: zero3}", "sharding.mode"),
        ("stepz: 10", "stepz"),
        ("model: {n_layer: two}", "model.n_layer"),
        ("optimizer: {bits: 3}", "optimizer.bits"),
        ("data: 5", "data"),
        ("steps: 0", "steps"),
        ("device: tpu", "device"),
        ("optimizer: {lr: -1}", "optimizer.lr"),
        ("optimizer: {weight_decay: -1}", "optimizer.weight_decay"),
        ("optimizer: {betas: [0.9, 1.0]}", "optimizer.betas"),
        ("optimizer: {name: adamw, betas: [0.9, 1.0]}", "optimizer.betas"),
        ("optimizer: {name: adamw, lr: -1.0e-3}", "optimizer.lr"),
        ("optimizer: {betas: [0.9, high]}", "optimizer.betas"),
        ("checkpoint: {dir: ck, save_at: 41}", "checkpoint.save_at"),
        ("checkpoint: {save_at: 5}", "checkpoint.save_at"),
        ("checkpoint: {resume: /nonexistent}", "checkpoint.resume"),
    ],
)
def test_a_bad_run_config_key_is_named(text, named, tmp_path):
    train = _train_module()
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    with pytest.raises(train.ConfigError, match=f"'{named}'|{named} must be a mapping"):
        train.load_config(cfg)


def test_the_device_follows_the_config_and_the_machine():
    """auto and cpu take the CPU on a machine without a GPU; cuda there stops, naming the key."""
    import torch

    train = _train_module()
    for want in ("auto", "cpu"):
        assert train.rank_device(train.load_config({"device": want})) == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(train.ConfigError, match="device: 'cuda'"):
            train.rank_device(train.load_config({"device": "cuda"}))


@pytest.mark.slow
def test_a_bad_key_stops_the_script_before_any_process_group(tmp_path):
    """Exit 2 with the key named, from --config and from --set alike."""
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("optimizer: {bitz: 4}")
    for args in (["--config", str(cfg)], ["--set", "sharding.zero_stage=4"]):
        p = subprocess.run([sys.executable, str(TRAIN), *args], capture_output=True, text=True,
                           timeout=120)  # fmt: skip
        assert p.returncode == 2, p.stderr[-2000:]
        assert "'optimizer.bitz'" in p.stderr or "'sharding.zero_stage'" in p.stderr, p.stderr


def test_every_shipped_run_config_is_valid():
    train = _train_module()
    configs = sorted(CONFIGS.glob("*.yaml"))
    assert configs
    for c in configs:
        assert train.load_config(c)["sharding"]["mode"] in c.stem


def _rendezvous_env(world: int) -> dict:
    """What a launcher sets for a process group of ``world`` ranks: without the config check, a
    1-rank group starts and the optimizer fails inside it."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "RANK": "0", "LOCAL_RANK": "0",
            "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port())}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    "override,named",
    [("optimizer.lr=-1", "optimizer.lr"), ("optimizer.weight_decay=-1", "optimizer.weight_decay"),
     ("optimizer.betas=[0.9,1.0]", "optimizer.betas")],
)  # fmt: skip
def test_a_bad_optimizer_value_stops_the_script_before_any_process_group(override, named):
    p = subprocess.run([sys.executable, str(TRAIN), "--config", str(CONFIGS / "ddp.yaml"),
                        "--set", override], env=_rendezvous_env(1), capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert p.returncode == 2, p.stderr[-2000:]
    assert f"'{named}'" in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize(
    "config,launcher",
    [("ddp.yaml", "torchrun --nproc_per_node 2"), ("fsdp1.yaml", "torchrun --nproc_per_node 2"),
     ("fsdp2.yaml", "torchrun --nproc_per_node 2"),
     ("deepspeed_zero2.yaml", "deepspeed --num_gpus 2"),
     ("accelerate.yaml", "accelerate launch --multi_gpu --num_processes 2")],
)  # fmt: skip
def test_without_a_launcher_the_script_says_which_to_use(config, launcher):
    """Not torch's "environment variable RANK expected" from deep in rendezvous."""
    gone = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
    env = {k: v for k, v in os.environ.items() if k not in gone}
    args = [str(TRAIN), "--config", str(CONFIGS / config), "--set", "steps=3"]
    p = subprocess.run([sys.executable, *args], env={**env, "OMP_NUM_THREADS": "1"},
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert p.returncode == 2, p.stderr[-2000:]
    assert "Traceback" not in p.stderr, p.stderr[-2000:]
    assert f"{launcher} {TRAIN} --config {CONFIGS / config} --set steps=3" in p.stderr, p.stderr


@pytest.mark.dist
def test_accelerate_on_cpus_says_it_ignored_an_fsdp_config(tmp_path):
    """Accelerate on a machine without a GPU runs an FSDP config as plain multi-process DDP; the
    run must say so rather than report the config's wish."""
    out = tmp_path / "out.json"
    fsdp2 = Path(__file__).parent.parent / "configs" / "accelerate_fsdp2.yaml"
    p = _launch(f"accelerate:{fsdp2}", "accelerate.yaml", out)
    warnings = [line for line in p.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "asks for FSDP" in warnings[0], p.stderr[-3000:]
    assert "MULTI_CPU" in warnings[0] and "no sharding" in warnings[0]
    res = json.loads(out.read_text())
    assert res["ran"]["distributed_type"] == "MULTI_CPU" and "fsdp_version" not in res["ran"]


TINY = ["--set", "steps=4", "--set", "eval_every=1", "--set", "model.n_embd=32",
        "--set", "model.block_size=16", "--set", "data.batch_size=2",
        "--set", "data.val_batches=1", "--set", "data.max_bytes=65536"]  # fmt: skip


@pytest.mark.dist
@pytest.mark.parametrize(
    "launcher,config",
    [("torchrun", "ddp.yaml"), ("torchrun", "fsdp1.yaml"), ("torchrun", "fsdp2.yaml"),
     ("deepspeed", "deepspeed_zero2.yaml"), ("accelerate", "accelerate.yaml"),
     ("accelerate-deepspeed", "accelerate.yaml")],
)  # fmt: skip
def test_a_resumed_run_ends_exactly_as_one_never_stopped(launcher, config, tmp_path):
    """4 steps straight; 4 steps saving at step 2; then a fresh launch resuming from that save
    runs steps 3 and 4. Every rank's data order, the lr schedule and the model and optimizer
    state carry over, and on CPUs each framework's steps are deterministic: the losses after
    every step (mean train loss over ranks and validation loss, evaluated each step) agree bit
    for bit."""
    ck = tmp_path / "ck"
    runs = {}
    for name, extra in [
        ("straight", []),
        ("saving", ["--set", f"checkpoint.dir={ck}", "--set", "checkpoint.save_at=2"]),
        ("resumed", ["--resume", str(ck)]),
    ]:
        out = tmp_path / f"{name}.json"
        _launch(launcher, config, out, *TINY, *extra)
        runs[name] = json.loads(out.read_text())
    straight, saving, resumed = runs["straight"], runs["saving"], runs["resumed"]
    assert resumed["resumed_from_step"] == 2 and straight["resumed_from_step"] == 0
    assert [len(run["ranks"]) for run in runs.values()] == [2, 2, 2]  # every rank reported
    if launcher == "accelerate-deepspeed":  # not Accelerate's plain data parallel on CPUs
        for run in runs.values():
            assert (run["ran"]["distributed_type"], run["ran"].get("zero_stage")) == (
                "DEEPSPEED", 2)  # fmt: skip
    assert [c["step"] for c in straight["curve"]] == [0, 1, 2, 3, 4]
    assert saving["curve"] == straight["curve"]
    assert resumed["curve"] == straight["curve"]
    assert resumed["final_val_loss"] == straight["final_val_loss"]
    assert [r["state_bytes"] for r in resumed["ranks"]] == [
        r["state_bytes"] for r in straight["ranks"]
    ]
    if config == "ddp.yaml":  # another config cannot continue the sequence: refused up front
        p = subprocess.run([sys.executable, str(TRAIN), "--config", str(CONFIGS / config),
                            *TINY, "--set", "optimizer.lr=2.0e-3", "--resume", str(ck)],
                           env=_rendezvous_env(2), capture_output=True, text=True,
                           timeout=120)  # fmt: skip
        assert p.returncode == 2 and "optimizer.lr: 0.001 saved, 0.002 now" in p.stderr, p.stderr


@pytest.mark.dist
def test_accelerate_deepspeed_zero2_steps_the_gefen_its_config_builds(tmp_path):
    """The DeepSpeed JSON names the optimizer ("type": "Gefen"), so Accelerate takes no built one:
    the script passes DummyOptim with the run config's lr and weight decay and fills the JSON's
    "auto" batch size and clipping; the JSON's betas win, and the run says so. The same run under
    Accelerate's plain DDP (no ACCELERATE_USE_DEEPSPEED) with the JSON's betas is the yardstick:
    the same losses but for ZeRO's partition cuts, the same lr at the end of the schedule, and
    half the optimizer state on each rank."""
    # a schedule that has left warmup, and a clip below Accelerate's own 1.0
    same = [*TINY, "--set", "optimizer.warmup=2", "--set", "optimizer.grad_clip=0.5"]
    _launch("torchrun", "accelerate.yaml", tmp_path / "ddp.json", *same,
            "--set", "optimizer.betas=[0.9,0.999]")  # fmt: skip
    p = _launch("accelerate-deepspeed", "accelerate.yaml", tmp_path / "zero2.json", *same)
    ddp, zero2 = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("ddp", "zero2"))
    ran = zero2["ran"]
    assert (ran["distributed_type"], ran.get("zero_stage"), ran["backend"]) == (
        "DEEPSPEED", 2, "gloo")  # fmt: skip
    assert ran["optimizer"] == "Gefen" and zero2["world_size"] == 2
    assert ran["gradient_clipping"] == 0.5
    assert ddp["ran"]["distributed_type"] == "MULTI_CPU" and ddp["ran"]["optimizer"] == "Gefen"
    warnings = [line for line in p.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, p.stderr[-3000:]
    assert "sets optimizer.betas=[0.9, 0.999] (run config: [0.9, 0.95])" in warnings[0]
    factor = _train_module().lr_factor(zero2["config"], zero2["config"]["steps"] - 1)
    assert factor < 1
    assert zero2["final_lr"] == ddp["final_lr"] == pytest.approx(1e-3 * factor)
    # ZeRO-2 cuts no Gefen block of this model (its partition boundary falls in a tensor kept
    # per element), so only float sums differ from DDP: measured 5e-7 at most; a schedule that
    # never reached DeepSpeed's Gefen moves the losses by 1e-2.
    for a, b in zip(ddp["curve"], zero2["curve"], strict=True):
        assert a["step"] == b["step"] and b["val_loss"] == pytest.approx(a["val_loss"], abs=1e-5)
    # ZeRO-2 splits the flat fp32 buffer (21472 elements, no padding) into equal halves. Their
    # state differs from half of DDP's only by the mix of per-element (4 B) and coded elements
    # each half holds: measured 16448 and 16192 B of 32640 (0.4% off half), and together exactly
    # the whole, since no block is cut and no state duplicated.
    assert len(ddp["ranks"]) == len(zero2["ranks"]) == 2  # every rank reported
    whole, n = ddp["ranks"][0]["state_bytes"], ddp["ranks"][0]["state_params"]
    assert all((r["state_bytes"], r["state_params"]) == (whole, n) for r in ddp["ranks"])
    assert [r["state_params"] for r in zero2["ranks"]] == [n // 2, n // 2]
    held = [r["state_bytes"] for r in zero2["ranks"]]
    assert sum(held) == whole and all(abs(h - whole / 2) <= 0.01 * whole for h in held), held


@pytest.mark.dist
def test_accelerate_deepspeed_refuses_a_config_that_builds_another_optimizer(tmp_path):
    """optimizer.name adamw, but the DeepSpeed JSON builds Gefen: stopped, naming both."""
    out = tmp_path / "out.json"
    p = _launch("accelerate-deepspeed", "accelerate.yaml", out, *TINY,
                "--set", "optimizer.name=adamw", ok=False)  # fmt: skip
    assert "optimizer.name is 'adamw'" in p.stderr and "'Gefen'" in p.stderr, p.stderr[-3000:]
    assert not out.exists()


@pytest.mark.dist
@pytest.mark.parametrize(
    "config",
    [
        "fsdp2.yaml",
        "ddp.yaml",
        "fsdp1.yaml",
        "hsdp.yaml",
        "deepspeed_zero2.yaml",
        "accelerate.yaml",
    ],
)
def test_a_run_resumes_at_another_world_size(config, tmp_path):
    """Saved by 2 ranks at step 3 of 6, resumed by 1 and (FSDP2) by 4: the run continues from
    the saved step and curve and its loss goes on falling; under DDP the one rank holds the
    saved state's bytes exactly (whole tensors, the saved blocks: a run started on one rank
    would choose its blocks from other batches). The Gefen state's re-cut is tested step by
    step in tests/test_elastic.py, tests/test_fsdp_elastic.py, tests/test_zero_elastic.py and
    tests/test_accelerate_elastic.py; here it is the launcher's path: each framework's load,
    the trainer state of rank 0, a new data stream. Every launch is torchrun's (the deepspeed
    and Accelerate modes read its environment as their own launchers')."""
    ck = tmp_path / "ck"
    six = [*TINY, "--set", "steps=6"]
    _launch("torchrun", config, tmp_path / "saving.json", *six,
            "--set", f"checkpoint.dir={ck}", "--set", "checkpoint.save_at=3")  # fmt: skip
    saving = json.loads((tmp_path / "saving.json").read_text())
    for world in (1, 4) if config == "fsdp2.yaml" else (1,):
        out = tmp_path / f"resumed{world}.json"
        _launch("torchrun", config, out, *six, "--resume", str(ck), nproc=world)
        resumed = json.loads(out.read_text())
        assert resumed["resumed_from_step"] == 3 and resumed["world_size"] == world
        assert len(resumed["ranks"]) == world
        assert resumed["curve"][:4] == saving["curve"][:4]
        assert [c["step"] for c in resumed["curve"]] == list(range(7))
        assert resumed["curve"][-1]["val_loss"] < resumed["curve"][3]["val_loss"]
        if config == "ddp.yaml":
            assert resumed["ranks"][0]["state_bytes"] == saving["ranks"][0]["state_bytes"]
