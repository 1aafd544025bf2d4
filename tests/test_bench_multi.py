"""The multi-GPU benchmarks run end to end on CPU ranks (gloo) and report what they claim to measure.

bench_exchange: both methods move exactly the payload bytes of the runtime's own M2N/N2M messages (recomputed here
from the same random router); bench_e2e: the three methods train the same tokens per step and report throughput.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from disagmoe_ds.layout import Layout

ROOT = Path(__file__).resolve().parent.parent


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve their module's annotations through sys.modules
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
def test_bench_exchange_moves_the_runtime_bytes(tmp_path, fp8):
    bench = _load("bench_exchange")
    out = tmp_path / "exchange.json"
    M, N, T, H, K, E = 2, 2, 48, 32, 2, 8
    argv = ["--device", "cpu", "--attention-gpus", str(M), "--ffn-gpus", str(N), "--tokens", str(T)]
    argv += ["--hidden", str(H), "--top-k", str(K), "--experts", str(E), "--warmup", "1", "--iters", "3"]
    assert bench.main([*argv, "--json", str(out), *(["--fp8"] if fp8 else [])]) == 0
    report = json.loads(out.read_text())
    rows = {(r["direction"], r["method"], r["in_flight"]): r for r in report["rows"]}
    assert set(rows) == {(d, m, k) for d in ("m2n", "n2m") for m in ("exchange", "all_to_all") for k in (1, 4)}

    # Expected payload bytes from the same routing: rows R_e per (lane, ep rank); m2n carries x (fp32 H), local
    # ids (int64 K) and weights (fp32 K) per row, n2m the expert outputs (fp32 H) per row; in FP8, x is e4m3 (1 byte
    # each) with a float32 scale per row.
    args = bench.BenchArgs(M, N, T, H, K, E, torch.float32, 1, 3, 0)
    layout = Layout(attention_gpus=M, ffn_gpus=N, num_layers=1, num_experts=E)
    routed_rows = sum(
        sum(bench.random_messages(args, layout, lane, torch.device("cpu"))[1].counts) for lane in range(M)
    )
    x_bytes = H + 4 if fp8 else H * 4
    expected = {"m2n": routed_rows * (x_bytes + K * 8 + K * 4), "n2m": routed_rows * H * 4}
    for (direction, _, in_flight), row in rows.items():
        assert row["bytes"] == expected[direction] * in_flight
        assert row["ms"] > 0 and math.isclose(row["gbps"], row["bytes"] / row["ms"] / 1e6)
    for direction in ("m2n", "n2m"):
        assert rows[(direction, "all_to_all", 4)]["ratio"] == 1.0
        assert rows[(direction, "exchange", 4)]["ratio"] > 0


def test_bench_e2e_runs_every_ep_size_side_by_side():
    bench = _load("bench_e2e")
    a = bench.parse_args(["--device", "cpu", "--world-size", "2", "--ep-size", "2", "1"])
    runs = [(method, run.ep_size) for method, run in bench.runs(a)]
    assert runs == [
        ("afpipe", 2),
        ("colocated", 2),
        ("colocated", 1),
        ("pipeline", 1),  # 2 stages of 1 rank: EP inside a stage
        ("autoep", 2),
        ("autoep", 1),
        ("deepspeed-moe", 2),
        ("deepspeed-moe", 1),
    ]


def test_bench_e2e_runs_deepspeed_autoep_beside_the_colocated_mode(tmp_path):
    """DeepSpeed's own AutoEP (the HF model, its MoE blocks swapped inside ``deepspeed.initialize``) trains the same
    tokens per step beside our co-located mode; qwen2_moe has no AutoEP preset, so it is left out of its default."""
    bench = _load("bench_e2e")
    out = tmp_path / "e2e.json"
    argv = ["--device", "cpu", "--model", str(ROOT / "hf_models" / "tiny-qwen3-moe"), "--world-size", "2"]
    argv += [
        "--seq-len",
        "8",
        "--global-batch",
        "4",
        "--warmup",
        "1",
        "--steps",
        "1",
        "--methods",
        "colocated",
        "autoep",
    ]
    assert bench.main([*argv, "--json", str(out)]) == 0
    rows = {r["method"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"colocated-ep2", "autoep-ep2"} and "3 MoE layers" in rows["autoep-ep2"]["layout"]
    assert rows["autoep-ep2"]["tokens_per_step"] == rows["colocated-ep2"]["tokens_per_step"] == 32
    assert abs(rows["autoep-ep2"]["loss"] - math.log(128)) < 0.5  # random init on a vocabulary of 128
    qwen2 = bench.parse_args(
        ["--device", "cpu", "--world-size", "2", "--model", str(ROOT / "hf_models" / "tiny-qwen2-moe")]
    )
    assert "autoep" not in qwen2.methods


def test_bench_e2e_methods_train_the_same_tokens(tmp_path):
    bench = _load("bench_e2e")
    out = tmp_path / "e2e.json"
    argv = ["--device", "cpu", "--model", str(ROOT / "hf_models" / "tiny-qwen2-moe"), "--world-size", "2"]
    argv += ["--seq-len", "8", "--global-batch", "4", "--warmup", "1", "--steps", "1", "--zero", "1"]
    assert bench.main([*argv, "--json", str(out), "--timeline", str(tmp_path / "trace.json")]) == 0
    report = json.loads(out.read_text())
    rows = {r["method"]: r for r in report["rows"]}
    assert set(rows) == {"afpipe", "colocated-ep2", "pipeline-ep1", "deepspeed-moe-ep2"}
    # The last step's trace of every method, and each rank's share of it per category.
    for method, row in rows.items():
        assert json.loads((tmp_path / f"trace-{method}.json").read_text())["traceEvents"]
        assert len(row["host_time_share"]) == 2 and all(0 < s["compute"] <= 1 for s in row["host_time_share"].values())
    shares = rows["afpipe"]["host_time_share"].values()
    assert all("wait" in share for share in shares)  # AF-Pipe ranks wait for each other's messages
    # AF-Pipe has 1 attention lane (so has the pipeline, of 2 stages), the others 2 data-parallel ranks: twice the
    # micro-batches for the same tokens.
    assert rows["afpipe"]["micro_batches"] == rows["pipeline-ep1"]["micro_batches"] == 4
    assert rows["colocated-ep2"]["micro_batches"] == 2
    # 1 A + 1 F with a known micro-batch size: no headers, one communicator call per message, no wait for sizes.
    exchange = rows["afpipe"]["exchange"]
    assert exchange["messages"] == 2 * 4 * 2 * 3 and exchange["size_waits"] == 0  # 2 kinds x K x 2 ends x 3 MoE
    assert exchange["calls_per_send"] <= 1 and exchange["calls_per_receive"] <= 1
    assert "exchange" not in rows["colocated-ep2"]
    for row in rows.values():
        assert row["tokens_per_step"] == 4 * 8
        assert row["tokens_per_s"] > 0 and row["step_ms"] > 0
        assert math.isclose(row["tokens_per_s"], row["tokens_per_step"] / row["step_ms"] * 1e3)
        flops = bench.ModelSpec.from_config(json.loads((ROOT / "hf_models/tiny-qwen2-moe/config.json").read_text()))
        mfu = row["tokens_per_s"] * flops.step_flops_per_token(8) / (2 * bench.PEAK_FLOPS)
        assert math.isclose(row["mfu"], mfu) and row["mfu"] > 0
        assert abs(row["loss"] - math.log(128)) < 0.5  # random init on a vocabulary of 128


def _parameters_left_by(rank: int, method: str, run) -> int:
    """Parameters alive after ``run_method`` that were not before it (a forked rank inherits its parent's)."""
    import gc

    def alive() -> int:
        gc.collect()
        return sum(isinstance(o, torch.nn.Parameter) for o in gc.get_objects())

    before = alive()
    sys.modules["bench_e2e"].run_method(rank, method, run)
    return alive() - before


def test_bench_e2e_releases_each_methods_model_before_the_next_builds():
    """Under a launcher every method runs in the same processes: one left alive (ZeRO's gradient hooks hold the
    engine) would take the next one's GPU memory (AutoEP after ours ran out of memory on one H100)."""
    from disagmoe_ds.launch import spawn_local

    bench = _load("bench_e2e")
    argv = ["--device", "cpu", "--model", str(ROOT / "hf_models" / "tiny-qwen3-moe"), "--world-size", "2"]
    argv += ["--seq-len", "8", "--global-batch", "4", "--warmup", "0", "--steps", "1", "--ep-size", "2"]
    for method, run in bench.runs(bench.parse_args([*argv, "--methods", "afpipe", "colocated", "autoep"])):
        left = spawn_local(_parameters_left_by, 2, args=(method, run), backend="gloo", timeout_s=120)
        assert left == [0, 0], (method, left)
