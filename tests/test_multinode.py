"""launch/train.py across nodes: two torchrun agents on this machine stand in for two nodes of 2
ranks each (c10d rendezvous), training configs/run/hsdp.yaml (FSDP2 sharded within a node,
replicated across), saving a checkpoint and resuming from it; and the mesh key's validation."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from dist_util import free_port

pytestmark = pytest.mark.unit

ROOT = Path(__file__).parent.parent
TRAIN = ROOT / "launch" / "train.py"
CONFIG = ROOT / "configs" / "run" / "hsdp.yaml"
TINY = ["--set", "steps=4", "--set", "eval_every=1", "--set", "model.n_embd=32",
        "--set", "model.n_layer=1", "--set", "data.max_bytes=262144", "--set", "data.val_batches=2",
        "--no-progress", "--digest"]  # fmt: skip
NODES, PER_NODE = 2, 2


def _two_nodes(out: Path, *extra: str) -> None:
    """Both agents of one rendezvous, as each node's launcher would start them; the first hosts
    the rendezvous store, as the node at --rdzv_endpoint does."""
    port, run_id = free_port(), uuid.uuid4().hex[:8]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agents = []
    for node in range(NODES):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES),
               "--nproc_per_node", str(PER_NODE), "--rdzv_backend", "c10d",
               "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", run_id,
               "--rdzv_conf", f"is_host={int(node == 0)}", "--node_rank", str(node),
               str(TRAIN), "--config", str(CONFIG), *TINY, "--out", str(out), *extra]  # fmt: skip
        agents.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True))  # fmt: skip
    logs = []
    try:
        for a in agents:
            logs.append(a.communicate(timeout=500)[0])
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
                a.wait()
    failed = [
        (a.returncode, log[-6000:]) for a, log in zip(agents, logs, strict=True) if a.returncode
    ]
    assert not failed, failed


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multinode")
    ck = tmp / "ck"
    out = {}
    for name, extra in [
        ("saving", ["--set", f"checkpoint.dir={ck}", "--set", "checkpoint.save_at=2"]),
        ("resumed", ["--resume", str(ck)]),
    ]:
        _two_nodes(tmp / f"{name}.json", *extra)
        out[name] = json.loads((tmp / f"{name}.json").read_text())
    # the same 4 ranks on one node: a (1, 4) mesh, other shard groups than the saved (2, 2)
    one = tmp / "one_node.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(NODES * PER_NODE),
           f"--master_port={free_port()}", str(TRAIN), "--config", str(CONFIG), *TINY,
           "--out", str(one), "--resume", str(ck)]  # fmt: skip
    p = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                       text=True, timeout=500)  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    out["one_node"] = json.loads(one.read_text())
    out["ck"] = ck
    return out


@pytest.mark.dist
def test_two_nodes_make_one_run_on_a_replicate_by_shard_mesh(runs):
    for run in (runs["saving"], runs["resumed"]):
        assert run["world_size"] == NODES * PER_NODE
        assert run["ran"]["mode"] == "hsdp" and run["ran"]["mesh"] == [NODES, PER_NODE]
        assert run["ran"]["optimizer"] == "Gefen"


@pytest.mark.dist
def test_the_resumed_run_continues_the_saved_one_bit_for_bit(runs):
    saving, resumed = runs["saving"], runs["resumed"]
    assert resumed["resumed_from_step"] == 2 and saving["resumed_from_step"] == 0
    assert [c["step"] for c in saving["curve"]] == [0, 1, 2, 3, 4]
    assert resumed["curve"] == saving["curve"]
    assert resumed["digest"] == saving["digest"]


@pytest.mark.dist
def test_a_checkpoint_of_two_nodes_resumes_on_one_node_of_as_many_ranks(runs):
    """Same world size, another mesh: the checkpoint's marker names the (2, 2) mesh that saved
    it, so the (1, 4) run re-cuts Gefen's state for its shard groups (launch/train.py,
    moved_mesh) rather than asking DCP for rank entries the checkpoint lacks."""
    saving, one = runs["saving"], runs["one_node"]
    assert one["resumed_from_step"] == 2 and one["ran"]["mesh"] == [1, NODES * PER_NODE]
    assert one["curve"][:3] == saving["curve"][:3]
    assert one["curve"][-1]["val_loss"] < one["curve"][2]["val_loss"]


@pytest.mark.dist
def test_replicas_on_the_two_nodes_hold_the_same_bits(runs):
    """Rank r on node 0 and rank r + 2 on node 1 hold the same piece: the same parameters and
    optimizer state; the two ranks of a node hold different pieces."""
    d = runs["saving"]["digest"]
    for key in ("params", "optimizer"):
        assert d[0][key] == d[2][key] and d[1][key] == d[3][key], key
        assert d[0][key] != d[1][key], key


@pytest.mark.dist
def test_each_rank_keeps_its_pieces_state_below_adamws(runs):
    ranks = runs["saving"]["ranks"]
    assert len(ranks) == NODES * PER_NODE
    for r in ranks:
        assert 0 < r["state_bytes"] < r["adamw_bytes"] / 4, r
    assert [r["state_bytes"] for r in ranks[:2]] == [r["state_bytes"] for r in ranks[2:]]
    n_params = runs["saving"]["n_params"]
    assert sum(r["state_params"] for r in ranks[:2]) == n_params  # one node holds it once


@pytest.mark.dist
def test_the_checkpoint_keys_the_pieces_of_one_nodes_shards(runs):
    """Gefen's state in global coordinates (``integrations.dcp``): no rank in a key, and block
    values by the element ranges of a node's two shards, which both nodes write alike."""
    from torch.distributed.checkpoint import FileSystemReader

    (step,) = sorted(runs["ck"].glob("step_*"))
    keys = FileSystemReader(str(step / "dcp")).read_metadata().state_dict_metadata
    assert not any(".gefen.rank" in k for k in keys)
    heads = {k[: k.index(".pieces.")] for k in keys if ".pieces." in k}
    assert heads
    for head in heads:
        ranges = [k[len(head) + len(".pieces.") :] for k in keys if k.startswith(head + ".pieces.")]
        assert len(ranges) <= PER_NODE, ranges


# -- the mesh key ---------------------------------------------------------------------------------
def _train_module():
    spec = importlib.util.spec_from_file_location("launch_train", TRAIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "sharding,named",
    [
        ({"mode": "hsdp", "mesh": [2]}, "key 'sharding.mesh' must be like [0, 0]"),
        ({"mode": "hsdp", "mesh": [2, 0]}, "both positive"),
        ({"mode": "hsdp", "mesh": [2, "x"]}, "two integers >= 0"),
        ({"mode": "hsdp", "mesh": [True, 2]}, "two integers >= 0"),
        ({"mode": "fsdp2", "mesh": [2, 2]}, "applies to sharding.mode 'hsdp' only"),
        ({"mode": "hsdpp"}, "key 'sharding.mode' must be one of"),
    ],
)
def test_a_bad_mesh_is_named(sharding, named):
    train = _train_module()
    with pytest.raises(train.ConfigError, match="sharding") as e:
        train.load_config({"sharding": sharding})
    assert named in str(e.value)


def test_a_mesh_of_another_world_size_stops_before_the_process_group(monkeypatch):
    train = _train_module()
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert train.load_config({"sharding": {"mode": "hsdp", "mesh": [1, 4]}})
    assert train.hsdp_shape(train.load_config(CONFIG), 4, 2) == (2, 2)
    with pytest.raises(train.ConfigError, match=r"a mesh of 6 ranks, but the launcher started 4"):
        train.load_config({"sharding": {"mode": "hsdp", "mesh": [3, 2]}})
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(train.ConfigError, match=r"do not divide into nodes of 3"):
        train.load_config(CONFIG)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    with pytest.raises(train.ConfigError, match=r"did not say how many ranks a node runs"):
        train.load_config(CONFIG)
    assert train.load_config({"sharding": {"mode": "hsdp", "mesh": [2, 2]}})


@pytest.mark.slow
def test_without_a_launcher_the_script_gives_the_multinode_command():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    p = subprocess.run([sys.executable, str(TRAIN), "--config", str(CONFIG)], env=env,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert p.returncode == 2
    assert "torchrun --nnodes 2 --nproc_per_node 2 --rdzv_backend c10d" in p.stderr, p.stderr
