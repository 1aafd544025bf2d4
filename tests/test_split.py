"""The split (attention parts + R expert shards) equals the HF model: logits, loss with aux loss, every gradient."""

from __future__ import annotations

import functools

import pytest
import torch

from disagmoe_ds.errors import CheckpointError, LayoutError, UnsupportedModelError
from disagmoe_ds.models.loading import load_model
from disagmoe_ds.models.model_facts import num_routed_experts
from disagmoe_ds.models.skew import skew_router
from disagmoe_ds.models.split import SplitModel, hf_reference_loss
from tests.conftest import ROOT, TINY_FAMILIES

# fp32: the split only re-associates sums (expert partials per shard, shared expert added to the residual first),
# so differences are a few ulps of O(1) values.
FP32_TOL = 1e-5
# bf16: the same re-association rounds to 8 mantissa bits; logits of the tiny models are O(1), so a few bf16 ulps.
BF16_TOL = 3e-2


def run_pair(path, num_shards: int, *, dtype=torch.float32, skew: bool = False, seed: int = 0):
    ref = load_model(path, dtype=dtype)
    split_src = load_model(path, dtype=dtype)
    if skew:
        skew_router(ref)
        skew_router(split_src)
    split = SplitModel(split_src, num_shards)
    torch.manual_seed(seed)
    input_ids = torch.randint(3, ref.config.vocab_size, (2, 12))
    out_ref = ref(input_ids=input_ids, labels=input_ids)
    out_split = split(input_ids, labels=input_ids)
    out_ref.loss.backward()
    out_split.loss.backward()
    return ref, split, out_ref, out_split


def max_grad_diff(ref, split) -> float:
    grads = split.hf_named_grads()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    assert set(grads) == set(ref_grads)
    frozen = {n for n, p in ref.named_parameters() if not p.requires_grad}  # ERNIE's correction bias
    assert all(grads[n] is None and ref_grads[n] is None for n in frozen)
    return max((grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads if n not in frozen)


@pytest.mark.parametrize("family", TINY_FAMILIES)
@pytest.mark.parametrize("shards", ["1", "2", "all"])
@pytest.mark.parametrize("skew", [False, True], ids=["random", "skewed"])
def test_split_equals_hf_fp32(tiny_checkpoint, family, shards, skew):
    path = tiny_checkpoint(family)
    ref, split, out_ref, out_split = run_pair(path, _num_shards(path, shards), skew=skew)
    assert (out_ref.logits - out_split.logits).abs().max().item() <= FP32_TOL
    assert abs(out_ref.loss.item() - out_split.loss.item()) <= FP32_TOL
    if out_split.aux_loss is not None:
        assert abs(out_ref.aux_loss.item() - out_split.aux_loss.item()) <= FP32_TOL
    assert max_grad_diff(ref, split) <= FP32_TOL


def _num_shards(path, shards: str) -> int:
    return num_routed_experts(load_model(path)) if shards == "all" else int(shards)


@pytest.mark.parametrize("family", ["qwen2-moe", "deepseek-v3", "mixtral"])
def test_split_equals_hf_bf16(tiny_checkpoint, family):
    ref, split, out_ref, out_split = run_pair(tiny_checkpoint(family), 2, dtype=torch.bfloat16)
    assert (out_ref.logits.float() - out_split.logits.float()).abs().max().item() <= BF16_TOL
    assert abs(out_ref.loss.item() - out_split.loss.item()) <= BF16_TOL


def test_skew_routes_everything_to_one_expert(tiny_checkpoint):
    model = load_model(tiny_checkpoint("qwen3-moe"))
    skew_router(model, expert=3)
    seen = []
    for layer in model.model.layers:
        if hasattr(layer.mlp, "experts"):
            layer.mlp.gate.register_forward_hook(lambda m, a, out: seen.append(out[2]))
    model(input_ids=torch.randint(3, 128, (2, 12)))
    assert seen and all((idx[:, 0] == 3).all() for idx in seen)


def test_indivisible_shards_error(tiny_checkpoint):
    with pytest.raises(LayoutError, match=r"num_experts \(8\) must be divisible by the number of expert shards \(3\)"):
        SplitModel(load_model(tiny_checkpoint("olmoe")), 3)


def test_unsupported_architecture_error(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": 8}')
    with pytest.raises(UnsupportedModelError, match="model_type 'llama' is not supported by DisagMoE-DS"):
        load_model(tmp_path)


@pytest.mark.parametrize(
    ("tiny", "fields", "message"),
    [
        (
            "qwen3-next",
            {"layer_types": ["linear_attention", "full_attention", "chunked_attention", "full_attention"]},
            r"^layer 2 of the qwen3_next config is a 'chunked_attention' layer, which DisagMoE-DS cannot cut",
        ),
        ("hunyuan-v1-moe", {"moe_topk": [2, 1, 2, 2]}, r"^layer 1 of the hunyuan_v1_moe config has its own moe_topk"),
    ],
    ids=["layer-type", "per-layer-top-k"],
)
def test_what_the_cut_cannot_hold_is_refused_naming_the_layer(tmp_path, tiny, fields, message):
    import json

    config = json.loads((ROOT / "hf_models" / f"tiny-{tiny}" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **fields}))
    with pytest.raises(UnsupportedModelError, match=message) as err:
        load_model(tmp_path)
    assert "\n" not in str(err.value)


def test_missing_weight_file_error(tiny_checkpoint, tmp_path):
    import shutil

    src = tiny_checkpoint("mixtral")
    shutil.copy(src / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="no weight file in"):
        load_model(tmp_path, require_weights=True)
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"a": "model-00001-of-00002.safetensors"}}')
    with pytest.raises(CheckpointError, match="lists weight files that are missing: model-00001-of-00002"):
        load_model(tmp_path)


def test_compiled_head_equals_hf_loss(tiny_checkpoint, monkeypatch):
    """``compile_stage`` compiles the head (norm, LM head, HF's loss) too; compiled, it gives HF's loss and input
    gradient (``aot_eager`` here: the same graphs, differentiated as inductor gets them)."""
    from disagmoe_ds.models.parts import AttentionStage, compile_stage

    model = load_model(tiny_checkpoint("qwen3-moe"))
    stage = AttentionStage(model, (0,), with_embedding=True, with_head=True)
    h = torch.randn(2, 12, model.config.hidden_size, requires_grad=True)
    labels = torch.randint(3, model.config.vocab_size, (2, 12))
    labels[0, 5] = -100  # ignored, as HF's loss ignores it
    _, eager = stage.head(h, labels)
    (grad_eager,) = torch.autograd.grad(eager, h)
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    compile_stage(stage)
    assert stage.head._compiled_call_impl is not None
    _, compiled = stage.head(h, labels)
    (grad_compiled,) = torch.autograd.grad(compiled, h)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=FP32_TOL)
    torch.testing.assert_close(grad_compiled, grad_eager, rtol=0, atol=FP32_TOL)


@pytest.mark.parametrize("family", ["qwen3-moe", "mixtral", "deepseek-v4"])  # V4: its learned layers only
def test_per_layer_balancing_equals_hf_per_layer(tiny_checkpoint, family):
    """``router_aux_loss_per_layer``: the split's aux loss is the mean of HF's function on each layer alone, which
    on a skewed router differs from HF's pooled loss (so the comparison could fail), and the gradients follow it."""
    path = tiny_checkpoint(family, router_aux_loss_per_layer=True, router_aux_loss_coef=0.5)
    ref, split_src = load_model(path), load_model(path)
    skew_router(ref, spread=True)
    skew_router(split_src, spread=True)
    split = SplitModel(split_src, 2)
    input_ids = torch.randint(3, ref.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    out_ref = ref(input_ids=input_ids, labels=input_ids)
    ref_loss = hf_reference_loss(ref, out_ref)
    out_split = split(input_ids, labels=input_ids)
    assert abs(ref_loss.item() - out_ref.loss.item()) > 1e-3  # per layer is not pooled here
    assert abs(ref_loss.item() - out_split.loss.item()) <= FP32_TOL
    ref_loss.backward()
    out_split.loss.backward()
    assert max_grad_diff(ref, split) <= FP32_TOL
