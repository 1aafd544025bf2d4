"""The package quiets DeepSpeed's "Setting accelerator to CPU" warning on machines without a GPU, at the first
import of deepspeed after ``disagmoe_ds`` (not at package import, which would load torch into the planner)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=base | env, check=False
    )


def test_deepspeed_imported_through_the_package_names_its_accelerator():
    pytest.importorskip("deepspeed")
    code = (
        "import os, sys, disagmoe_ds\n"
        "assert 'torch' not in sys.modules and 'DS_ACCELERATOR' not in os.environ\n"
        "import disagmoe_ds.launch.env\n"
        "import torch\n"
        "print(os.environ.get('DS_ACCELERATOR', '') if not torch.cuda.is_available() else 'cpu')"
    )
    run = _run(code)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "cpu"
    assert "Setting accelerator to CPU" not in run.stdout + run.stderr
