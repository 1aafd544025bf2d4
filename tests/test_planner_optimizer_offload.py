"""The expert side's optimizer in host memory (issue 44's "optimizer state where memory is free", as DeepSpeed's
ZeRO-Offload of one side): its GPU memory, its host memory, its step, the search trying it, and the written ds_config
running it (pure Python)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from disagmoe_ds.layout import Layout
from disagmoe_ds.planner import Efficiency, Rates
from disagmoe_ds.planner.cli import main
from disagmoe_ds.planner.cluster import preset, save_cluster
from disagmoe_ds.planner.memory import ffn_rank_memory
from disagmoe_ds.planner.optimizer_step import af_optimizer_s, host_optimizer_step_s
from disagmoe_ds.planner.training_state import ffn_host_state_bytes, ffn_rank_params, ffn_state_bytes
from disagmoe_ds.planner.variants import memory_variants, savings, variants_used
from disagmoe_ds.planner.workload import Workload
from tests.conftest import ROOT
from tests.test_planner import mid_model

OFFLOAD = frozenset({"optimizer_offload", "zero2", "zero3"})


def test_the_experts_optimizer_state_leaves_the_gpu_for_the_host():
    spec, layout = mid_model(), Layout(4, 4, 8, 16, depth=1, expert_data_parallel=2)
    on_gpu, on_host = Workload(4096, 1), Workload(4096, 1, ffn_optimizer_on_host=True)
    trained = ffn_rank_params(spec, layout, 0).trained
    # bf16 at ZeRO-1 over 2 replicas: 2 + 2 + 12 / 2 bytes a parameter on the GPU, 2 + 2 with the optimizer away
    assert ffn_state_bytes(spec, layout, on_gpu, 0) == pytest.approx(trained * 10)
    assert ffn_state_bytes(spec, layout, on_host, 0) == pytest.approx(trained * 4)
    assert ffn_host_state_bytes(spec, layout, on_host, 0) == pytest.approx(trained / 2 * 16)  # + an fp32 gradient
    assert ffn_host_state_bytes(spec, layout, on_gpu, 0) == 0
    assert ffn_rank_memory(spec, layout, on_gpu).state - ffn_rank_memory(spec, layout, on_host).state == pytest.approx(
        trained * 6
    )


def test_its_step_is_the_copies_and_the_hosts_pass_over_the_state():
    rates = Rates.from_cluster(preset("h800", nodes=1), Efficiency())
    # 1e9 parameters: 6 B over 0.8 x 63 GB/s of PCIe, 36 B over half of the node's 614 GB/s shared by 8 GPUs
    assert host_optimizer_step_s(1e9, rates=rates) == pytest.approx(6e9 / 50.4e9 + 36e9 / (614.4e9 * 0.5 / 8))
    spec, layout = mid_model(), Layout(4, 4, 8, 16, depth=1)
    a, f = af_optimizer_s(spec, layout, Workload(4096, 1), rates)
    a_host, f_host = af_optimizer_s(spec, layout, Workload(4096, 1, ffn_optimizer_on_host=True), rates)
    assert a_host == a and f_host == pytest.approx(host_optimizer_step_s(ffn_rank_params(spec, layout, 0).trained,
                                                                         rates=rates))  # fmt: skip
    assert f_host > f  # the host's memory is slower than the GPU's


def test_the_search_tries_it_at_zero_1_and_2_only_where_allowed():
    base = Workload(4096, 1)
    tried = memory_variants(base, ("none",), OFFLOAD)
    on_host = [w for w in tried if w.ffn_optimizer_on_host]
    assert {w.zero_of("ffn") for w in on_host} == {1, 2} and {w.zero_of("ffn") for w in tried} == {1, 2, 3}
    assert not any(w.ffn_optimizer_on_host for w in memory_variants(base, ("none",), OFFLOAD - {"optimizer_offload"}))
    assert savings(on_host[0]) == {"F optimizer on host"} | savings(Workload(4096, 1, ffn_zero_stage=on_host[0].zero_of(
        "ffn")))  # fmt: skip
    assert variants_used(on_host[0]) >= {"optimizer_offload"}
    assert "F optimizer on host" in on_host[0].variant


def _plan(capsys, *flags: str) -> str:
    assert main(["--model", str(ROOT / "hf_models" / "Qwen3-30B-A3B"), "--seq-len", "4096", *flags]) == 0
    return capsys.readouterr().out


def test_a_plan_whose_experts_fit_only_so_takes_it_and_writes_it(tmp_path, capsys):
    """Qwen3-30B-A3B's AF-Pipe plan on one node of H800s: its experts' training state (29B parameters) fits the F
    ranks only with their optimizer in host memory; the written file sets it for the expert side alone (and
    tests/test_planner_ds_config.py runs that file through run_pretrain.py's preflight). A node whose host memory
    cannot hold the state does not get it."""
    ds = tmp_path / "ds.json"
    out = _plan(capsys, "--nodes", "1", "--write-mode", "disaggregated", "--write-ds-config", str(ds))
    assert "F optimizer on host" in out
    assert json.loads(ds.read_text())["disagmoe"]["offload_optimizer"] == {"ffn": True}
    small_host = tmp_path / "small-host.json"
    save_cluster(replace(preset("h800", nodes=1), host_bytes=64e9), small_host)
    assert "F optimizer on host" not in _plan(capsys, "--cluster", str(small_host), "--nodes", "1")
