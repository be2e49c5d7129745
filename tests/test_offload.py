"""ZeRO-Offload with Gefen: the shipped configs (configs/ds_zero{2,3}_offload_cpu.json) on 2 CPU
ranks under the deepspeed launcher (tests/dist/ds_offload.py), checkpointed and resumed.

ZeRO-Offload keeps the fp32 master partitions and the optimizer state on the host and steps
them there; Gefen steps them with its C++ kernel. A resume at the same layout must be bit for
bit: the same losses, weights and Gefen state as the run that never stopped. One launch runs
every case: DeepSpeed's start-up is most of the time.
"""

import pytest
from dist_util import deepspeed_run, read_results

pytestmark = pytest.mark.dist

STAGES = ("zero2", "zero3")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("offload")
    deepspeed_run("ds_offload.py", str(out), str(out / "ckpt"))
    got = read_results(out, ranks=2)
    assert [r["rank"] for r in got] == [0, 1] and got[0]["world"] == 2
    return got


@pytest.mark.parametrize("stage", STAGES)
def test_the_shipped_offload_config_steps_gefen_on_host_partitions(ranks, stage):
    for r in ranks:
        o = r[stage]
        assert o["wrapper"] == f"ZeRO-{stage[-1]}"
        assert o["host"] == ["cpu"]
        assert o["backend"] == "native-cpu"
        assert 0 < o["state_bytes"] < o["adamw_bytes"] / 4
        assert o["losses"][-2] < o["losses"][0] and o["losses"][-1] < o["losses"][1]


@pytest.mark.parametrize("stage", STAGES)
def test_an_offloaded_run_resumes_bit_for_bit(ranks, stage):
    for r in ranks:
        o = r[stage]
        assert o["loaded"]
        assert o["resumed"] == o["losses"][3:]
        assert o["weights_exact"] and o["state_exact"]


def test_a_client_gefen_needs_no_zero_force_ds_cpu_optimizer_key(ranks):
    """DeepSpeed refuses a client optimizer under offload unless zero_force_ds_cpu_optimizer is
    false; a Gefen instance is let through (gefen_dist.integrations.deepspeed)."""
    for r in ranks:
        c = r["client"]
        assert c["wrapper"] == "ZeRO-2" and len(c["losses"]) == 2
