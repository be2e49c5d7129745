"""What the tests need beyond torch, and a failure that says how to install it.

CI installs every extra (``launch/install.sh``: ``.[test,distributed,demo,bench]``) and a C++
compiler is part of the machine the C++ kernel is built on, so a missing one is a broken install:
the tests that need it fail, naming the install, instead of skipping into a green run. The one
skip left is Triton off Linux, where the ``test`` extra does not install it (pyproject.toml).
"""

from __future__ import annotations

import importlib
import os
import platform
from types import ModuleType

import pytest
import torch

EXTRAS = {
    "deepspeed": "distributed",
    "accelerate": "distributed",
    "transformers": "distributed",
    "triton": "test",
    "matplotlib": "demo",
    "torchao": "bench",
    "bitsandbytes": "bench",
    "adam_mini": "bench",
    "pytorch_optimizer": "bench",
    "sklearn": "bench",
}
"""The import name of each package an extra installs, and the extra (pyproject.toml)."""


def extra(module: str) -> ModuleType:
    """``module`` imported, or the test (or, at a module's top, its collection) fails naming the
    extra to install. Triton off Linux skips: the ``test`` extra installs it on Linux only."""
    top = module.split(".")[0]
    if top not in EXTRAS:
        raise ValueError(f"module: {module!r} is not from an extra; known: {sorted(EXTRAS)}")
    name = EXTRAS[top]
    if top == "triton" and platform.system() != "Linux":
        pytest.skip(
            f"the test extra installs triton on Linux only, not on {platform.system()}",
            allow_module_level=True,
        )
    try:
        return importlib.import_module(module)
    except ImportError as e:
        why = f"{type(e).__name__}: {e}"
    pytest.fail(
        f"{module} does not import ({why}): install the {name} extra: pip install -e '.[{name}]'",
        pytrace=False,
    )


def cpp_kernel() -> None:
    """The C++ CPU kernel builds here, or the test fails with the compiler's complaint."""
    from gefen_dist.backends import native_cpu

    if not native_cpu.available():
        pytest.fail(
            f"the C++ CPU kernel does not build here ({native_cpu.build_error()}): the tests "
            "need a C++ compiler (g++, c++ or clang++ on PATH, or the one CXX names)",
            pytrace=False,
        )


def triton_interpreter() -> None:
    """Triton imports and runs the kernels on CPU tensors under its interpreter, or the test
    fails saying why. It skips only where the user set TRITON_INTERPRET to something other than 1
    (tests/conftest.py sets 1 where it is unset, before anything imports triton): triton then
    compiles the kernels for a GPU, which takes none of the CPU tensors these tests step; the
    GPU's own check is launch/gpu_check.py."""
    language = extra("triton.language")
    from gefen_dist.backends import triton_backend

    interpreted = type(language.zeros).__name__ == "InterpretedFunction"
    if not (interpreted and triton_backend.interpreting()):
        pytest.skip(
            "triton runs compiled here (TRITON_INTERPRET is "
            f"{os.environ.get('TRITON_INTERPRET')!r}, or was when triton was imported, not '1'): "
            "these tests step CPU tensors under its interpreter",
            allow_module_level=True,
        )
    cpu = torch.device("cpu")
    if not triton_backend.available(cpu):
        pytest.fail(
            f"Triton's interpreter cannot run the kernels: {triton_backend.build_error(cpu)}",
            pytrace=False,
        )
