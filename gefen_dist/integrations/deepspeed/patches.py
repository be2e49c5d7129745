"""Every change gefen_dist makes to DeepSpeed, in this one file, made by ``install()``.

Nothing here runs at import. ``install()`` is called by ``gefen_dist.register()`` (and
``register("deepspeed")``), by ``import gefen_dist`` when deepspeed is already imported
(``register_loaded``), and by Gefen's constructor when deepspeed is imported
(``integrations.register``); it is idempotent. It first checks that the installed DeepSpeed is
one this package supports (``SUPPORTED``, the ``distributed`` extra's pin) and that every
DeepSpeed symbol listed in ``RELIED_ON`` is there with the signature the wrappers below were
written against; otherwise it changes nothing and raises ``UnsupportedDeepSpeed`` naming the
symbol and the version. ``tests/test_deepspeed_patches.py`` runs the same check on the installed
DeepSpeed.

The changes, each marked with the attribute ``_gefen`` so that a second install skips it:

1. ``deepspeed.runtime.zero.utils.ZERO_SUPPORTED_OPTIMIZERS`` gains ``Gefen``: ZeRO then takes
   Gefen without ``zero_allow_untested_optimizer``.
2. ``deepspeed.runtime.config.DEEPSPEED_OPTIMIZERS`` gains ``"gefen"`` and
   ``DeepSpeedEngine._configure_basic_optimizer`` builds Gefen for that type: a JSON config can
   name Gefen (``config_type``). DeepSpeed otherwise resolves an unknown type with
   ``getattr(torch.optim, name)``; being in its list makes its config lower-case the type and
   its sanity check accept it.
3. ``DeepSpeedEngine._configure_optimizer``: under ZeRO-Offload DeepSpeed refuses a client
   optimizer unless ``zero_force_ds_cpu_optimizer`` is false, lest a torch optimizer step the
   host partitions slowly; Gefen steps them with its C++ host kernel, so for a Gefen instance
   passed as ``optimizer=`` the check is lifted for that call (a Gefen built by a callable is
   still checked: set the key false, or name Gefen in the config). After it, a pipeline weight
   tied across stages is refused (``support.refuse_tied_stages``): without ZeRO no wrapper is
   built, so patch 5 never sees the engine.
4. ``DeepSpeedEngine.load_checkpoint``: a checkpoint saved at another data-parallel degree or
   ZeRO stage is re-cut into this engine's partitions (``recut``); any other load is
   DeepSpeed's own.
5. ``DeepSpeedEngine._configure_zero_optimizer``, ``_configure_bf16_optimizer`` and
   ``_configure_fp16_optimizer``: the ZeRO wrapper they return around a Gefen is bound to it
   (``binding.bind``) there, as soon as it exists, before any step or checkpoint load. Not
   after ``_configure_optimizer`` returns: a Gefen built by a callable
   (``deepspeed.initialize(optimizer=lambda ps: Gefen(ps))``) with gefen_dist imported first
   installs these patches from inside that very call, too late for patch 3's own wrapper; the
   builders are looked up after. Without ZeRO (fp32) there is no wrapper and nothing to bind.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import deepspeed
from deepspeed.runtime import config as ds_config
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.zero import utils as zero_utils
from packaging.specifiers import SpecifierSet

from ...optimizer import Gefen
from .binding import bind
from .config_type import OPTIMIZER_TYPE, from_config
from .recut import recut_for
from .support import refuse_tied_stages

__all__ = [
    "RELIED_ON",
    "SUPPORTED",
    "Relied",
    "UnsupportedDeepSpeed",
    "check",
    "install",
    "installed",
    "symbol_problems",
    "version_problem",
]

SUPPORTED = ">=0.19,<0.20"
"""The DeepSpeed versions the patches were written against (pyproject's ``distributed`` extra)."""

_MARK = "_gefen"
_BUILDERS = ("_configure_zero_optimizer", "_configure_bf16_optimizer", "_configure_fp16_optimizer")


class UnsupportedDeepSpeed(RuntimeError):
    """The installed DeepSpeed is not one the patches fit; nothing was patched."""


@dataclass(frozen=True)
class Relied:
    """A DeepSpeed symbol the integration relies on, and the signature it was written against
    (``str(inspect.signature(...))``; None where only its presence is checked: a list, or a
    method whose decorator hides its signature)."""

    module: str
    name: str
    """Attribute path inside ``module``: ``"DeepSpeedEngine.load_checkpoint"``."""
    signature: str | None
    why: str

    @property
    def path(self) -> str:
        return f"{self.module}.{self.name}"


_ENGINE = "deepspeed.runtime.engine"
_STAGE12 = "deepspeed.runtime.zero.stage_1_and_2"
_STAGE3 = "deepspeed.runtime.zero.stage3"
_LOAD = (
    "(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True, "
    "load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None)"
)

# fmt: off
RELIED_ON: tuple[Relied, ...] = (
    Relied("deepspeed.runtime.zero.utils", "ZERO_SUPPORTED_OPTIMIZERS", None, "patch 1 appends"),
    Relied("deepspeed.runtime.config", "DEEPSPEED_OPTIMIZERS", None, "patch 2 appends"),
    Relied(_ENGINE, "DeepSpeedEngine._configure_basic_optimizer", "(self, model_parameters)",
           "patch 2 wraps"),
    Relied(_ENGINE, "DeepSpeedEngine.optimizer_name", "(self)", "patch 2 reads the type"),
    Relied(_ENGINE, "DeepSpeedEngine.optimizer_params", "(self)", "patch 2 reads the params"),
    Relied(_ENGINE, "DeepSpeedEngine._configure_optimizer",
           "(self, client_optimizer, model_parameters)",
           "patch 3 wraps, and finds client_optimizer by name or as the first argument"),
    Relied(_ENGINE, "DeepSpeedEngine.zero_use_cpu_optimizer", "(self)", "patch 3 asks"),
    Relied(_ENGINE, "DeepSpeedEngine.zero_force_ds_cpu_optimizer", "(self)",
           "patch 3 lifts the config value this reads"),
    Relied(_ENGINE, "DeepSpeedEngine.load_checkpoint", _LOAD,
           "patch 4 wraps, passing every argument on by name"),
    Relied(_ENGINE, "DeepSpeedEngine.load_universal_checkpoint", "(self)", "patch 4 asks"),
    Relied(_ENGINE, "DeepSpeedEngine._optimizer_has_ckpt_event_prologue", "(self)",
           "patch 4 and load_optimizer_state call it as DeepSpeed's own load does"),
    Relied(_ENGINE, "DeepSpeedEngine._optimizer_has_ckpt_event_epilogue", "(self)",
           "patch 4 and load_optimizer_state call it as DeepSpeed's own load does"),
    Relied(_ENGINE, "DeepSpeedEngine._configure_zero_optimizer", "(self, optimizer)",
           "patch 5 wraps"),
    Relied(_ENGINE, "DeepSpeedEngine._configure_bf16_optimizer", "(self, optimizer)",
           "patch 5 wraps"),
    Relied(_ENGINE, "DeepSpeedEngine._configure_fp16_optimizer",
           "(self, optimizer, low_precision_dtype)", "patch 5 wraps"),
    Relied(_STAGE12, "DeepSpeedZeroOptimizer.update_lp_params", "(self)",
           "a re-cut republishes the ZeRO-1/2 low-precision copies"),
    Relied(_STAGE3, "DeepSpeedZeroOptimizer_Stage3._get_sub_group_process_group",
           "(self, sub_group_id)", "layouts reads each sub-group's process group"),
    Relied(_STAGE3, "DeepSpeedZeroOptimizer_Stage3._reassign_or_swap_out_partitioned_parameters",
           None, "the held first step and a re-cut republish ZeRO-3 partitions"),
    Relied(_STAGE3, "DeepSpeedZeroOptimizer_Stage3._set_fp32_optimizer_param_groups", "(self)",
           "a re-cut puts every sub-group into Gefen's param groups to load its state"),
    Relied(_STAGE3, "DeepSpeedZeroOptimizer_Stage3._clear_fp32_optimizer_param_groups", "(self)",
           "and empties them again"),
)
# fmt: on
"""What the patches and the partition readers call or replace, and why."""


def version_problem(version: str) -> str | None:
    """Why ``version`` of DeepSpeed is refused, or None where it is supported."""
    if SpecifierSet(SUPPORTED).contains(version, prereleases=True):
        return None
    return (
        f"deepspeed {version} is not a version the patches were written for: gefen_dist "
        f"supports deepspeed{SUPPORTED} (its 'distributed' extra)"
    )


def _resolve(r: Relied) -> Any:
    obj: Any = importlib.import_module(r.module)
    for part in r.name.split("."):
        obj = getattr(obj, part)
    return obj


def symbol_problems(symbols: Iterable[Relied] = RELIED_ON) -> list[str]:
    """One line per symbol that is missing or has another signature, naming it."""
    out = []
    for r in symbols:
        try:
            obj = _resolve(r)
        except (ImportError, AttributeError):
            out.append(f"{r.path} is missing ({r.why})")
            continue
        if r.signature is None:
            continue
        try:
            found = str(inspect.signature(obj))
        except (TypeError, ValueError):
            out.append(f"{r.path} is not a function with a signature ({r.why})")
            continue
        if found != r.signature:
            out.append(f"{r.path} has signature {found}, expected {r.signature} ({r.why})")
    return out


def check(version: str | None = None, symbols: Iterable[Relied] = RELIED_ON) -> None:
    """Raise ``UnsupportedDeepSpeed`` naming the version and every symbol that does not fit;
    ``version`` defaults to the installed DeepSpeed's."""
    version = deepspeed.__version__ if version is None else version
    problems = [p for p in [version_problem(version)] if p] + symbol_problems(symbols)
    if problems:
        raise UnsupportedDeepSpeed(
            f"gefen_dist cannot patch deepspeed {version} (nothing was changed):\n  "
            + "\n  ".join(problems)
        )


_installed = False


def installed() -> bool:
    """Whether ``install()`` has patched DeepSpeed in this process."""
    return _installed


def install() -> None:
    """Check the installed DeepSpeed, then make the changes the module docstring lists. A second
    call does nothing."""
    global _installed
    if _installed:
        return
    check()
    if Gefen not in zero_utils.ZERO_SUPPORTED_OPTIMIZERS:
        zero_utils.ZERO_SUPPORTED_OPTIMIZERS.append(Gefen)
    if OPTIMIZER_TYPE not in ds_config.DEEPSPEED_OPTIMIZERS:
        ds_config.DEEPSPEED_OPTIMIZERS.append(OPTIMIZER_TYPE)
    _wrap("_configure_basic_optimizer", _build_from_config)
    _wrap("_configure_optimizer", _lift_offload_check)
    _wrap("load_checkpoint", _recut_on_load)
    for name in _BUILDERS:
        _wrap(name, _bind_on_return)
    _installed = True


def _wrap(name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace ``DeepSpeedEngine.<name>`` by ``make(original)``, once."""
    original = getattr(DeepSpeedEngine, name)
    if getattr(original, _MARK, False):
        return
    patched = functools.wraps(original)(make(original))
    setattr(patched, _MARK, True)
    setattr(DeepSpeedEngine, name, patched)


# -- patch 2 ----------------------------------------------------------------------------------
def _build_from_config(original: Callable[..., Any]) -> Callable[..., Any]:
    def _configure_basic_optimizer(self: DeepSpeedEngine, model_parameters: Any) -> Any:
        if str(self.optimizer_name()).lower() == OPTIMIZER_TYPE:
            return from_config(model_parameters, self.optimizer_params())
        return original(self, model_parameters)

    return _configure_basic_optimizer


# -- patch 3 ----------------------------------------------------------------------------------
def _lift_offload_check(original: Callable[..., Any]) -> Callable[..., Any]:
    def _configure_optimizer(self: DeepSpeedEngine, *args: Any, **kwargs: Any) -> Any:
        client = args[0] if args else kwargs.get("client_optimizer")
        config = self._config
        forced = None
        if isinstance(client, Gefen) and self.zero_use_cpu_optimizer():
            forced = config.zero_force_ds_cpu_optimizer
            config.zero_force_ds_cpu_optimizer = False
        try:
            out = original(self, *args, **kwargs)
        finally:
            if forced is not None:
                config.zero_force_ds_cpu_optimizer = forced
        if isinstance(self.optimizer, Gefen):
            refuse_tied_stages(self)
        return out

    return _configure_optimizer


# -- patch 4 ----------------------------------------------------------------------------------
def _recut_on_load(original: Callable[..., Any]) -> Callable[..., Any]:
    def load_checkpoint(
        self: DeepSpeedEngine,
        load_dir: str,
        tag: Any = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Callable | None = None,
    ) -> Any:
        recut = None
        whole = load_optimizer_states and not load_module_only and custom_load_fn is None
        if whole and not self.load_universal_checkpoint():
            recut = recut_for(self, load_dir, tag)
        if recut is None:
            return original(
                self,
                load_dir,
                tag,
                load_module_strict=load_module_strict,
                load_optimizer_states=load_optimizer_states,
                load_lr_scheduler_states=load_lr_scheduler_states,
                load_module_only=load_module_only,
                custom_load_fn=custom_load_fn,
            )
        if self._optimizer_has_ckpt_event_prologue():
            self.optimizer.checkpoint_event_prologue()
        out = recut.apply(load_lr_scheduler_states)
        if self._optimizer_has_ckpt_event_epilogue():
            self.optimizer.checkpoint_event_epilogue()
        return out

    return load_checkpoint


# -- patch 5 ----------------------------------------------------------------------------------
def _bind_on_return(original: Callable[..., Any]) -> Callable[..., Any]:
    def build(self: DeepSpeedEngine, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        wrapper = original(self, optimizer, *args, **kwargs)
        if isinstance(optimizer, Gefen):
            bind(self, wrapper)
        return wrapper

    return build
