"""The DeepSpeed the integration patches is the one it was written against.

``gefen_dist.integrations.deepspeed.patches`` wraps private ``DeepSpeedEngine`` methods and
calls private ZeRO wrapper methods. When DeepSpeed renames one or changes its parameters, these
tests fail naming it, instead of a training run failing (or silently not binding Gefen) later.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

from gefen_dist.integrations.deepspeed import patches  # noqa: E402
from gefen_dist.integrations.deepspeed.patches import Relied, UnsupportedDeepSpeed  # noqa: E402

pytestmark = pytest.mark.unit

ENGINE = "deepspeed.runtime.engine"


@pytest.mark.parametrize("symbol", patches.RELIED_ON, ids=lambda r: r.name)
def test_every_symbol_the_patches_rely_on_is_there_with_its_signature(symbol):
    assert patches.symbol_problems([symbol]) == []


def test_the_installed_deepspeed_is_a_supported_version():
    import deepspeed

    assert patches.version_problem(deepspeed.__version__) is None
    patches.check()


def test_a_missing_symbol_is_named():
    real = next(r for r in patches.RELIED_ON if r.name == "DeepSpeedEngine.load_checkpoint")
    fake = [
        real,
        Relied(ENGINE, "DeepSpeedEngine._configure_gefen_optimizer", "(self)", "a fake patch"),
        Relied("deepspeed.runtime.no_such_module", "Engine.step", None, "a fake module"),
    ]
    problems = patches.symbol_problems(fake)
    assert problems == [
        f"{ENGINE}.DeepSpeedEngine._configure_gefen_optimizer is missing (a fake patch)",
        "deepspeed.runtime.no_such_module.Engine.step is missing (a fake module)",
    ]


def test_a_changed_signature_is_named_with_both_signatures():
    fake = [Relied(ENGINE, "DeepSpeedEngine._configure_optimizer", "(self, client)", "patch 3")]
    (problem,) = patches.symbol_problems(fake)
    assert problem == (
        f"{ENGINE}.DeepSpeedEngine._configure_optimizer has signature "
        "(self, client_optimizer, model_parameters), expected (self, client) (patch 3)"
    )


def test_the_refusal_names_the_version_and_every_symbol():
    fake = [Relied(ENGINE, "DeepSpeedEngine.no_such_method", "(self)", "a fake patch")]
    with pytest.raises(UnsupportedDeepSpeed) as e:
        patches.check("0.20.1", fake)
    msg = str(e.value)
    assert msg.startswith("gefen_dist cannot patch deepspeed 0.20.1 (nothing was changed):")
    assert "deepspeed 0.20.1 is not a version the patches were written for" in msg
    assert ">=0.19,<0.20" in msg
    assert f"{ENGINE}.DeepSpeedEngine.no_such_method is missing (a fake patch)" in msg


@pytest.mark.parametrize(
    ("version", "ok"),
    [("0.19.0", True), ("0.19.8", True), ("0.19.9+cu128", True), ("0.18.9", False),
     ("0.20.0", False), ("0.20.0rc1", False), ("1.0.0", False)],
)  # fmt: skip
def test_the_version_range_is_the_extras_pin(version, ok):
    assert (patches.version_problem(version) is None) == ok


def test_the_supported_range_is_pyprojects_pin():
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    extra = re.search(r"^distributed = \[(.*)\]$", pyproject, re.MULTILINE)
    assert extra is not None, "pyproject.toml has no one-line 'distributed' extra"
    assert f'"deepspeed{patches.SUPPORTED}"' in extra.group(1).split(", ")


def test_install_is_idempotent_and_every_patched_method_is_listed():
    """After install() every engine method it replaced carries the mark and is in RELIED_ON (a
    patch added without its entry fails here); a second call replaces nothing."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    patches.install()
    marked = {n for n, v in vars(DeepSpeedEngine).items() if getattr(v, "_gefen", False)}
    assert marked == {
        "_configure_basic_optimizer",
        "_configure_optimizer",
        "load_checkpoint",
        "_configure_zero_optimizer",
        "_configure_bf16_optimizer",
        "_configure_fp16_optimizer",
    }
    listed = {r.name.split(".", 1)[1] for r in patches.RELIED_ON if r.module == ENGINE}
    assert marked <= listed
    before = {n: vars(DeepSpeedEngine)[n] for n in marked}
    patches.install()
    assert all(vars(DeepSpeedEngine)[n] is f for n, f in before.items())
    assert patches.installed()
    assert patches.symbol_problems() == []  # the wrappers keep the originals' signatures


def test_importing_the_package_patches_nothing_until_register():
    code = (
        "import gefen_dist.integrations.deepspeed as gd\n"
        "from deepspeed.runtime import config\n"
        "from deepspeed.runtime.engine import DeepSpeedEngine as E\n"
        "def state():\n"
        "    return (gd.installed(), hasattr(E.load_checkpoint, '_gefen'),\n"
        "            'gefen' in config.DEEPSPEED_OPTIMIZERS)\n"
        "print(state())\n"
        "import gefen_dist\n"
        "gefen_dist.register('deepspeed')\n"
        "print(state())\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    lines = [x for x in p.stdout.splitlines() if x.startswith("(")]
    assert lines == ["(False, False, False)", "(True, True, True)"]
