"""The README's distributed examples (launch/train.py with configs/run/*.yaml), as written, on
2 CPU ranks, and the run config's validation."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from dist_util import free_port

TRAIN = Path(__file__).parent.parent / "launch" / "train.py"
CONFIGS = Path(__file__).parent.parent / "configs" / "run"


def _launcher(name: str, cfg: Path, out: Path) -> list[str]:
    args = [str(TRAIN), "--config", str(cfg), "--set", "steps=3", "--set", "model.n_layer=1",
            "--no-progress", "--out", str(out)]  # fmt: skip
    port = str(free_port())
    if name == "deepspeed":
        return ["deepspeed", "--num_gpus", "2", f"--master_port={port}", *args]
    if name == "accelerate":
        return ["accelerate", "launch", "--multi_gpu", "--num_processes", "2",
                f"--main_process_port={port}", *args]  # fmt: skip
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
            f"--master_port={port}", *args]  # fmt: skip


@pytest.mark.parametrize(
    "launcher,config",
    [("torchrun", "ddp.yaml"), ("torchrun", "fsdp1.yaml"), ("torchrun", "fsdp2.yaml"),
     ("deepspeed", "deepspeed_zero2.yaml"), ("accelerate", "accelerate.yaml")],
)  # fmt: skip
def test_run_config_trains_under_each_launcher(launcher, config, tmp_path):
    """launch/train.py is one script for torchrun, deepspeed and accelerate launch."""
    out = tmp_path / "out.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(_launcher(launcher, CONFIGS / config, out), env=env, capture_output=True,
                       text=True, timeout=400)  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    res = json.loads(out.read_text())
    assert res["world_size"] == 2 and res["config"]["model"]["n_layer"] == 1
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
