"""bench/link_probe.py measures the link under NCCL's current settings and records them (here: two gloo ranks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import ROOT


def test_link_probe_measures_and_records_the_regime(tmp_path):
    out = tmp_path / "link.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",  # a free rendezvous port, not 29500
        "--nproc_per_node",
        "2",
        str(ROOT / "bench" / "link_probe.py"),
    ]
    env = {**os.environ, "NCCL_P2P_DISABLE": "1"}  # what gpu_multi.sh's iblike regime sets
    run = subprocess.run(
        [*cmd, "--mib", "1", "--iters", "2", "--json", str(out)], env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["world_size"] == 2 and result["seconds"] > 0
    assert result["gb_per_s"] == (2**20 / 2) / result["seconds"] / 1e9  # half of the MiB goes to the other rank
    assert result["nccl_env"]["NCCL_P2P_DISABLE"] == "1"
    assert f"link: {result['gb_per_s']:.1f} GB/s per GPU one way" in run.stdout
