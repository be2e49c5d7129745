"""Every file in configs/ parses with the framework that will read it, so a typo fails here.

Accelerate YAMLs go through what ``accelerate launch --config_file`` does: the ClusterConfig
loader (unknown top-level keys), the launch parser (unknown ``deepspeed_config`` / ``fsdp_config``
keys), the launcher's environment, and the plugin built from that environment
(``FullyShardedDataParallelPlugin`` checks every FSDP value, ``DeepSpeedPlugin`` reads the JSON).
DeepSpeed JSONs go through ``DeepSpeedConfig`` (pydantic: unknown ``zero_optimization`` keys fail),
with "auto" values filled as Accelerate and the Trainer fill them, and their Gefen params through
``gefen_dist.integrations.deepspeed.from_config``. configs/run/ holds launch/train.py's run
configs, checked by that script's tests.
"""

import json
from pathlib import Path

import pytest
from needs import extra

pytestmark = pytest.mark.unit

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
ROOT = CONFIGS.parent
YAMLS = sorted(CONFIGS.glob("*.yaml"))
JSONS = sorted(CONFIGS.glob("*.json"))
# What Accelerate (DummyOptim's lr and weight_decay, the DataLoader's batch size) or the HF Trainer
# (its TrainingArguments) write over "auto" before DeepSpeed sees the config.
AUTO = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "lr": 1e-3,
    "weight_decay": 0.0,
    "enabled": False,
}


def test_every_file_is_a_checked_kind():
    files = {p.name for p in CONFIGS.iterdir() if p.is_file()}
    assert files == {"README.md"} | {p.name for p in YAMLS + JSONS}
    assert len(YAMLS) >= 6 and len(JSONS) >= 10
    readme = (CONFIGS / "README.md").read_text()
    for p in YAMLS + JSONS:
        assert p.name in readme, f"configs/README.md does not mention {p.name}"


def _fill(value, key=None):
    if isinstance(value, dict):
        return {k: _fill(v, k) for k, v in value.items()}
    return AUTO[key] if value == "auto" else value


@pytest.mark.parametrize("path", JSONS, ids=lambda p: p.name)
def test_deepspeed_json(path):
    extra("deepspeed")
    import torch
    from deepspeed.runtime.config import DeepSpeedConfig

    import gefen_dist
    import gefen_dist.integrations.deepspeed as gd

    gefen_dist.register("deepspeed")
    raw = json.loads(path.read_text())
    assert "zero_allow_untested_optimizer" not in raw
    cfg = DeepSpeedConfig(_fill(raw))
    assert cfg.optimizer_name == gd.OPTIMIZER_TYPE
    stage = int(path.name.split("zero")[1][0])
    assert cfg.zero_optimization_stage == stage
    if "_cpu" in path.name:
        assert "bf16" not in raw and "fp16" not in raw
    else:
        assert raw["bf16"]["enabled"] == ("auto" if "_auto" in path.name else True)
    if "_offload" in path.name:  # ZeRO-Offload: Gefen steps the host partitions
        assert stage in (2, 3) and cfg.zero_config.offload_optimizer.device == "cpu"
        assert "zero_force_ds_cpu_optimizer" not in raw  # Gefen from the config is never checked
    opt = gd.from_config([torch.zeros(2, requires_grad=True)], cfg.optimizer_params)
    assert opt.defaults["bits"] in (4, 8)


def _launch_args(path):
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    parser = launch_command_parser()
    dests = {a.dest for a in parser._actions}
    from accelerate.commands.config.config_args import load_config_from_file

    loaded = load_config_from_file(str(path))
    for section in ("deepspeed_config", "fsdp_config"):
        unknown = set(getattr(loaded, section)) - dests
        assert not unknown, (
            f"{path.name}: {section} keys accelerate launch does not know: {unknown}"
        )
    args, defaults, mp_from_config = _validate_launch_command(
        parser.parse_args(["--config_file", str(path), "train.py"])
    )
    return args, defaults, mp_from_config


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.name)
def test_accelerate_yaml(path, monkeypatch):
    extra("accelerate")
    import torch
    from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    monkeypatch.chdir(ROOT)  # DeepSpeed JSON paths in the YAMLs are relative to the repository
    args, defaults, _ = _launch_args(path)
    assert args.num_processes == 2
    if args.use_deepspeed:
        extra("deepspeed")
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
        _, env = prepare_deepspeed_cmd_env(args)
    else:
        assert args.use_fsdp or args.multi_gpu
        env = prepare_multi_gpu_env(args)
    for k, v in env.items():
        if k.startswith(("ACCELERATE_", "FSDP_")):
            monkeypatch.setenv(k, v)
    if args.use_deepspeed:
        plugin = DeepSpeedPlugin()
        assert plugin.hf_ds_config.config["optimizer"]["type"].lower() == "gefen"
        assert plugin.zero_stage == int(path.stem.split("zero")[1][0])
    if args.use_fsdp:
        if not torch.cuda.is_available():
            # Both make the plugin ask for the current GPU, after every other field is checked.
            monkeypatch.setenv("FSDP_SYNC_MODULE_STATES", "false")
            monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")
        plugin = FullyShardedDataParallelPlugin()
        assert plugin.fsdp_version == int(path.stem[-1])
        assert plugin.auto_wrap_policy is not None


def test_a_typo_fails(tmp_path):
    """The checks above can fail: a misspelt key in each kind of file is refused."""
    extra("deepspeed")
    extra("accelerate")
    from deepspeed.runtime.config import DeepSpeedConfig

    bad = json.loads((CONFIGS / "ds_zero2_cpu.json").read_text())
    bad["zero_optimization"]["overlap_comn"] = True
    with pytest.raises(Exception, match="overlap_comn"):
        DeepSpeedConfig(bad)
    text = (CONFIGS / "accelerate_fsdp2.yaml").read_text()
    (tmp_path / "a.yaml").write_text(text.replace("fsdp_reshard_after_forward", "fsdp_reshard"))
    with pytest.raises(AssertionError, match="fsdp_reshard"):
        _launch_args(tmp_path / "a.yaml")
    (tmp_path / "b.yaml").write_text(text.replace("num_machines", "num_machine"))
    with pytest.raises(ValueError, match="num_machine"):
        _launch_args(tmp_path / "b.yaml")
