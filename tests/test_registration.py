"""Gefen selected by name or passed as an object through DeepSpeed's JSON path and Accelerate.

The training scripts (tests/dist/reg_*.py) hold no Gefen-specific code beyond ``import gefen_dist``
and, where Accelerate imports DeepSpeed late, ``gefen_dist.register()``. DeepSpeed start-up is
slow, so one launch covers ZeRO 0-3 and each Accelerate configuration is one launch.

Launchers: the DeepSpeed JSON path (tests/dist/reg_ds.py) runs under the ``deepspeed`` launcher,
as a user's ``deepspeed train.py`` does; everything else under torchrun, whose environment
``deepspeed.init_distributed``, Accelerate and the Trainer read as their own launchers': the
callable-optimizer case is about the import order inside a rank, which each rank starts afresh
under either launcher.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist_util import deepspeed_run, duplicated_cross_bytes, read_results, torchrun
from needs import extra

from gefen_dist.integrations.register import register

pytestmark = pytest.mark.unit

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _python(code: str) -> str:
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-4000:]
    return p.stdout


@pytest.mark.slow
def test_import_needs_no_framework():
    out = _python(
        "import sys, gefen_dist\n"
        "print(sorted(m for m in ('deepspeed', 'accelerate', 'transformers') if m in sys.modules))"
    )
    assert out.strip() == "[]"


def test_register_refuses_unknown_framework():
    with pytest.raises(ValueError, match="no Gefen integration for 'megatron'"):
        register("megatron")


@pytest.mark.slow
def test_deepspeed_config_names_gefen_in_any_case():
    """Importing deepspeed before gefen_dist registers Gefen; ``register()`` does it after."""
    extra("deepspeed")
    check = (
        "from deepspeed.runtime.config import DeepSpeedConfig\n"
        "for t in ('Gefen', 'gefen', 'GEFEN'):\n"
        "    c = DeepSpeedConfig({'train_micro_batch_size_per_gpu': 1,\n"
        "                         'optimizer': {'type': t, 'params': {'lr': 1e-3}}})\n"
        "    assert c.optimizer_name == 'gefen', c.optimizer_name\n"
    )
    _python("import deepspeed\nimport gefen_dist\n" + check)
    _python("import gefen_dist\nassert gefen_dist.register() == ['deepspeed']\n" + check)
    # without either, DeepSpeed keeps the name as written and would look in torch.optim
    out = _python(
        "from deepspeed.runtime.config import DeepSpeedConfig\n"
        "print(DeepSpeedConfig({'train_micro_batch_size_per_gpu': 1,\n"
        "                       'optimizer': {'type': 'GEFEN'}}).optimizer_name)"
    )
    assert out.strip().endswith("GEFEN")


@pytest.mark.slow
def test_from_config_params():
    extra("deepspeed")
    out = _python(
        "import torch\n"
        "from gefen_dist.integrations.deepspeed import from_config\n"
        "p = [torch.zeros(3, requires_grad=True)]\n"
        "o = from_config(p, {'lr': 0.1, 'betas': [0.8, 0.9], 'bits': 8})\n"
        "assert o.defaults['betas'] == (0.8, 0.9) and o.defaults['bits'] == 8\n"
        "try:\n"
        "    from_config(p, {'lr': 0.1, 'max_grad_norm': 1.0, 'momentum': 0.9})\n"
        "except ValueError as e:\n"
        "    print(e)\n"
    )
    assert "unknown params ['max_grad_norm', 'momentum']" in out
    assert "'betas'" in out and "'bits'" in out


@pytest.mark.slow
def test_from_config_names_values_of_the_wrong_type():
    """A value no launcher resolved ("auto"), or one JSON typed wrongly, fails naming its key;
    a truthy string in a flag would otherwise be taken as true."""
    extra("deepspeed")
    out = _python(
        "import torch\n"
        "from gefen_dist.integrations.deepspeed import from_config\n"
        "p = [torch.zeros(3, requires_grad=True)]\n"
        "for bad in ({'lr': 'auto'}, {'weight_decay': 'auto'}, {'betas': 'auto'},\n"
        "            {'betas': [0.9, 'auto']}, {'betas': [0.9]}, {'eps': None},\n"
        "            {'lr': '3e-4'}, {'bits': 'auto'}, {'maximize': 'auto'}):\n"
        "    try:\n"
        "        from_config(p, {'lr': 0.1, **bad})\n"
        "        print('>> accepted', bad)\n"
        "    except ValueError as e:\n"
        "        print('>>', e)\n"
    )
    lines = [x[3:] for x in out.splitlines() if x.startswith(">> ")]  # DeepSpeed logs to stdout
    assert not [x for x in lines if x.startswith("accepted")], out
    lr, wd, betas, beta_auto, one_beta, eps, lr_str, bits, maximize = lines
    prefix = "DeepSpeed config optimizer {'type': 'Gefen'}: "
    assert lr.startswith(prefix + "'lr' must be a number, got 'auto' (")
    assert "Accelerate" in lr and "the plain deepspeed launcher" in lr
    assert "'weight_decay' must be a number, got 'auto'" in wd and "Accelerate" in wd
    assert "'betas' must be a pair of numbers [beta1, beta2], got 'auto'" in betas
    assert "Hugging Face Trainer" in betas and "Accelerate" not in betas
    assert "got [0.9, 'auto']" in beta_auto and "Hugging Face Trainer" in beta_auto
    assert "'betas' must be a pair of numbers [beta1, beta2], got [0.9]" in one_beta
    assert "'eps' must be a number, got None" in eps
    assert lr_str == prefix + "'lr' must be a number, got '3e-4'"
    assert "'bits' must be the integer 4 or 8, got 'auto'" in bits and "no launcher" in bits
    assert "'maximize' must be true or false, got 'auto'" in maximize


@pytest.fixture(scope="module")
def ds_json(tmp_path_factory):
    extra("deepspeed")
    out = tmp_path_factory.mktemp("reg_ds")
    deepspeed_run("reg_ds.py", str(out))
    ranks = read_results(out, ranks=2)
    assert [r["rank"] for r in ranks] == [0, 1]
    return ranks


WRAPPER = {
    0: "Gefen",
    1: "DeepSpeedZeroOptimizer",
    2: "DeepSpeedZeroOptimizer",
    3: "DeepSpeedZeroOptimizer_Stage3",
}


@pytest.mark.dist
@pytest.mark.parametrize("stage", (0, 1, 2, 3))
def test_deepspeed_json_builds_gefen(ds_json, stage):
    for r in ds_json:
        got = r[f"zero{stage}"]
        assert got["basic"] == "Gefen" and got["wrapper"] == WRAPPER[stage]
        assert got["betas"] == [0.9, 0.95] and got["weight_decay"] == 0.1
        assert got["bits"] == (8 if stage == 2 else 4)  # the JSON's bits reaches Gefen
        assert got["codebook_levels"] == 2 ** got["bits"]
        assert isinstance(got["memory"], dict), got["memory"]
        assert got["memory"]["state_bytes"] > 0
    a, b = (r[f"zero{stage}"]["losses"] for r in ds_json)
    assert a[0] != b[0]  # each rank its own batch
    assert a[-1] < a[0] + 0.1 and all(x == x for x in a + b)


@pytest.mark.dist
def test_deepspeed_json_follows_across_stages(ds_json):
    """Same model, data and hyper-parameters: every ZeRO stage trains like ZeRO-0 over 3 steps
    (test_deepspeed.py bounds the partition effects at 1e-4 in loss; measured here: 1.5e-6).
    Stage 2 runs 8-bit codes against ZeRO-0's 4-bit, hence its looser bound (measured 4e-6)."""
    for r in ds_json:
        ref = r["zero0"]["losses"]
        for stage, tol in ((1, 1e-4), (2, 1e-3), (3, 1e-4)):
            got = r[f"zero{stage}"]["losses"]
            assert got[0] == ref[0]
            assert max(abs(x - y) for x, y in zip(got, ref, strict=True)) < tol, (stage, got, ref)


@pytest.mark.dist
def test_deepspeed_json_zero0_memory_report_and_block_sizes(ds_json):
    """Under ZeRO-0 DeepSpeed steps Gefen itself, with no ZeRO wrapper around it: the report is
    Gefen's own, the whole model's state on every rank, which ZeRO-1's two partitions add up to
    (plus the second state of each block a partition boundary cuts, and v_cross copies)."""
    for r in ds_json:
        mem, blocks = r["zero0"]["memory"], r["zero0"]["blocks"]
        assert isinstance(mem, dict), mem
        assert (mem["wrapper"], mem["rank"], mem["world_size"]) == ("ZeRO-0", r["rank"], 2)
        assert mem["params"] == sum(q["zero1"]["memory"]["params"] for q in ds_json)
        assert 0 < mem["state_bytes"] < mem["adamw_bytes"] == 8 * mem["params"]
        assert isinstance(blocks, dict), blocks
        assert blocks == {**ds_json[0]["zero1"]["blocks"], **ds_json[1]["zero1"]["blocks"]}
    whole = ds_json[0]["zero0"]["memory"]["state_bytes"]
    assert ds_json[1]["zero0"]["memory"]["state_bytes"] == whole
    zero1 = [r["zero1"]["memory"] for r in ds_json]
    total = sum(m["state_bytes"] for m in zero1)
    assert whole <= total <= whole + 1024 + duplicated_cross_bytes(zero1)


@pytest.mark.dist
def test_deepspeed_json_unknown_param_is_refused(ds_json):
    msg = ds_json[0]["unknown_param"]
    assert msg is not None and "unknown params ['momentum']" in msg and "'bits'" in msg


@pytest.mark.dist
def test_deepspeed_json_unresolved_auto_is_named(ds_json):
    """deepspeed.initialize with "lr": "auto" left in: the error names the key and who resolves
    "auto" (DeepSpeed itself reads optimizer params only through Gefen's constructor path)."""
    for r in ds_json:
        msg = r["auto_lr"]
        assert msg is not None and msg.startswith("ValueError: "), msg
        assert "'lr' must be a number, got 'auto'" in msg and "Accelerate" in msg


def _accelerate(tmp_path, env):
    extra("accelerate")
    out = tmp_path / "out"
    out.mkdir()
    torchrun("reg_accel.py", str(out), str(tmp_path / "ckpt"), env=env)
    ranks = read_results(out, ranks=2)
    assert [r["rank"] for r in ranks] == [0, 1] and ranks[0]["world_size"] == 2
    for r in ranks:
        assert r["basic"] == "Gefen"
        assert r["replay"] == r["losses"][3:]
        assert r["resume_exact"]
        assert r["memory"][0] < r["memory"][1]  # Gefen's state below AdamW's
    assert ranks[0]["losses"][0] != ranks[1]["losses"][0]  # the DataLoader is sharded
    return ranks


@pytest.mark.dist
def test_accelerate_ddp_save_load_state(tmp_path):
    ranks = _accelerate(tmp_path, {"ACCELERATE_USE_CPU": "true"})
    assert ranks[0]["distributed_type"] == "DistributedType.MULTI_CPU"
    assert ranks[0]["model"] == "DistributedDataParallel"


@pytest.mark.dist
def test_accelerate_deepspeed_dummy_optim_save_load_state(tmp_path):
    extra("deepspeed")
    extra("transformers")  # Accelerate's DeepSpeed path imports it
    env = {
        "ACCELERATE_USE_DEEPSPEED": "true",
        "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(CONFIGS / "ds_zero2_auto_cpu.json"),
    }
    ranks = _accelerate(tmp_path, env)
    for r in ranks:
        assert r["distributed_type"] == "DistributedType.DEEPSPEED"
        assert r["wrapper"] == "DeepSpeedZeroOptimizer" and r["zero_stage"] == 2
        assert r["lr"] == 3e-3  # DummyOptim's lr filled the JSON's "auto"


@pytest.mark.dist
@pytest.mark.skipif(
    torch.cuda.device_count() < 1,
    reason="Accelerate's FSDP plugin asks for the current GPU (sync_module_states, device_id); "
    "FSDP itself is tested on CPU ranks in test_fsdp.py",
)
@pytest.mark.parametrize("version", ("1", "2"))
def test_accelerate_fsdp_save_load_state(tmp_path, version):
    """Skipped without a GPU, which a CPU-only CI never has: Accelerate's FSDP plugin asks for
    one."""
    env = {
        "ACCELERATE_USE_FSDP": "true",
        "FSDP_VERSION": version,
        "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
        "FSDP_TRANSFORMER_CLS_TO_WRAP": "Block",
        "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT",
        "FSDP_USE_ORIG_PARAMS": "true",
    }
    ranks = _accelerate(tmp_path, env)
    assert ranks[0]["distributed_type"] == "DistributedType.FSDP"


@pytest.fixture(scope="module")
def hf_runs(tmp_path_factory):
    """tests/dist/reg_hf.py: one launch trains both modes in turn, a second resumes both (a
    process holds one DeepSpeed Accelerator at a time: the train and the resume of ``ds`` are
    two launches)."""
    extra("transformers")
    extra("deepspeed")
    d = tmp_path_factory.mktemp("reg_hf")
    modes = ("ds", "object")
    for phase in ("train", "resume"):
        jobs = []
        for mode in modes:
            (d / mode / phase).mkdir(parents=True)
            jobs += [str(d / mode / phase), str(d / mode / "ckpt"), mode]
        torchrun("reg_hf.py", phase, *jobs, env={"HF_HUB_OFFLINE": "1"})
    return {
        mode: {phase: read_results(d / mode / phase, ranks=2) for phase in ("train", "resume")}
        for mode in modes
    }


@pytest.mark.dist
@pytest.mark.parametrize("mode", ("ds", "object"))
def test_hf_trainer_trains_saves_resumes(hf_runs, mode):
    """``--deepspeed`` with a Gefen JSON, and ``optimizers=(Gefen(...), None)`` under DDP: the
    run resumed from checkpoint-3 logs the same losses for steps 4-6 and ends on the same
    weights (a Gefen state lost in the checkpoint would re-initialise and diverge)."""
    runs = hf_runs[mode]
    for r, again in zip(runs["train"], runs["resume"], strict=True):
        assert r["basic"] == "Gefen" and r["world_size"] == 2
        assert r["wrapped"] == ("DeepSpeedEngine" if mode == "ds" else "DistributedDataParallel")
        assert sorted(r["losses"], key=int) == [str(s) for s in range(1, 7)]
        assert all(again["losses"][str(s)] == r["losses"][str(s)] for s in (4, 5, 6))
        assert again["weights"] == r["weights"]


@pytest.mark.dist
def test_deepspeed_callable_optimizer_binds_when_gefen_dist_came_first(tmp_path):
    """With gefen_dist imported before deepspeed and no register(), a Gefen built by a callable
    brings the integration in from inside deepspeed.initialize: it must still bind to the ZeRO
    partitions (it had left each flat partition one 1-D tensor, at bf16 moments' 4 bytes an
    element), as when the integration was there before."""
    extra("deepspeed")
    torchrun("ds_callable.py", str(tmp_path))
    ranks = read_results(tmp_path, ranks=2)
    for r in ranks:
        assert r["installed_before"] is False
        assert "error" not in r["first"], r["first"]
        assert r["first"] == r["again"]
