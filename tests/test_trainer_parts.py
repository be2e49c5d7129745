"""launch/train.py's parts (launch/trainer/), each in one process without a launcher: the --set
overrides, the checkpoint commit cut short at its kill point, the marker's record of an HSDP mesh
and what a resume decides from it, the trainer file's format, the checks a resume makes, the
per-rank figures, the digest, and that every sharding mode has a setup and a launcher. The
launches themselves are in test_dist_train.py, test_chaos.py and test_multinode.py."""

import json
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.unit

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launch"))
from trainer import checkpoint, checkpoint_dir, config, faults, launchers, results  # noqa: E402
from trainer.optimizer import build_optimizer, state_bytes  # noqa: E402


# -- config -----------------------------------------------------------------------------------
def test_set_overrides_one_key_as_yaml_and_keeps_the_rest():
    cfg = config.load_config(None)
    config.set_key(cfg, "optimizer.betas=[0.8, 0.9]")
    config.set_key(cfg, "sharding.mode=fsdp2")
    assert cfg["optimizer"]["betas"] == [0.8, 0.9] and cfg["sharding"]["mode"] == "fsdp2"
    assert cfg["optimizer"]["lr"] == config.DEFAULTS["optimizer"]["lr"]
    config.set_key(cfg, "optimizer.lr=1")  # an int where the default is a float: taken as one
    assert cfg["optimizer"]["lr"] == 1.0 and isinstance(cfg["optimizer"]["lr"], float)


@pytest.mark.parametrize(
    "override,error",
    [("steps", "expected KEY=VALUE"), ("optimizer.bitz=4", "unknown key 'optimizer.bitz'"),
     ("optimizer.betas=[0.9]", "'optimizer.betas' must be like"),
     ("sharding.mode=zero", "'sharding.mode' must be one of"),
     ("optimizer=adamw", "optimizer must be a mapping"), ("steps=true", "'steps' must be like")],
)  # fmt: skip
def test_a_bad_set_is_refused_naming_the_key_and_leaves_the_config(override, error):
    cfg = config.load_config(None)
    with pytest.raises(config.ConfigError, match=error):
        config.set_key(cfg, override)
    assert cfg == config.DEFAULTS


# -- the checkpoint directory -------------------------------------------------------------------
class _Killed(Exception):
    pass


class _KillAt:
    """A kill point that stops the commit where ``GEFEN_CHAOS_KILL``'s ``commit`` kills rank 0."""

    def __init__(self, phase: str):
        self.phase, self.seen = phase, []

    def at(self, phase: str) -> None:
        self.seen.append(phase)
        if phase == self.phase:
            raise _Killed(phase)


def _written(root: Path, step: int, payload: bytes = b"x" * 10) -> Path:
    tmp = root / f".{checkpoint_dir.STEP_DIR.format(step)}.tmp"
    (tmp / "dcp").mkdir(parents=True)
    (tmp / "dcp" / ".metadata").write_bytes(payload)
    (tmp / checkpoint_dir.TRAINER_FILE.format(0)).write_bytes(payload)
    return tmp


def test_a_commit_cut_after_its_marker_leaves_no_checkpoint(tmp_path):
    """Rank 0 killed between the marker and the rename: the save has a complete-looking marker
    but keeps its torn name, so the previous checkpoint is the one resumed from."""
    two = root = tmp_path / "ck"
    two = root / checkpoint_dir.STEP_DIR.format(2)
    checkpoint_dir.commit(_written(root, 2), two, 2, 2, _KillAt("none"))
    tmp = _written(root, 4)
    with pytest.raises(_Killed):
        checkpoint_dir.commit(tmp, root / checkpoint_dir.STEP_DIR.format(4), 4, 2,
                              _KillAt("commit"))  # fmt: skip
    assert (tmp / checkpoint_dir.DONE).exists() and checkpoint_dir.is_complete(tmp)
    assert not (root / checkpoint_dir.STEP_DIR.format(4)).exists()
    assert checkpoint_dir.complete_checkpoints(root) == [checkpoint_dir.Checkpoint(2, two)]
    assert checkpoint_dir.find_checkpoint(root) == two
    assert checkpoint_dir.remove_torn(root) == [tmp.name]


def test_the_marker_records_an_hsdp_mesh_and_a_resume_reads_it(tmp_path, monkeypatch):
    d = tmp_path / checkpoint_dir.STEP_DIR.format(3)
    checkpoint_dir.commit(_written(tmp_path, 3), d, 3, 4, _KillAt("none"), (2, 2))
    marker = checkpoint_dir.read_marker(d)
    assert marker == checkpoint_dir.Marker(
        step=3, world_size=4, mesh=[2, 2],
        files={"dcp/.metadata": 10, checkpoint_dir.TRAINER_FILE.format(0): 10},
    )  # fmt: skip
    assert list(json.loads((d / checkpoint_dir.DONE).read_text())) == [
        "step", "world_size", "mesh", "files"]  # fmt: skip
    assert checkpoint.saved_world(d) == 4
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    hsdp = config.load_config({"sharding": {"mode": "hsdp", "mesh": [2, 2]}})
    assert not checkpoint.moved_mesh(hsdp, d, 4)
    other = config.load_config({"sharding": {"mode": "hsdp", "mesh": [1, 4]}})
    assert checkpoint.moved_mesh(other, d, 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # [0, 0]: one shard group per node of 4
    assert checkpoint.moved_mesh(config.load_config({"sharding": {"mode": "hsdp"}}), d, 4)
    assert not checkpoint.moved_mesh(config.load_config({"sharding": {"mode": "fsdp2"}}), d, 4)


# -- resume ---------------------------------------------------------------------------------------
def _trainer_state(cfg: dict, world: int = 2) -> checkpoint.TrainerState:
    gen = torch.Generator().manual_seed(5)
    return checkpoint.TrainerState(step=4, data_rng=gen.get_state(), window=[2.5, 2.25],
                                   curve=[dict(step=0, train_loss=None, val_loss=5.0)],
                                   config=cfg, world_size=world)  # fmt: skip


def test_the_trainer_file_keeps_its_keys_and_loads_weights_only(tmp_path):
    cfg = config.load_config(None)
    state = _trainer_state(cfg)
    path = tmp_path / checkpoint_dir.TRAINER_FILE.format(0)
    torch.save(state.to_dict(), path)
    saved = torch.load(path, weights_only=True)
    assert list(saved) == ["step", "data_rng", "window", "curve", "config", "world_size"]
    back = checkpoint.TrainerState.from_dict(saved)
    assert torch.equal(back.data_rng, state.data_rng)
    assert (back.step, back.window, back.curve, back.config, back.world_size) == (
        4, [2.5, 2.25], state.curve, cfg, 2)  # fmt: skip
    del saved["window"]
    with pytest.raises(KeyError, match="window"):
        checkpoint.TrainerState.from_dict(saved)


def test_a_resume_names_every_setting_that_differs_from_the_saved_run(tmp_path, monkeypatch):
    """Other checkpoint settings, the HSDP mesh and the world size may change; nothing else."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    saved_cfg = config.load_config({"checkpoint": {"dir": "a", "every": 2}})
    d = tmp_path / checkpoint_dir.STEP_DIR.format(4)
    tmp = _written(tmp_path, 4)
    torch.save(_trainer_state(saved_cfg).to_dict(), tmp / checkpoint_dir.TRAINER_FILE.format(0))
    checkpoint_dir.commit(tmp, d, 4, 2, _KillAt("none"))
    same = config.load_config({"checkpoint": {"dir": "b", "resume": str(tmp_path)}})
    monkeypatch.setenv("WORLD_SIZE", "3")
    checkpoint.check_resume(same)
    other = config.load_config({"optimizer": {"lr": 2e-3}, "steps": 50,
                                "checkpoint": {"resume": str(tmp_path)}})  # fmt: skip
    with pytest.raises(config.ConfigError) as e:
        checkpoint.check_resume(other)
    # the differences, and only those: not checkpoint.dir, .every nor .resume
    assert str(e.value).endswith(
        "world size; optimizer.lr: 0.001 saved, 0.002 now; steps: 40 saved, 50 now"
    ), e.value


# -- faults -------------------------------------------------------------------------------------
def test_the_kill_point_is_due_only_on_its_rank_at_its_step_and_phase():
    target = faults.parse_chaos("1:6:save")
    assert target == faults.ChaosKill(rank=1, step=6, phase="save")
    assert faults.Chaos(target, 0).target is None
    killer = faults.Chaos(target, 1)
    killer.step = 5
    assert not killer.due("save")
    killer.step = 6
    assert killer.due("save") and not killer.due("commit")


# -- launchers ------------------------------------------------------------------------------------
def test_every_sharding_mode_has_a_setup_and_a_launcher():
    modes = set(config.CHOICES["sharding.mode"])
    assert set(launchers.SETUPS) == modes and set(launchers.LAUNCHERS) == modes
    assert set(checkpoint.ELASTIC) == modes


# -- results ------------------------------------------------------------------------------------
def test_a_ranks_figures_cross_the_gather_exactly():
    mine = results.RankStats(state_bytes=2**40 + 3, state_params=123_457, peak_rss_bytes=2**35,
                             step_time_median_s=0.012345678)  # fmt: skip
    back = results.RankStats.from_tensor(mine.to_tensor(torch.device("cpu")))
    assert back == mine
    assert back.record(1) == dict(rank=1, state_bytes=2**40 + 3, state_params=123_457,
                                  adamw_bytes=8 * 123_457, peak_rss_bytes=2**35,
                                  step_time_median_s=0.012345678)  # fmt: skip


def test_the_results_json_keeps_its_keys_in_order():
    cfg = config.load_config(None)
    ran = dict(mode="ddp", device="cpu", backend="gloo", distributed_type="DDP",
               optimizer="Gefen")  # fmt: skip
    curve = [dict(step=0, train_loss=None, val_loss=5.0), dict(step=2, train_loss=4.0,
                                                              val_loss=4.5)]  # fmt: skip
    outcome = results.Outcome(ran=ran, world_size=2, resumed_from_step=0, n_params=10,
                              curve=curve, final_lr=1e-4, wall_time_s=1.5)  # fmt: skip
    ranks = [results.RankStats(10, 20, 30, 0.5), results.RankStats(11, 20, 31, 0.25)]
    res = results.results(cfg, outcome, ranks, None)
    assert list(res) == ["config", "ran", "world_size", "resumed_from_step", "n_params", "curve",
                         "final_train_loss", "final_val_loss", "final_lr", "wall_time_s",
                         "ranks", "torch_version"]  # fmt: skip
    assert (res["final_train_loss"], res["final_val_loss"]) == (4.0, 4.5)
    assert [r["rank"] for r in res["ranks"]] == [0, 1]
    assert list(results.results(cfg, outcome, ranks, [{"rank": 0}]))[-1] == "digest"
    assert results.ran_label(ran | dict(zero_stage=2)) == "DDP ZeRO-2 on cpu (gloo)"


@pytest.mark.parametrize("name", ["gefen", "adamw"])
def test_the_digest_sees_one_bit_of_the_parameters_or_the_state(name):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    cfg = config.load_config({"optimizer": {"name": name}})
    opt = build_optimizer(cfg, model.parameters())
    model(torch.randn(4, 8)).square().mean().backward()
    opt.step()
    first = results.digest(model, opt)
    assert first == results.digest(model, opt)
    assert first["param_tensors"] == 4 and first["state_tensors"] > 0
    for tensor, part in ((model[1].bias, "params"), (opt.state[model[0].weight]["exp_avg"],
                                                     "optimizer")):  # fmt: skip
        with torch.no_grad():
            tensor.view(torch.uint8)[0] ^= 1
            assert results.digest(model, opt)[part] != first[part]
            tensor.view(torch.uint8)[0] ^= 1
        assert results.digest(model, opt) == first
    held = state_bytes(opt)
    n = sum(p.numel() for p in model.parameters())
    assert held.params == n
    assert held.bytes == 8 * n if name == "adamw" else 0 < held.bytes < 8 * n
