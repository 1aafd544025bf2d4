"""``--init-from`` without the whole model in any rank: each rank allocates the parts it cut from a meta model and
reads their values from the checkpoint's safetensors (``models.partial_load``).

The parts equal, bit for bit, the same parts cut from ``from_pretrained``'s model, for every family, from one file
and from shards; ``run_pretrain.py --init-from`` starts from the whole-model path's loss while ``from_pretrained``
is unusable; a missing tensor is a one-line error before any rank starts.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from disagmoe_ds.errors import CheckpointError
from disagmoe_ds.models import partial_load
from disagmoe_ds.models.loading import build_meta_model, load_model
from disagmoe_ds.models.model_facts import num_routed_experts
from disagmoe_ds.models.partial_load import PretrainedWeights, check_pretrained, model_to_cut, place
from disagmoe_ds.models.parts import AttentionStage, ExpertStage
from disagmoe_ds.train.model import freeze
from tests.conftest import ROOT, TINY_FAMILIES
from tests.runs import SHORT, records, run_pretrain

CPU = torch.device("cpu")


def cut(model: nn.Module) -> dict[str, nn.Module]:
    """Over every layer: the attention side with embedding and head, and each half of the experts."""
    layers = tuple(range(model.config.num_hidden_layers))
    experts = num_routed_experts(model)
    return {
        "attention": AttentionStage(model, layers, with_embedding=True, with_head=True),
        "first experts": ExpertStage(model, layers, 0, experts // 2),
        "last experts": ExpertStage(model, layers, experts // 2, experts),
    }


def load_parts(path: Path, dtype: torch.dtype = torch.float32) -> dict[str, nn.Module]:
    model = build_meta_model(path, dtype=dtype)
    weights = PretrainedWeights(path, model)
    parts = cut(model)
    for part in parts.values():
        place(part, model, CPU, weights=weights)
    return parts


def assert_parts_match_from_pretrained(path: Path, dtype: torch.dtype = torch.float32) -> None:
    expected = {kind: part.state_dict() for kind, part in cut(load_model(path, dtype=dtype)).items()}
    for kind, part in load_parts(path, dtype).items():
        got = part.state_dict()  # parameters and persistent buffers
        assert got.keys() == expected[kind].keys(), kind
        for name, tensor in got.items():
            want = expected[kind][name]
            assert tensor.dtype == want.dtype and torch.equal(tensor, want), (kind, name)


@pytest.mark.parametrize("sharded", [False, True], ids=["one-file", "sharded"])
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_parts_equal_those_cut_from_the_from_pretrained_model(tiny_checkpoint, family, sharded) -> None:
    path = tiny_checkpoint(family, **({"max_shard_size": "100KB"} if sharded else {}))
    assert (path / "model.safetensors.index.json").is_file() == sharded
    assert_parts_match_from_pretrained(path)


def test_qwen3_5_vision_language_checkpoint_gives_its_language_model(tmp_path) -> None:
    """Qwen3.5-MoE as the Hub ships it: the vision-language model (``qwen3_5_moe``, keys under
    ``model.language_model.`` beside ``model.visual.``). Its language model's parts read the checkpoint's tensors,
    as ``from_pretrained`` reads them, and equal the vision-language model's own."""
    import json

    import transformers

    text = json.loads((ROOT / "hf_models" / "tiny-qwen3.5-moe" / "config.json").read_text())
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 64}
    torch.manual_seed(0)
    config = transformers.Qwen3_5MoeConfig(text_config=text, vision_config={**vision, "patch_size": 4})
    vl = transformers.Qwen3_5MoeForConditionalGeneration(config)
    vl.save_pretrained(tmp_path)
    assert_parts_match_from_pretrained(tmp_path)
    check_pretrained(tmp_path)
    language_model = vl.model.language_model
    experts = load_parts(tmp_path)["last experts"].layers["1"].experts.gate_up_proj
    assert torch.equal(experts, language_model.layers[1].mlp.experts.gate_up_proj[4:])


def test_bf16_keeps_what_from_pretrained_keeps_in_fp32(tiny_checkpoint) -> None:
    """DeepSeek-V3's router weight and bias buffer stay fp32 in a bf16 model; the rest is cast."""
    assert_parts_match_from_pretrained(tiny_checkpoint("deepseek-v3"), torch.bfloat16)


def test_tied_embeddings_come_from_the_one_tensor_saved(tiny_checkpoint) -> None:
    path = tiny_checkpoint("qwen3-moe", tie_word_embeddings=True)
    assert_parts_match_from_pretrained(path)
    attention = load_parts(path)["attention"]
    assert attention.head.lm_head.weight is attention.embed_tokens.weight  # still one parameter, as in HF's model
    model = build_meta_model(path)
    head_only = AttentionStage(model, (3,), with_embedding=False, with_head=True)  # a deeper pipeline's last group
    place(head_only, model, CPU, weights=PretrainedWeights(path, model))
    assert torch.equal(head_only.head.lm_head.weight, load_model(path).model.embed_tokens.weight)


def test_fresh_token_routed_layers_get_the_generated_models_tables() -> None:
    """A freshly initialised DeepSeek-V4 attention stage (both modes place one) holds the same per-layer token tables
    as a generated whole model, not HF's all-zero init (every token to expert 0): K distinct experts per token, every
    expert used."""
    path = ROOT / "hf_models" / "tiny-deepseek-v4"
    model = build_meta_model(path)
    attention = cut(model)["attention"]
    place(attention, model, CPU, seed=3)
    expected = load_model(path).state_dict()
    tables = {name: t for name, t in attention.state_dict().items() if name.endswith("tid2eid")}
    assert len(tables) == 2  # the config's two hash_moe layers
    for name, table_VK in tables.items():
        assert torch.equal(table_VK, expected[f"model.{name}"]), name
        assert (table_VK[:, 0] != table_VK[:, 1]).all()
        assert torch.bincount(table_VK.flatten(), minlength=8).min() > 0


def test_frozen_parameters_stay_frozen_when_their_part_is_allocated(tiny_checkpoint) -> None:
    path = tiny_checkpoint("qwen2-moe")
    model = build_meta_model(path)
    frozen = freeze(model, router=True, attention=True)
    weights = PretrainedWeights(path, model)
    trainable = {}
    for kind, part in cut(model).items():
        before = {name: p.requires_grad for name, p in part.named_parameters()}
        place(part, model, CPU, weights=weights)
        assert {name: p.requires_grad for name, p in part.named_parameters()} == before, kind
        trainable.update({f"{kind}.{name}": flag for name, flag in before.items()})
    assert frozen.router > 0 and frozen.attention > 0
    assert any(trainable.values()) and not all(trainable.values())


def test_pytorch_bin_checkpoints_are_still_loaded_whole(tiny_checkpoint, tmp_path) -> None:
    src = tiny_checkpoint("qwen3-moe")
    shutil.copy(src / "config.json", tmp_path)
    reference = load_model(src)
    torch.save(reference.state_dict(), tmp_path / "pytorch_model.bin")
    model, weights = model_to_cut(tmp_path, require_weights=True)
    assert weights is None and not next(model.parameters()).is_meta
    assert torch.equal(model.model.embed_tokens.weight, reference.model.embed_tokens.weight)


def checkpoint_without(src: Path, out: Path, key: str) -> Path:
    shutil.copy(src / "config.json", out)
    tensors = load_file(src / "model.safetensors")
    del tensors[key]
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize(
    ("family", "key", "message"),
    [
        (
            "qwen3-moe",
            "model.layers.1.self_attn.q_proj.weight",
            r"has no tensor for model\.layers\.1\.self_attn\.q_proj\.weight, which the model",
        ),
        (
            "mixtral",
            "model.layers.2.block_sparse_moe.experts.3.w3.weight",
            r"has no tensor model\.layers\.2\.block_sparse_moe\.experts\.3\.w3\.weight "
            r"\(expert 3 of model\.layers\.2\.mlp\.experts\.gate_up_proj\)$",
        ),
    ],
)
def test_a_missing_tensor_is_a_one_line_error(tiny_checkpoint, tmp_path, family, key, message) -> None:
    path = checkpoint_without(tiny_checkpoint(family), tmp_path, key)
    with pytest.raises(CheckpointError, match=message) as err:
        check_pretrained(path)
    assert "\n" not in str(err.value)


def test_run_pretrain_refuses_a_missing_tensor_before_any_rank_starts(tiny_checkpoint, tmp_path, capfd) -> None:
    key = "model.layers.1.mlp.experts.7.down_proj.weight"
    path = checkpoint_without(tiny_checkpoint("qwen3-moe"), tmp_path, key)
    assert run_pretrain.main(["--init-from", str(path), "--tokenizer-cache", str(tmp_path / "tok")]) == 2
    out, err = capfd.readouterr()
    lines = [line for line in err.splitlines() if line.startswith("run_pretrain.py")]
    expected = f"run_pretrain.py: error: {path} has no tensor {key} (expert 7 of model.layers.1.mlp.experts.down_proj)"
    assert lines == [expected], err
    assert "model:" not in out  # no rank printed its banner


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    """The embedded default model (its vocabulary fits the bundled tokenizer) with random weights, saved."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = tmp_path_factory.mktemp("pretrained")
    torch.manual_seed(1)
    config = AutoConfig.from_pretrained(ROOT / "hf_models" / "tiny-qwen3-moe-lm")
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def first_loss(tok_cache: Path, metrics: Path, *argv: object) -> float:
    argv = (*SHORT, "--tokenizer-cache", tok_cache, "--steps", 1, "--metrics-file", metrics, *argv)
    assert run_pretrain.main(list(map(str, argv))) == 0
    return records(metrics)[0]["loss"]


@pytest.mark.parametrize("mode", [(), ("--mode", "colocated", "--world-size", 2)], ids=["disaggregated", "colocated"])
def test_init_from_starts_where_the_whole_model_path_does(pretrained, tok_cache, tmp_path, monkeypatch, mode) -> None:
    from transformers import AutoModelForCausalLM

    with monkeypatch.context() as patch:
        patch.setattr(partial_load, "reads_partially", lambda path: False)  # every rank runs from_pretrained
        whole = first_loss(tok_cache, tmp_path / "whole.jsonl", "--init-from", pretrained, *mode)

    def whole_model(*args, **kwargs):
        raise AssertionError("a rank loaded the whole model")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", whole_model)  # the forked ranks inherit it
    partial = first_loss(tok_cache, tmp_path / "partial.jsonl", "--init-from", pretrained, *mode)
    assert abs(partial - whole) < 1e-5, (partial, whole)
