"""FSDP1 with no configure call: Gefen finds the FSDP units itself, through the calls the
Hugging Face Trainer makes with Accelerate's FSDP1 plugin (``tests/dist/fsdp1_auto.py``; the
plugin asks for a GPU on CPU ranks, so its calls are made one by one with its own objects and
checkpoint functions), on 2 gloo ranks.

- With original parameters (``use_orig_params=True``) the user's ``Gefen(model.parameters())``
  is built before the model is wrapped, and first meets FSDP's pieces at its first step (or
  load): it must take the same steps, bit for bit, as the one whose ``configure`` was called.
- Checkpoints saved with the plugin's ``save_fsdp_optimizer`` (SHARDED_STATE_DICT through DCP,
  FULL_STATE_DICT) load with ``load_fsdp_optimizer`` into a Gefen that has not stepped yet, and
  the replayed steps' losses equal the uninterrupted run's exactly.
"""

from __future__ import annotations

import pytest
from dist_util import read_results, torchrun

pytestmark = pytest.mark.dist

SETUPS = ("orig", "flat")
TYPES = ("SHARDED_STATE_DICT", "FULL_STATE_DICT")
SAVE_AT = 3


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    d = tmp_path_factory.mktemp("fsdp1_auto")
    torchrun("fsdp1_auto.py", str(d / "out"), str(d / "ck"))
    return read_results(d / "out", ranks=2)


@pytest.mark.parametrize("setup", SETUPS)
def test_gefen_configures_itself_and_steps_as_a_configured_one(ranks, setup):
    for r in ranks:
        auto, configured = r[f"{setup}/auto"], r[f"{setup}/configured"]
        assert auto["found"] and auto["model"]  # found the FSDP root the run trains
        assert auto["losses"] == configured["losses"]


def test_a_configure_call_is_still_taken_where_the_user_makes_it(ranks):
    for r in ranks:
        assert not r["orig/configured"]["found"]


@pytest.mark.parametrize("setup", SETUPS)
@pytest.mark.parametrize("kind", TYPES)
def test_the_plugins_checkpoints_resume_bit_for_bit(ranks, setup, kind):
    for r in ranks:
        assert r[f"{setup}/resume/{kind}"] == r[f"{setup}/auto"]["losses"][SAVE_AT:]


@pytest.mark.parametrize("setup", SETUPS)
def test_a_later_configure_changes_nothing_and_another_model_is_refused(ranks, setup):
    for r in ranks:
        misuse = r[f"{setup}/misuse"]
        assert misuse["again_same"] == "unchanged"
        assert "transformer.wte.weight" in misuse["again_other"]
        assert "not part of this model's FSDP units" in misuse["again_other"]
