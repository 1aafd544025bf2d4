"""FP8 compute (``"disagmoe.fp8"``) in every mode against the single-process FP8 reference, and the pieces it needs.

The reference is the HF model converted as the lever converts the ranks' parts (``fp8.hf.to_fp8_reference``: the
same projections in FP8, HF's experts' GEMMs with per-expert scales, its routing its own), trained per micro-batch
with gradient accumulation, for one step. Every GEMM operand is quantized per row or per channel with a power-of-two
scale, and rounding to e4m3, a floating-point format, does not depend on a power-of-two scale except in its subnormal
range; so where a rank takes a scale over other rows than the reference does (a dW's per-channel scale over an SP
slice's tokens, a TP shard's columns of a row-parallel projection), only an element below 2^-6 of its scale can round
otherwise. What remains is the order of the fp32 sums (a gradient reaching a tensor from several consumers, partial
sums over expert slices or lanes), as in fp32, but before a quantization an ulp can carry a value across an e4m3
rounding boundary and move it by up to 1/16. Hence the tolerance: the loss, the gradients and their norm within the
fp32 one (1e-5) plus ``FLIP_SHARE`` of FP8's own error against the high-precision step (runs without such flips
agree to 1e-7). Updated parameters are not compared: Adam's normalised first update turns a flipped gradient
element near zero into a step of up to 10 x its change (``parity.reference.ADAM_EPS``), and the optimizer is the
non-FP8 parity tests' own. Against the high-precision reference the same runs differ by FP8's own error (losses by
about 1e-3, gradients by about 5e-3 on these models), so a run whose GEMMs silently left FP8 fails here.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from disagmoe_ds.afpipe.verify_run import run_verify
from disagmoe_ds.capabilities.rules import DEGREES, LEVERS, fired, refusals
from disagmoe_ds.capabilities.rules import Job as LeverJob
from disagmoe_ds.colocated.layout import ColocatedConfig
from disagmoe_ds.colocated.verify import ColocatedVerifyArgs, run_colocated_verify
from disagmoe_ds.fp8 import projections
from disagmoe_ds.fp8.modules import Fp8Linear, convert_linears
from disagmoe_ds.fp8.projections import fp8_grouped_mm, fp8_linear
from disagmoe_ds.fp8.quantize import round_trip
from disagmoe_ds.fp8.shapes import EXPERT_BF16_WIDTH
from disagmoe_ds.models.lora import LoraLinear
from disagmoe_ds.models.lora_settings import LoraSettings
from disagmoe_ds.parity.reference import TOLERANCE, VerifyArgs, reference
from tests.conftest import ROOT
from tests.parity_cases import ColocatedJob, Job

MODELS = ROOT / "hf_models"
# Of FP8's own error: the e4m3 rounding flips another fp32 summation order may cause (seen up to 0.1 with LoRA, whose
# adapter and base gradients reach a projection's input in another order than PEFT's; a run whose GEMMs left FP8: ~1).
FLIP_SHARE = 0.25
LORA = {"lora": LoraSettings(rank=8, init_lora_weights=False)}  # a non-zero update from the start

# Every mode's FP8 step: K = 2 and one or two lanes, so that the gradient's 1/(lanes x K) is a power of two too; and
# "fp8_bf16_width" and "fp8_expert_bf16_width" 0, every projection and expert in FP8 (the tiny models' are all narrower
# than the shape rules' widths), but where a case names the experts' width.
EVERY_WIDTH = {"fp8_bf16_width": 0, "fp8_expert_bf16_width": 0}
DISAGGREGATED = [
    Job(M=2, N=4, p=2, K=2, resend=True, skew=True),  # two ep ranks per F-group, depth 2, resend; skewed routing
    Job(family="deepseek-v3", M=2, N=2, K=2, extra={"split_backward": True, "selective_recompute": True},
        label="split-selective"),  # MLA, shared experts; B/W split, the experts' recomputed middle
    Job(M=2, N=2, K=2, extra=LORA, label="lora"),
    Job(M=2, N=4, node=2, K=2, extra=LORA, label="lora"),  # FP8 rows to a node's gateway, on to its ranks in bf16
    Job(M=2, N=2, K=2, extra={"sequence_parallel": 2}, label="sp2"),
    Job(M=2, N=2, K=2, extra={"tensor_parallel": 2}, label="tp2"),
]  # fmt: skip
COLOCATED = [
    ColocatedJob(K=2, skew=True),  # skewed routing: empty experts, rows of denormal gradients (scale_of's floor)
    ColocatedJob(K=2, extra=LORA, label="lora"),
    ColocatedJob(K=2, extra={"fp8_cast_per_call": True}, label="cast-per-call"),  # no weight copies kept
    # the experts' rule (default width): bf16 grouped GEMMs on the FP8 rows, as the reference's experts
    ColocatedJob(K=2, extra={"fp8_expert_bf16_width": EXPERT_BF16_WIDTH}, label="bf16-experts"),
]


def _assert_fp8_parity(summary: dict, args: VerifyArgs, lanes: int) -> None:
    assert args.steps == 1 and summary["tolerance"] == TOLERANCE["fp32"]
    fp8, high = (reference(dataclasses.replace(args, cfg=dataclasses.replace(args.cfg, fp8=on)), lanes)
                 for on in (True, False))  # fmt: skip
    off = {"loss": abs(fp8["losses"][0] - high["losses"][0]), "grads": _max_diff(fp8["grads"][0], high["grads"][0]),
           "grad_norm": abs(fp8["grad_norms"][0] - high["grad_norms"][0])}  # fmt: skip
    assert 100 * TOLERANCE["fp32"] < off["loss"] < 2e-2, f"FP8 against the high-precision reference: {off}"
    ours = summary["max_abs_diff"]
    bound = {key: FLIP_SHARE * value + TOLERANCE["fp32"] for key, value in off.items()}
    assert all(ours[key] is None or ours[key] <= bound[key] for key in bound), (ours, off)


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[name] - b[name]).abs().max().item() for name in b)


@pytest.mark.parametrize("case", DISAGGREGATED, ids=str)
def test_disaggregated_fp8_step_equals_the_fp8_reference(case: Job) -> None:
    cfg = case.config(transport="rendezvous", fp8=True, **EVERY_WIDTH)
    args = VerifyArgs(str(MODELS / f"tiny-{case.family}"), cfg, zero=1, steps=1, seq_len=8, skew=case.skew)
    _assert_fp8_parity(run_verify(args, timeout_s=240), args, args.cfg.batch_lanes)


@pytest.mark.parametrize("case", COLOCATED, ids=str)
def test_colocated_fp8_step_equals_the_fp8_reference(case: ColocatedJob) -> None:
    cfg = ColocatedConfig(
        world_size=case.W, ep_size=case.ep, micro_batches=case.K, fp8=True, **(EVERY_WIDTH | case.extra)
    )
    args = ColocatedVerifyArgs(str(MODELS / f"tiny-{case.family}"), cfg, zero=1, steps=1, seq_len=8, skew=case.skew)
    _assert_fp8_parity(run_colocated_verify(args, timeout_s=240), args, cfg.lanes)


def _count_gemms(monkeypatch) -> dict[str, int]:
    calls = {"scaled_mm": 0, "scaled_grouped_mm": 0, "grouped_weight_grad": 0}
    for name in calls:
        original = getattr(projections, name)

        def counted(*a, _name=name, _original=original, **k):
            calls[_name] += 1
            return _original(*a, **k)

        monkeypatch.setattr(projections, name, counted)
    return calls


def test_each_backward_pass_runs_only_the_fp8_gemms_it_reaches(monkeypatch) -> None:
    """A split backward's B (input gradients) runs no weight GEMM, its W (weights) no input GEMM, and together they
    give the whole backward's gradients."""
    torch.manual_seed(0)
    x = torch.randn(12, 32, requires_grad=True)
    w, w_e = torch.randn(48, 32, requires_grad=True), torch.randn(2, 32, 48, requires_grad=True)
    offsets = torch.tensor([5, 12], dtype=torch.int32)
    y = fp8_grouped_mm(fp8_linear(x, w), w_e, offsets).square().sum()
    whole = torch.autograd.grad(y, [x, w, w_e], retain_graph=True)
    calls = _count_gemms(monkeypatch)
    (dx,) = torch.autograd.grad(y, [x], retain_graph=True)
    assert calls == {"scaled_mm": 1, "scaled_grouped_mm": 1, "grouped_weight_grad": 0}  # the two dx GEMMs
    dw, dw_e = torch.autograd.grad(y, [w, w_e], retain_graph=True)  # w's path runs through the grouped dx
    assert calls == {"scaled_mm": 2, "scaled_grouped_mm": 2, "grouped_weight_grad": 1}
    for split, full in zip((dx, dw, dw_e), whole, strict=True):
        assert torch.equal(split, full)


def test_the_lever_swaps_classes_and_keeps_every_name() -> None:
    """Plain Linears become Fp8Linear under the same state_dict names; gates, what ``skip`` holds and misaligned
    widths stay; LoRA's base product switches; a Linear subclass without a switch is refused."""
    block = nn.ModuleDict({
        "q_proj": nn.Linear(32, 48), "gate": nn.Linear(32, 16), "router": nn.Linear(32, 16), "odd": nn.Linear(32, 8),
        "lora": LoraLinear(nn.Linear(32, 32), rank=4, scaling=2.0, dropout=0.0),
    })  # fmt: skip
    names = list(block.state_dict())
    assert convert_linears(block, skip=[block["router"]], bf16_width=0) == 2
    assert list(block.state_dict()) == names
    kinds = {name: (type(m).__name__, getattr(m, "fp8", False)) for name, m in block.items()}
    assert kinds == {"q_proj": ("Fp8Linear", True), "gate": ("Linear", False), "router": ("Linear", False),
                     "odd": ("Linear", False), "lora": ("LoraLinear", True)}  # fmt: skip
    x = torch.randn(3, 32)
    assert torch.equal(block["q_proj"](x), fp8_linear(x, block["q_proj"].weight, block["q_proj"].bias))
    assert isinstance(block["q_proj"], Fp8Linear)

    class Custom(nn.Linear):
        pass

    with pytest.raises(TypeError, match="no FP8 switch"):
        convert_linears(nn.Sequential(Custom(32, 32)), bf16_width=0)


def test_projections_too_narrow_for_fp8_to_pay_stay_in_bf16_judged_by_their_whole_shape() -> None:
    """The shape rule (performance-log section 26): Qwen3-30B-A3B's attention projections (H = 2,048) stay bf16,
    DeepSeek-V3's output projection (16,384 -> 7,168) goes FP8; a TP shard is judged by the projection it was cut
    from, as the reference and the planner see it; ``bf16_width`` 0 converts every aligned one."""
    from disagmoe_ds.models.tensor_parallel import Shard

    def block() -> nn.ModuleDict:
        shapes = {"q_proj": (2048, 4096), "k_proj": (2048, 512), "o_proj": (16384, 7168), "wide": (4096, 4096)}
        return nn.ModuleDict({name: nn.Linear(*shape, bias=False, device="meta") for name, shape in shapes.items()})

    narrow = block()
    assert convert_linears(narrow) == 2
    assert {name for name, m in narrow.items() if isinstance(m, Fp8Linear)} == {"o_proj", "wide"}
    assert convert_linears(block(), bf16_width=0) == 4
    shard = nn.Linear(4096, 2048, bias=False, device="meta")  # a column shard of "wide": 2,048 of its 4,096 outputs
    shard.weight.disagmoe_tp = Shard(0, 1, 2)
    assert convert_linears(nn.ModuleDict({"q_proj": shard})) == 1


def test_families_whose_projections_fp8_does_not_cover_are_refused_in_one_line() -> None:
    for family, what in (("gpt_oss", "experts run HF's own module"), ("deepseek_v4", "grouped output projection")):
        (error,) = refusals(LeverJob.of(family, fp8=True))
        assert str(error).startswith(f'"disagmoe.fp8" does not work with the {family} model yet: ') and what in str(
            error
        )
    others = {lever: 2 if lever in DEGREES else True for lever in LEVERS if lever != "fp8"}
    assert not [r for r in fired(LeverJob.of("qwen3_moe", fp8=True, **others)) if "fp8" in (r.lever, r.beside)]


def test_an_expert_shard_on_hf_s_module_computes_as_its_grouped_path_in_fp8() -> None:
    """The shard's fallback (HF's experts module under ``fp8.hf.Fp8Experts``) and its grouped FP8 GEMMs agree."""
    from disagmoe_ds.models.loading import load_model
    from disagmoe_ds.models.parts import ExpertStage

    model = load_model(MODELS / "tiny-qwen3-moe", dtype=torch.float32, seed=0)
    shard = ExpertStage(model, (1,), 0, 4).shard(1)  # experts 0-3 of 8: ids 4 are the sentinel
    shard.fp8 = True
    torch.manual_seed(0)
    x = round_trip(torch.randn(9, model.config.hidden_size)).requires_grad_()  # the rows as the lever sends them
    idx, w = torch.randint(0, 5, (9, 2)), torch.rand(9, 2)
    grouped, hf = shard(x, idx, w), shard.forward_hf(x, idx, w)
    torch.testing.assert_close(grouped, hf, rtol=0, atol=1e-6)
    g = torch.randn_like(grouped)
    for a, b in zip(torch.autograd.grad(grouped, [x, *shard.parameters()], g),
                    torch.autograd.grad(hf, [x, *shard.parameters()], g), strict=True):  # fmt: skip
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    shard.fp8 = False
    assert (shard(x, idx, w) - grouped).abs().max() > 1e-4  # FP8's error: the switch is what changed it


def test_the_experts_run_fp8_only_where_their_width_pays() -> None:
    """The experts' shape rule (``fp8.shapes.experts_fp8_pay``, performance-log section 33): DeepSeek-V3's and
    Mixtral's experts run FP8, Qwen3-30B-A3B's and Qwen3-235B-A22B's stay bf16 (FP8 measured slower there), as do the
    tiny models' unless ``"fp8_expert_bf16_width"`` is 0; ``fp8_stage`` switches an expert stage's shards by it."""
    from disagmoe_ds.models.loading import load_config, load_model
    from disagmoe_ds.models.parts import ExpertStage, experts_in_fp8, fp8_stage

    verdicts = {name: experts_in_fp8(load_config(MODELS / name)) for name in
                ("DeepSeek-V3", "Mixtral-8x7B", "Qwen3-30B-A3B", "Qwen3-235B-A22B", "tiny-qwen3-moe")}  # fmt: skip
    assert verdicts == {"DeepSeek-V3": True, "Mixtral-8x7B": True, "Qwen3-30B-A3B": False, "Qwen3-235B-A22B": False,
                        "tiny-qwen3-moe": False}  # fmt: skip
    model = load_model(MODELS / "tiny-qwen3-moe", dtype=torch.float32, seed=0)
    for width, fp8 in ((EXPERT_BF16_WIDTH, False), (0, True)):
        stage = ExpertStage(model, (1, 2), 0, 4)
        fp8_stage(stage, expert_bf16_width=width)
        assert [stage.shard(i).fp8 for i in (1, 2)] == [fp8, fp8]


def test_the_run_says_before_launch_which_gemms_run_fp8() -> None:
    from types import SimpleNamespace

    from disagmoe_ds.config import DisagMoEConfig
    from disagmoe_ds.models.loading import load_config
    from disagmoe_ds.train.progress import _fp8_lines

    def line(model: str, **cfg) -> str:
        args = SimpleNamespace(cfg=DisagMoEConfig(**cfg), dtype="bf16")
        (text,) = _fp8_lines(args, load_config(MODELS / model)) or ["-"]
        return text

    assert line("DeepSeek-V3", fp8=True).startswith(
        "fp8: the routed experts' GEMMs in FP8 (harmonic width H*I/(H+I) = 1,593"
    )
    assert 'in bf16 (harmonic width H*I/(H+I) = 559 <= "fp8_expert_bf16_width" 1,536' in line("Qwen3-30B-A3B", fp8=True)
    assert "GEMMs in FP8" in line("Qwen3-30B-A3B", fp8=True, fp8_expert_bf16_width=0)
    assert line("Qwen3-30B-A3B") == "-"


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_the_flag_turns_the_lever_on_in_either_mode(mode: str) -> None:
    from disagmoe_ds.train.args import parse_args

    def fp8(*argv: str) -> bool:
        return parse_args(["--mode", mode, *argv], root=ROOT, description="")[0].cfg.fp8

    assert fp8("--fp8") and not fp8()
