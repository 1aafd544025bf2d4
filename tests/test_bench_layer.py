"""bench/bench_layer.py and bench/bench_experts.py run every path on a tiny model on CPU (fp32) and rate each
against the compiled HF reference; a path that fails is a row of the table, not the end of the run.

The compiled paths use a backend that counts dynamo's graphs and hands them to ``aot_eager`` (AOT autograd's
backward exactly as under inductor, without inductor's C++ code generation, which costs tens of seconds per
graph on a cold CPU cache): the compiled paths must compile something, the others nothing.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import bench_experts  # noqa: E402
import bench_layer  # noqa: E402

GRAPHS: list[int] = []  # dynamo graphs compiled during each timed path, in order


@torch._dynamo.register_backend
def bench_test_backend(gm, example_inputs):
    GRAPHS[-1] += 1
    return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)


TINY = ["--device", "cpu", "--warmup", "1", "--iters", "1", "--compile-backend", "bench_test_backend"]


@pytest.fixture
def graphs(monkeypatch):
    """The graph count of each path (compilation happens in ``time_step``'s warm-up)."""
    GRAPHS.clear()
    for module in (bench_layer, bench_experts):
        timed = module.time_step

        def counted(*args, _timed=timed, **kwargs):
            GRAPHS.append(0)
            return _timed(*args, **kwargs)

        monkeypatch.setattr(module, "time_step", counted)
    return GRAPHS


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: tiny ops on a shared 2-core host otherwise stall on each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _check_rows(rows, key, names, out, graphs):
    assert [r[key] for r in rows] == list(names)
    assert [n > 0 for n in graphs] == [name.endswith("compiled") for name in names], graphs
    for r in rows:
        assert r["error"] is None, r
        assert r["ms"] > 0 and r["vs_hf_compiled"] > 0, r
        assert f"{r['vs_hf_compiled']:.2f}x" in out
    assert next(r for r in rows if r[key] == "hf-compiled")["vs_hf_compiled"] == pytest.approx(1.0)
    assert "vs hf-compiled" in out


@pytest.mark.parametrize(
    "model, paths",
    [
        ("tiny-qwen3-moe", bench_layer.paths_for("cpu")),
        ("tiny-deepseek-v3", ("hf-compiled", "ours-compiled", "floor")),
        ("tiny-deepseek-v4", ("hf-compiled", "ours", "ours-compiled")),  # hyper-connection streams, a hash-routed layer
    ],
)
def test_layer_every_path_against_compiled_hf(tmp_path, capsys, graphs, model, paths):
    out_json = tmp_path / "layer.json"
    argv = ["--model", str(ROOT / "hf_models" / model), "--seq-len", "8", "--batch", "2", "--json", str(out_json)]
    if paths != bench_layer.paths_for("cpu"):
        argv += ["--paths", *paths]  # the default is every path
    assert bench_layer.main(argv + TINY) == 0
    out = capsys.readouterr().out
    rows = json.loads(out_json.read_text())
    _check_rows(rows, "path", paths, out, graphs)
    for r in rows:
        assert r["model"] == model and r["tokens_per_s"] > 0 and r["tokens_per_s"] == pytest.approx(16 / r["ms"] * 1e3)


def test_experts_every_variant_against_compiled_hf(tmp_path, capsys, graphs):
    out_json = tmp_path / "experts.json"
    argv = ["--tokens", "32", "--hidden", "64", "--inter", "32", "--experts", "8", "--top-k", "2"]
    assert bench_experts.main(argv + TINY + ["--json", str(out_json)]) == 0
    rows = json.loads(out_json.read_text())
    _check_rows(rows, "variant", bench_experts.VARIANTS, capsys.readouterr().out, graphs)


def test_a_failed_path_is_reported_and_the_others_run(tmp_path, capsys, monkeypatch):
    def broken(module):
        raise RuntimeError("backend='inductor' raised:\nLoweringException: no lowering\n  more detail")

    monkeypatch.setattr(bench_layer, "compile_stage", broken)
    out_json = tmp_path / "layer.json"
    argv = ["--model", str(ROOT / "hf_models" / "tiny-qwen3-moe"), "--seq-len", "8", "--batch", "2"]
    argv += ["--paths", "ours-compiled", "hf-grouped", "--json", str(out_json)]
    assert bench_layer.main(argv + TINY) == 1
    out = capsys.readouterr().out
    failed, grouped = json.loads(out_json.read_text())
    assert failed["error"] == "RuntimeError: backend='inductor' raised: LoweringException: no lowering"
    assert failed["tokens_per_s"] is None
    assert f"ours-compiled  failed: {failed['error']}" in out
    assert grouped["error"] is None and grouped["tokens_per_s"] > 0
    assert grouped["vs_hf_compiled"] is None  # no reference ran


@pytest.mark.parametrize(
    "op, kernel, cls",
    [
        ("aten::_grouped_mm", "_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_", "expert grouped GEMMs"),
        ("aten::mm", "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "dense GEMMs"),
        ("MmBackward0", "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT", "dense GEMMs"),
        (
            "GroupedMmBackward0",
            "cutlass13device_kernel...13GemmUniversalINS5_17GroupProblemShape",
            "expert grouped GEMMs",
        ),
        ("aten::_cudnn_attention_backward", "cudnn_generated_fort_native_sdpa_sm90_flash_bprop", "SDPA"),
        ("## Call CompiledFxGraph fxadcw4", "triton_poi_fused_cat_masked_fill_mul_silu_0", "fused (inductor, Triton)"),
        ("aten::index_select", "void at::native::vectorized_gather_kernel<16, long>", "gathers, scatters, sort"),
        ("aten::copy_", "void at::native::elementwise_kernel<128, 4>", "copies, casts"),
        ("aten::add_", "void at::native::vectorized_elementwise_kernel<4>", "other kernels"),
    ],
)
def test_profile_classes_kernels_by_the_op_that_launched_them(op, kernel, cls):
    assert bench_layer.kernel_class(op, kernel) == cls


def test_memory_peak_replays_the_allocator_trace_to_its_peak():
    def alloc(addr, size):
        return {"action": "alloc", "addr": addr, "size": size}

    def free(addr, size):
        return {"action": "free_completed", "addr": addr, "size": size}

    # 1 and 2 alive (30), 1 freed, 3 and 4 made (20 + 15 + 5 = 40: the peak), then all freed; a block from before
    # the trace is freed in it and counts nothing
    trace = [alloc(1, 10), alloc(2, 20), free(9, 99), free(1, 10), alloc(3, 15), alloc(4, 5), free(2, 20), free(3, 15)]
    peak, largest = bench_layer.largest_at_peak(trace, top=2)
    assert peak == 40 and [e["addr"] for e in largest] == [2, 3]


def test_the_floor_refuses_experts_it_cannot_time(tmp_path, capsys):
    out_json = tmp_path / "layer.json"
    argv = ["--model", str(ROOT / "hf_models" / "tiny-gpt-oss"), "--seq-len", "8", "--paths", "floor"]
    assert bench_layer.main(argv + ["--json", str(out_json)] + TINY) == 1
    (row,) = json.loads(out_json.read_text())
    assert row["error"] == "ValueError: the floor path needs HF's fused gate/up expert tensors, not gpt_oss's"


@pytest.mark.parametrize("layer, mixer", [(0, "linear_attn"), (3, "self_attn")])
def test_layer_picks_the_models_layer_type(tmp_path, monkeypatch, layer, mixer):
    """Qwen3.5-MoE alternates Gated DeltaNet and full attention: ``--layer`` builds the type of that layer and counts
    its FLOPs."""
    built = []
    one_layer = bench_layer.one_layer_model

    def recorded(*args, **kwargs):
        built.append(one_layer(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(bench_layer, "one_layer_model", recorded)
    out_json = tmp_path / "layer.json"
    argv = ["--model", str(ROOT / "hf_models" / "tiny-qwen3.5-moe"), "--seq-len", "8", "--batch", "1"]
    argv += ["--paths", "hf-grouped", "--layer", str(layer), "--json", str(out_json)]
    assert bench_layer.main(argv + TINY) == 0
    (row,) = json.loads(out_json.read_text())
    assert hasattr(built[0].model.layers[0], mixer)
    assert row["model"] == "tiny-qwen3.5-moe" + (f":{layer}" if layer else "") and row["layer"] == layer
    spec = bench_layer.load_model_spec(str(ROOT / "hf_models" / "tiny-qwen3.5-moe"))
    flops = 3 * (spec.attention_side_flops(8, layer) + spec.expert_side_flops(layer))
    assert row["tflops"] == pytest.approx(flops * 8 / (row["ms"] / 1e3) / 1e12)


def test_layer_out_of_range_is_refused():
    config = bench_layer.load_config(ROOT / "hf_models" / "tiny-qwen3.5-moe")
    with pytest.raises(ValueError, match="layer 9 is not one of the model's 4 layers"):
        bench_layer.one_layer_model(config, device="cpu", dtype=torch.float32, layer=9)


def test_fp8_projections_lists_each_shape_the_lever_may_convert():
    """bench/fp8_projections.py times the attention part's projections by shape: not the router, k and v once."""
    import fp8_projections

    assert fp8_projections.projections(str(ROOT / "hf_models/Qwen3-30B-A3B")) == {
        (2048, 4096): ["q_proj"], (2048, 512): ["k_proj", "v_proj"], (4096, 2048): ["o_proj"],
    }  # fmt: skip
    deepseek = fp8_projections.projections(str(ROOT / "hf_models/DeepSeek-V3"))
    assert deepseek[7168, 2048] == ["gate_proj", "up_proj"] and deepseek[16384, 7168] == ["o_proj"]
    assert (7168, 256) not in deepseek  # the router
