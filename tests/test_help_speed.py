"""Every tool's --help answers at once (issue 45: under 3 s): the command lines are read before anything loads torch
or DeepSpeed, which a test of the import graph holds and a timed run shows."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.serial  # a wall-clock bound: the README runs these without a concurrent neighbour

HELPS = {
    "run_pretrain.py": [sys.executable, str(ROOT / "run_pretrain.py"), "--help"],
    "disagmoe-verify": [sys.executable, "-m", "disagmoe_ds.afpipe.verify", "--help"],
    "disagmoe-convert": [sys.executable, "-m", "disagmoe_ds.convert", "relayout", "--help"],
    "disagmoe-plan": [sys.executable, "-m", "disagmoe_ds.planner.cli", "study", "--help"],
}
_NO_TORCH = (
    "import sys; sys.argv = {argv!r}; {run}; assert 'torch' not in sys.modules and 'deepspeed' not in sys.modules"
)


@pytest.mark.parametrize("tool", HELPS)
def test_help_loads_neither_torch_nor_deepspeed_and_answers_in_3_s(tool) -> None:
    command = HELPS[tool]
    start = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0 and "usage:" in done.stdout, done.stderr
    assert time.monotonic() - start < 3.0
    # The same, with the modules checked after argparse's help exit (SystemExit caught).
    target = command[1] if command[1] != "-m" else command[2]
    run = (f"import runpy\ntry:\n    runpy.run_{'path' if target.endswith('.py') else 'module'}({target!r}, "
           f"run_name='__main__')\nexcept SystemExit:\n    pass")  # fmt: skip
    argv = [target, *command[(2 if command[1] != "-m" else 3) :]]
    check = _NO_TORCH.format(argv=argv, run=f"exec({run!r})")
    probe = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert probe.returncode == 0, probe.stderr[-2000:]
