"""Ranks forked on a GPU machine can use CUDA: nothing our entry points import probes CUDA the way that poisons fork.

torch's default ``torch.cuda.is_available()`` initialises the CUDA driver (DeepSpeed's import calls it), and a child
forked after that fails on its first CUDA call ("Cannot re-initialize CUDA in forked subprocess"; seen on an H200
for run_pretrain.py without a launcher). Probing through NVML does not; the package sets it before anything imports
DeepSpeed. This machine has no GPU, so the test checks the setting every entry point runs under.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("module", ["disagmoe_ds.afpipe.verify", "disagmoe_ds.colocated.verify", "run_pretrain"])
def test_entry_points_probe_gpus_through_nvml(module: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_NVML_BASED_CUDA_CHECK"}
    code = (
        f"import importlib, os, sys; sys.path.insert(0, {str(ROOT)!r}); importlib.import_module({module!r}); "
        "import deepspeed; print(os.environ.get('PYTORCH_NVML_BASED_CUDA_CHECK'))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip().splitlines()[-1] == "1"
