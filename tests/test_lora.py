"""LoRA fine-tuning: adapters on both sides exact against PEFT, its adapter format, and the run_pretrain walk."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from disagmoe_ds import convert
from disagmoe_ds.afpipe.verify_run import run_verify
from disagmoe_ds.colocated.layout import ColocatedConfig
from disagmoe_ds.colocated.verify import ColocatedVerifyArgs, run_colocated_verify
from disagmoe_ds.config import DisagMoEConfig
from disagmoe_ds.errors import ConfigError
from disagmoe_ds.models import peft_format
from disagmoe_ds.models.adapters import add_adapters
from disagmoe_ds.models.loading import load_model
from disagmoe_ds.models.lora import LoraLinear, is_adapter
from disagmoe_ds.models.lora_settings import LoraSettings
from disagmoe_ds.models.split import SplitModel
from disagmoe_ds.parity.reference import VerifyArgs
from tests.conftest import ROOT, all_families_only

peft = pytest.importorskip("peft")
MODELS = ROOT / "hf_models"
RANDOM_B = {"init_lora_weights": False}  # the update is not zero at the start: the forward checks it too


def _tiny(family: str, dtype=torch.float32) -> nn.Module:
    return load_model(MODELS / f"tiny-{family}", dtype=dtype, seed=3)


def test_lora_linear_is_peft_linear() -> None:
    base = nn.Linear(12, 20)
    ours = LoraLinear(base, rank=4, scaling=0.5, dropout=0.0)
    with torch.no_grad():
        ours.lora_A.normal_()
        ours.lora_B.normal_()
    config = peft.LoraConfig(r=4, lora_alpha=2, init_lora_weights=False)
    theirs = peft.tuners.lora.Linear(copy.deepcopy(base), "default", config=config, r=4, lora_alpha=2)
    theirs.lora_A["default"].weight.data.copy_(ours.lora_A)
    theirs.lora_B["default"].weight.data.copy_(ours.lora_B)
    x = torch.randn(3, 12)
    assert torch.allclose(ours(x), theirs(x), atol=1e-6)
    assert ours.weight is base.weight and ours.bias is base.bias  # the base keeps its names and objects
    assert torch.allclose(ours(x), nn.functional.linear(x, ours.merged_weight(), base.bias), atol=1e-6)


@pytest.mark.parametrize("rank", [8, 3], ids=["aligned", "padded"])
def test_grouped_adapters_equal_the_merged_weights(rank) -> None:
    """The two extra grouped GEMMs per projection (rank zero-padded to a 16-byte row when it is not one) equal HF's
    experts on merged weights, forward and backward, for adapters and base alike."""
    model = _tiny("qwen3-moe")
    split = SplitModel(model, 2)
    add_adapters(split, LoraSettings(rank=rank, **RANDOM_B), seed=1)
    shard = split.shards[1].shard(1)
    x_RH = torch.randn(10, model.config.hidden_size, requires_grad=True)
    idx_RK = torch.randint(0, shard.num_local + 1, (10, 2))  # num_local: an expert held elsewhere
    w_RK = torch.rand(10, 2)
    params = [p for p in shard.parameters() if p.requires_grad]
    outs = []
    for path in (shard.forward, shard.forward_hf):
        y = path(x_RH, idx_RK, w_RK)
        outs.append((y, torch.autograd.grad(y.square().sum(), [x_RH, *params])))
    (y1, g1), (y2, g2) = outs
    assert torch.allclose(y1, y2, atol=1e-5)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(g1, g2, strict=True))
    assert {n.rsplit(".", 1)[1] for n, p in shard.named_parameters() if p.requires_grad} == {
        "gate_up_proj_lora_A", "gate_up_proj_lora_B", "down_proj_lora_A", "down_proj_lora_B"
    }  # fmt: skip


def test_adapters_are_the_same_in_every_layout_and_only_they_train() -> None:
    settings = LoraSettings(rank=4, **RANDOM_B)
    whole = peft_format.initial_adapters(_tiny("qwen3-moe"), settings, seed=5)
    split = SplitModel(_tiny("qwen3-moe"), 4)
    add_adapters(split, settings, seed=5)
    for n, p in split.named_parameters():
        assert p.requires_grad == is_adapter(n), n
    gate_up = torch.cat([s.shard(2).experts.gate_up_proj_lora_A for s in split.shards])
    assert torch.equal(gate_up, whole["model.layers.2.mlp.experts.gate_up_proj_lora_A"])
    q = split.attention.part(1).self_attn.q_proj
    assert isinstance(q, LoraLinear) and torch.equal(q.lora_B, whole["model.layers.1.self_attn.q_proj.lora_B"])


@pytest.mark.parametrize("family", ["qwen3-moe", "deepseek-v3", "gpt-oss"])
def test_our_adapter_state_is_peft_s(family) -> None:
    """``to_peft`` gives exactly the keys of PEFT's own state dict for the same targets, and the values PEFT's model
    holds after ``peft_model`` copied ours in (ParamWrapper's [E*r, in] / [out, r*E] layout)."""
    settings = LoraSettings(rank=4, train_router=True, **RANDOM_B)
    model = _tiny(family)
    init = peft_format.initial_adapters(model, settings, seed=0)
    routers = peft_format.router_modules(model.config, dict(model.named_parameters()))
    ours = peft_format.to_peft({**init, **dict(model.named_parameters())}, routers)
    wrapped = peft_format.peft_model(model, settings, init)
    theirs = peft.get_peft_model_state_dict(wrapped)
    adapters = sorted(k for k in ours if "lora" in k)
    assert adapters == sorted(theirs) and all(torch.equal(ours[k], theirs[k]) for k in adapters)
    trained = {k.removeprefix(peft_format.PREFIX).rpartition(".")[0] for k in ours if "lora" not in k}
    assert trained == set(routers) and routers  # the routers' own keys (PEFT's modules_to_save)


def test_adapter_directory_loads_in_peft_and_equals_the_merged_model(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    from disagmoe_ds.models.hf_writer import write_hf
    from tests.conftest import write_tiny_checkpoint

    base = write_tiny_checkpoint("deepseek-v3", tmp_path / "base", seed=2)
    model = AutoModelForCausalLM.from_pretrained(base)
    settings = LoraSettings(rank=4, alpha=8, train_router=True, **RANDOM_B)
    tensors = dict(model.state_dict()) | peft_format.initial_adapters(model, settings, seed=7)
    with torch.no_grad():
        tensors["model.layers.1.mlp.gate.weight"] = tensors["model.layers.1.mlp.gate.weight"] * 1.5  # "trained"
    peft_format.write_adapter(tensors, settings, tmp_path / "adapter", config=model.config, base_model=str(base),
                              dtype=torch.float32)  # fmt: skip
    write_hf(base, peft_format.merged(tensors, settings, transposed=False), tmp_path / "merged", dtype=torch.float32)
    ids = torch.arange(3, 19).view(2, 8)
    loaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), tmp_path / "adapter")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    with torch.no_grad():
        plain, adapted, folded = (m(ids).logits for m in (model, loaded, merged))
    assert torch.allclose(adapted, folded, atol=1e-4)
    assert (adapted - plain).abs().max() > 1e-2  # the adapters and the router change the model


def test_mlp_adapters_are_refused_as_a_peft_directory(tmp_path) -> None:
    model = _tiny("qwen3-moe")
    settings = LoraSettings(rank=4, targets=("attention", "mlp", "experts"))
    tensors = dict(model.state_dict()) | peft_format.initial_adapters(model, settings, seed=0)
    with pytest.raises(ConfigError, match="--export-hf-merged"):
        peft_format.write_adapter(tensors, settings, tmp_path / "a", config=model.config, base_model="x",
                                  dtype=torch.float32)  # fmt: skip


CASES = {  # family, layout, ZeRO stage, LoRA settings
    "qwen3-111-zero1": ("qwen3-moe", {}, 1, {}),
    "deepseek-v3-221-zero2": ("deepseek-v3", {"attention_gpus": 2, "ffn_gpus": 2}, 2, {}),
    "mixtral-depth2-zero1": ("mixtral", {"attention_gpus": 2, "ffn_gpus": 2, "depth": 2}, 1, {}),
    "qwen2-mlp-router-edp2": (
        "qwen2-moe",
        {"ffn_gpus": 2, "expert_data_parallel": 2},
        2,
        {"targets": ("attention", "mlp", "experts"), "train_router": True},
    ),  # fmt: skip
    "gpt-oss-hf-path-rank3": ("gpt-oss", {"ffn_gpus": 2}, 0, {"rank": 3, "targets": ("q_proj", "o_proj", "experts")}),
    "qwen3-ulysses-2": ("qwen3-moe", {"attention_gpus": 2, "sequence_parallel": 2}, 1, {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_lora_training_equals_peft(case) -> None:
    """Two steps on CPU ranks under the rendezvous transport: loss, grad norm, every gradient (the adapters') and
    every parameter (the frozen base unchanged) equal PEFT's on the single-process HF model."""
    family, layout, zero, extra = CASES[case]
    lora = LoraSettings(**{"rank": 8, **RANDOM_B, **extra})
    cfg = DisagMoEConfig(**layout, micro_batches=2, transport="rendezvous", lora=lora)
    result = run_verify(VerifyArgs(model=str(MODELS / f"tiny-{family}"), cfg=cfg, zero=zero, seq_len=8))
    assert result["pass"], result["max_abs_diff"]


LAYOUTS = {
    "111": {},
    "221": {"attention_gpus": 2, "ffn_gpus": 2},
    "depth2": {"attention_gpus": 2, "ffn_gpus": 2, "depth": 2},
}
SWEEP = [
    all_families_only(family, layout, zero)
    for family in ("qwen3-moe", "deepseek-v3", "mixtral")
    for layout in LAYOUTS
    for zero in (1, 2)
]


@pytest.mark.parametrize(("family", "layout", "zero"), SWEEP)
def test_lora_equals_peft_in_every_layout(family, layout, zero) -> None:
    """Issue 30's grid (DISAGMOE_ALL_FAMILIES=1): three families x (1,1,1), (2,2,1), depth 2 x ZeRO 1 and 2."""
    cfg = DisagMoEConfig(**LAYOUTS[layout], micro_batches=2, transport="rendezvous", lora=LoraSettings(8, **RANDOM_B))
    result = run_verify(VerifyArgs(model=str(MODELS / f"tiny-{family}"), cfg=cfg, zero=zero, seq_len=8))
    assert result["pass"], result["max_abs_diff"]


@pytest.mark.parametrize("layout", [all_families_only("depth2")])
def test_deepseek_v4_lora_equals_peft(layout) -> None:
    """DeepSeek-V4's LoRA (DISAGMOE_ALL_FAMILIES=1): adapters on its attention's plain Linears (its grouped output
    projection, a Linear subclass with a forward of its own, gets none) and every expert; the hyper-connections stay
    frozen with the base. Depth 2: the hand-off's streams and token ids under LoRA too."""
    cfg = DisagMoEConfig(**LAYOUTS[layout], micro_batches=2, transport="rendezvous", lora=LoraSettings(8, **RANDOM_B))
    result = run_verify(VerifyArgs(model=str(MODELS / "tiny-deepseek-v4"), cfg=cfg, zero=1, seq_len=8))
    assert result["pass"], result["max_abs_diff"]


def test_lora_in_bf16_with_the_memory_levers_equals_peft() -> None:
    lora = LoraSettings(rank=4, train_router=True, **RANDOM_B)
    cfg = DisagMoEConfig(ffn_gpus=2, micro_batches=2, selective_recompute=True, split_backward=True, lora=lora)
    result = run_verify(VerifyArgs(model=str(MODELS / "tiny-deepseek-v3"), cfg=cfg, zero=1, dtype="bf16"))
    assert result["pass"], result["max_abs_diff"]


def test_colocated_lora_equals_peft() -> None:
    cfg = ColocatedConfig(world_size=2, ep_size=2, micro_batches=2, lora=LoraSettings(rank=8, **RANDOM_B))
    result = run_colocated_verify(ColocatedVerifyArgs(model=str(MODELS / "tiny-qwen3-moe"), cfg=cfg, zero=1))
    assert result["pass"], result["max_abs_diff"]


@pytest.mark.parametrize(
    "layout",
    [("--attention-gpus", 2, "--ffn-gpus", 2), ("--mode", "colocated", "--world-size", 2, "--ep-size", 2)],
    ids=["disaggregated", "colocated"],
)
def test_lora_fine_tuning_resumes_exactly_and_exports_peft_and_merged(tok_cache, tmp_path, capfd, layout) -> None:
    """HF dir -> --init-from --sft --lora-rank 8 -> resume at step 2 (steps 3-4 bit for bit) -> --export-hf (a
    PEFT adapter directory) and --export-hf-merged: PEFT's model on the base and the merged model give the same
    logits, and not the base model's."""
    from transformers import AutoModelForCausalLM

    from disagmoe_ds.data import bundled_corpus, train_or_load_tokenizer
    from tests.conftest import write_tiny_checkpoint
    from tests.runs import pretrain, records, same, write_sft_jsonl

    hf_dir = write_tiny_checkpoint("qwen3-moe", tmp_path / "hf", seed=1, vocab_size=512)
    train_or_load_tokenizer(bundled_corpus(), 512, tok_cache).save_hf(hf_dir)
    write_sft_jsonl(tmp_path / "sft.jsonl", n=40)
    argv = ("--init-from", hf_dir, "--sft", "--data", tmp_path / "sft.jsonl", *layout)
    argv += ("--micro-batches", 2, "--steps", 4, "--lora-rank", 8, "--lora-alpha", 16, "--lr", "1e-2")
    full, resumed, ck, adapter, merged = (tmp_path / n for n in ("full.jsonl", "resumed.jsonl", "ck", "ad", "m"))
    exports = ("--export-hf", adapter, "--export-hf-merged", merged)
    assert pretrain(tok_cache, *argv, "--save-dir", ck, "--save-every", 2, "--metrics-file", full, *exports) == 0
    assert pretrain(tok_cache, *argv, "--resume", ck / "step2", "--metrics-file", resumed) == 0
    assert [r["step"] for r in records(resumed)] == [3, 4] and same(records(resumed), records(full)[2:])
    # The base weights stay in --init-from's directory (co-located: DeepSpeed's per-expert files still hold them).
    for states in (ck / "step4").rglob("mp_rank_*_model_states.pt"):
        module = torch.load(states, map_location="cpu", weights_only=False)["module"]
        assert module and all(is_adapter(name) for name in module), sorted(module)[:3]
    assert pretrain(tok_cache, *argv[:-6], "--steps", 6, "--resume", ck / "step4") == 2  # no LoRA: refused
    ids = torch.arange(3, 35).view(2, 16)
    base = AutoModelForCausalLM.from_pretrained(hf_dir)
    with torch.no_grad():
        plain = base(ids).logits
        adapted = peft.PeftModel.from_pretrained(base, adapter)(ids).logits
        folded = AutoModelForCausalLM.from_pretrained(merged)(ids).logits
    assert torch.allclose(adapted, folded, atol=1e-4)
    assert (adapted - plain).abs().max() > 1e-3
    # disagmoe-convert writes the same from the step-4 checkpoint: the adapter directory (disaggregated) or the
    # merged model (co-located), tensor for tensor; without the base weights it is refused before any rank starts.
    merge = layout[0] == "--mode"
    converted, exported = tmp_path / "converted", merged if merge else adapter
    to_hf = ["disagmoe-to-hf", "--ckpt", str(ck), "--model", str(hf_dir), "--out", str(converted)]
    assert convert.main(to_hf + (["--merged"] if merge else [])) == 0
    weights = "model.safetensors" if merge else peft_format.ADAPTER_FILE
    ours, theirs = (load_file(str(d / weights)) for d in (converted, exported))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert (converted / "tokenizer.json").is_file()
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    shutil.copy(hf_dir / "config.json", config_only)
    assert convert.main(to_hf[:4] + [str(config_only), "--out", str(tmp_path / "never")]) == 2
    assert "holds only LoRA adapters, and" in capfd.readouterr().err and not (tmp_path / "never").exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--lora-rank", 8, "--lora-targets", "attention"], "leave the expert side nothing to train"),
        (["--lora-rank", 8, "--lora-targets", "experts"], "leave the attention side nothing to train"),
        (["--lora-rank", 8, "--lora-targets", "attention,w9"], "names w9, which the qwen3_moe model has no"),
        (["--lora-rank", 0], "must be a positive integer"),
        (["--lora-alpha", 4], "--lora-alpha needs --lora-rank"),
        (["--export-hf-merged", "out"], "--export-hf-merged writes a LoRA run's model"),
    ],
    ids=["no-experts", "no-attention", "unknown-name", "rank", "alpha-alone", "merged-alone"],
)
def test_run_pretrain_refuses_bad_lora_settings_before_launch(tok_cache, capfd, tmp_path, argv, message) -> None:
    from tests.runs import assert_refused_before_launch

    argv = [str(tmp_path / a) if a == "out" else a for a in argv]
    assert_refused_before_launch(tok_cache, capfd, argv, message)


def test_colocated_lora_needs_expert_adapters() -> None:
    from disagmoe_ds.colocated.build import preflight_colocated

    cfg = ColocatedConfig(world_size=2, lora=LoraSettings(rank=8, targets=("attention",)))
    with pytest.raises(ConfigError, match="leave the expert side nothing to train"):
        preflight_colocated(MODELS / "tiny-qwen3-moe", cfg, {"zero_optimization": {"stage": 1}}, 2)


def test_lora_section_round_trips_and_refuses_bad_values() -> None:
    from disagmoe_ds.models import lora_settings as lora
    from disagmoe_ds.planner import lora as planned

    assert (lora.GROUPS, lora.DEFAULT_TARGETS) == (planned.TARGETS, planned.DEFAULT_TARGETS)  # one meaning, two homes
    section = {"rank": 8, "alpha": 16, "targets": ["attention", "experts"], "train_router": True}
    cfg = DisagMoEConfig.from_ds_config({"disagmoe": {"lora": section}})
    assert cfg.lora == LoraSettings(rank=8, alpha=16, train_router=True) and cfg.lora.scaling == 2.0
    assert DisagMoEConfig(**cfg.to_dict()) == cfg
    bad_sections = [
        ({"alpha": 4}, 'needs a "rank"'),
        ({"rank": 8, "ranks": 2}, "unknown key"),
        ({"rank": 8, "dropout": 1.5}, "dropout"),
        ({"rank": 8, "targets": []}, "targets"),
    ]
    for bad, message in bad_sections:
        with pytest.raises(ConfigError, match=message):
            DisagMoEConfig.from_ds_config({"disagmoe": {"lora": bad}})


def _state_bytes(rank: int, args: VerifyArgs) -> dict[str, float]:
    """One rank's parameters, gradients and optimizer state after a step, in bytes, by side."""
    from disagmoe_ds.afpipe.build import build_rank
    from disagmoe_ds.afpipe.verify_run import verify_costs
    from disagmoe_ds.parity.harness import build_for_verify, train_steps
    from disagmoe_ds.parity.reference import make_batches

    runtime = build_for_verify(build_rank, args, schedule_costs=verify_costs(args))
    role = runtime.role
    vocab = runtime.module.config.vocab_size
    feeds = role.is_attention and role.group == 0
    train_steps(runtime, args, lambda step: make_batches(args, vocab, step, role.index) if feeds else None)
    params = list(runtime.module.parameters())
    inner = runtime.engine.optimizer
    moments = [t for s in inner.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim()]
    total = sum(t.numel() * t.element_size() for t in params + moments)
    total += sum(p.numel() * p.element_size() for p in params if p.requires_grad)  # each trained one's gradient
    return {"attention" if role.is_attention else "ffn": float(total)}


def test_rank_state_is_the_planners() -> None:
    """The training state a LoRA rank holds (fp32, ZeRO 0: every base weight 4 B, every adapter 4 + 4 + 8 B) is what
    the planner's memory model, which the start banner prints, gives it."""
    from disagmoe_ds.launch.testing import run_ranks
    from disagmoe_ds.models.loading import load_config
    from disagmoe_ds.models.model_facts import num_experts_of
    from disagmoe_ds.planner.memory import rank_state_bytes

    lora = LoraSettings(rank=8)
    cfg = DisagMoEConfig(micro_batches=1, lora=lora)
    args = VerifyArgs(model=str(MODELS / "tiny-qwen3-moe"), cfg=cfg, steps=1, seq_len=8)
    measured = {k: v for r in run_ranks(_state_bytes, 2, args=(args,)) for k, v in r.items()}
    config = load_config(MODELS / "tiny-qwen3-moe")
    layout = cfg.layout(num_layers=config.num_hidden_layers, num_experts=num_experts_of(config))
    planned = rank_state_bytes(config.to_dict(), layout, precision="fp32", zero_stage_a=0, zero_stage_f=0, lora_rank=8,
                               lora_targets=lora.targets)  # fmt: skip
    assert measured == pytest.approx(planned, rel=0.01), (measured, planned)
