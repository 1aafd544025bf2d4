"""The reference a verify run is held to: the single-process HF model trained on the same batches, with the
same loss, clipping and AdamW, and the tolerances of the comparison."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from disagmoe_ds.config import DisagMoEConfig
from disagmoe_ds.fp8.hf import to_fp8_reference
from disagmoe_ds.models.families import family_of
from disagmoe_ds.models.fp8_base import fp8_block_size
from disagmoe_ds.models.loading import build_meta_model, load_config, load_model
from disagmoe_ds.models.lora_settings import LoraSettings
from disagmoe_ds.models.partial_load import PretrainedWeights, place
from disagmoe_ds.models.parts import experts_in_fp8
from disagmoe_ds.models.skew import skew_router
from disagmoe_ds.models.split import hf_reference_loss

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# fp32: only the order of sums differs from the reference (expert partials, lane reduction); bf16: see README.
TOLERANCE = {"fp32": 1e-5, "bf16": 5e-2}


# Adam's first steps move each weight by about lr * g / (|g| + eps): where |g| is near eps, an ulp-level change of g
# (another summation order) changes the update by up to lr * dg / eps, and later steps inherit it. lr / eps = 10
# keeps that below the tolerance; the gradients of every step are compared directly as well.
ADAM_EPS = 1e-4


@dataclass(frozen=True)
class VerifyArgs:
    """One verification run; the defaults are the command line's."""

    model: str
    cfg: DisagMoEConfig
    zero: int = 0
    steps: int = 2
    dtype: str = "fp32"
    seq_len: int = 16
    micro_batch_size: int = 1
    clip: float = 1.0
    lr: float = 1e-3
    seed: int = 0
    skew: bool = False
    timeline: str | None = None
    packed: bool = False  # two documents per sequence: position ids restart mid-sequence (block-diagonal mask)
    zero_offload: bool = False  # DeepSpeed's ZeRO-Offload on every engine: optimizer state and step in host memory

    def ds_config(self) -> dict[str, Any]:
        config: dict[str, Any] = {
            "disagmoe": self.cfg.to_dict(),
            "zero_optimization": {"stage": self.zero}
            | ({"offload_optimizer": {"device": "cpu"}} if self.zero_offload else {}),
            "gradient_clipping": self.clip,
            # torch's AdamW, the reference's optimizer (DeepSpeed's FusedAdam would also JIT-compile on GPUs)
            "optimizer": {
                "type": "AdamW",
                "params": {"lr": self.lr, "weight_decay": 0.0, "eps": ADAM_EPS, "torch_adam": True},
            },
        }
        if self.dtype == "bf16":
            config["bf16"] = {"enabled": True}
        return config


def make_batches(args: VerifyArgs, vocab_size: int, step: int, lane: int) -> list[dict[str, torch.Tensor]]:
    """The K micro-batches lane ``lane`` trains on at ``step`` (deterministic, shared with the reference)."""
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + lane)
    batches = []
    for _ in range(args.cfg.micro_batches):
        ids = torch.randint(3, vocab_size, (args.micro_batch_size, args.seq_len), generator=gen)
        batch = {"input_ids": ids, "labels": ids.clone()}
        if args.packed:
            first = args.seq_len // 2 + 1
            positions = torch.cat([torch.arange(first), torch.arange(args.seq_len - first)])
            batch["position_ids"] = positions.expand(args.micro_batch_size, -1).contiguous()
        batches.append(batch)
    return batches


def reads_fp8_blocks(args: VerifyArgs) -> bool:
    """The run's model is a checkpoint in FP8 blocks (``models.fp8_base``), which the ranks read themselves as
    ``run_pretrain.py --init-from`` does (a LoRA run keeping its base in FP8); not with ``skew``, which the ranks'
    model must be given."""
    return not args.skew and fp8_block_size(load_config(args.model)) is not None


def load_for_verify(args: VerifyArgs):
    """The whole HF model of the run (the reference's, and the ranks' unless they read it themselves); a checkpoint
    in FP8 blocks with the exact values it stands for (read as the ranks read it, not by HF's quantizer)."""
    if reads_fp8_blocks(args):
        model = build_meta_model(args.model, dtype=DTYPES[args.dtype])
        place(model, model, torch.device("cpu"), weights=PretrainedWeights(args.model, model))
        return model
    model = load_model(args.model, dtype=DTYPES[args.dtype], seed=args.seed)
    if args.skew:
        skew_router(model, spread=True)
    return model


def reference(args: VerifyArgs, lanes: int) -> dict[str, Any]:
    """The single-process HF model trained on the same batches; with LoRA, under PEFT, from the adapters the ranks
    start from; with ``fp8``, its projections and experts' GEMMs in FP8 as the lever puts the ranks'
    (``fp8.hf.to_fp8_reference``: PEFT's adapters stay in high precision)."""
    model = load_for_verify(args)
    lora = args.cfg.lora
    if lora is not None:
        from disagmoe_ds.models import peft_format

        model = peft_format.peft_model(model, lora, peft_format.initial_adapters(model, lora, seed=args.seed))
    if getattr(args.cfg, "fp8", False):
        base = model if lora is None else model.get_base_model()
        fp8_experts = experts_in_fp8(model.config, args.cfg.fp8_expert_bf16_width)
        to_fp8_reference(base, family_of(model.config).router_attr, args.cfg.fp8_bf16_width, fp8_experts)
    model.train()
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=args.lr, weight_decay=0.0, eps=ADAM_EPS)
    losses, norms, grads = [], [], []
    vocab = model.config.vocab_size
    for step in range(args.steps):
        opt.zero_grad()
        total = 0.0
        count = lanes * args.cfg.micro_batches
        for lane in range(lanes):
            for batch in make_batches(args, vocab, step, lane):
                out = model(
                    input_ids=batch["input_ids"],
                    labels=batch["labels"],
                    position_ids=batch.get("position_ids"),
                    use_cache=False,
                )
                loss = hf_reference_loss(model if lora is None else model.get_base_model(), out)
                (loss / count).backward()
                total += loss.item() / count
        losses.append(total)
        norm = torch.nn.utils.clip_grad_norm_(trained, args.clip if args.clip > 0 else float("inf"))
        norms.append(norm.item())
        grads.append(
            _ours(
                {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None},
                model,
                lora,
            )
        )
        opt.step()
    params = _ours({n: p.detach().float() for n, p in model.named_parameters()}, model, lora)
    return {"losses": losses, "grad_norms": norms, "grads": grads, "params": params}


def _ours(tensors: dict[str, torch.Tensor], model, lora: LoraSettings | None) -> dict[str, torch.Tensor]:
    """The reference's tensors under the ranks' HF names (a PEFT model's renamed, its expert factors re-laid)."""
    if lora is None:
        return tensors
    from disagmoe_ds.models.peft_format import to_ours

    return to_ours(model, tensors)
