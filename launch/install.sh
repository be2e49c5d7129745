#!/usr/bin/env bash
# Installs gefen_dist, what its tests need (pytest, ruff, triton for the GPU kernels under its
# interpreter, DeepSpeed, Accelerate, transformers), matplotlib (the main job's plots) and the
# peers it is compared with (bitsandbytes, torchao, Adam-mini, pytorch-optimizer's SM3,
# scikit-learn's digits), and torchtitan's components. Where no torch is present it installs the CPU build first
# (torch==2.13.0 lies on this kind of machine's disk); a bare `pip install torch` would pull a
# multi-GB CUDA build, and so would a dependency asking for torch with none installed.
# Beside the installed triton, triton 3.6.0 (the H200's) goes into .triton-3.6.0 (git-ignored):
# tests/test_gpu_check.py runs the kernels' checks under its interpreter too.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install -q torch==2.13.0
fi
"$PY" -m pip install -q -e ".[test,distributed,demo,bench]"
# torchtitan for tests/test_torchtitan.py, without its declared dependencies: its release pulls
# datasets, wandb and tensorboard for its trainer, none of which its optimizer and checkpoint
# components (what gefen_dist.integrations.torchtitan uses) import (docs/torchtitan.md's list)
"$PY" -m pip install -q --no-deps torchtitan==0.3.0 tyro docstring-parser typeguard \
    spmd_types==0.2.3 torch_checkpointing torchdata
if [ "$(uname -s)" = Linux ] && [ ! -f .triton-3.6.0/triton/__init__.py ]; then
    "$PY" -m pip install -q --no-deps --target .triton-3.6.0 triton==3.6.0
fi
