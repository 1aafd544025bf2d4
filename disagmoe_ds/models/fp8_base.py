"""Checkpoints shipped in FP8 with block scales (DeepSeek-V3 / V3.2's layout), and a LoRA run's base kept so.

Such a checkpoint stores each quantized weight ``...weight`` as e4m3 beside a float32 ``...weight_scale_inv`` per
block, its ``config.json`` saying ``"quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
"weight_block_size": [bn, bk], "activation_scheme": "dynamic"}`` ([128, 128] for DeepSeek's). The ranks read it
partially like any safetensors checkpoint (``partial_load``): a weight trained in full is dequantized exactly on
reading (``fp8.blocks.dequantize_blocks``, then the model's dtype); with LoRA, ``keep_base_fp8`` turns every
quantized projection of the meta model (attention side: ``nn.Linear``; routed experts: the fused gate/up and down
tensors) into frozen FP8 buffers (``fp8.frozen``) before the ranks cut it, so each rank allocates and reads its base
as e4m3 plus scales, about one byte per parameter, and never holds a high-precision copy of it.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from disagmoe_ds.errors import CheckpointError, ConfigError
from disagmoe_ds.fp8.frozen import freeze_linear, held_bytes, held_weights, hold_block_scaled
from disagmoe_ds.models.hf_model import causal_lm
from disagmoe_ds.models.lora_settings import EXPERT_PROJECTIONS


class QuantizedCheckpoint(Protocol):
    """What ``keep_base_fp8`` reads of a checkpoint (``partial_load.PretrainedWeights``)."""

    @property
    def block(self) -> tuple[int, int] | None: ...

    def quantized(self, name: str) -> bool:
        """Whether the checkpoint stores in-memory tensor ``name`` in FP8 blocks."""
        ...


def fp8_block_size(config: Any) -> tuple[int, int] | None:
    """The ``(rows, columns)`` block of a block-scaled e4m3 checkpoint's ``quantization_config``; None for a
    checkpoint without one, or quantized otherwise (``from_pretrained`` loads those, as before). A block-scaled FP8
    config in another format is refused in one line: nothing here reads it."""
    quant = getattr(config, "quantization_config", None)
    if quant is not None and not isinstance(quant, dict):
        quant = quant.to_dict()
    if not quant or quant.get("quant_method") != "fp8" or quant.get("weight_block_size") is None:
        return None
    block = quant["weight_block_size"]
    fmt, activations = quant.get("fmt", "e4m3"), quant.get("activation_scheme", "dynamic")
    shape_ok = isinstance(block, list | tuple) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)
    if fmt != "e4m3" or activations != "dynamic" or not shape_ok:
        raise CheckpointError(
            f"the checkpoint's quantization_config {quant} is not one this reads: block-scaled FP8 needs "
            f'"fmt": "e4m3", "activation_scheme": "dynamic" and "weight_block_size": [rows, columns]'
        )
    return int(block[0]), int(block[1])


def keep_base_fp8(model: nn.Module, weights: QuantizedCheckpoint) -> int:
    """Make every weight of ``model``'s decoder layers that ``weights`` stores in FP8 a frozen FP8 buffer pair, in
    place (``model`` on the meta device, before any rank cuts it); returns how many. The routed experts' fused
    gate/up tensor concatenates the gate's and the up projection's scales along N, which needs their rows (the
    expert intermediate size) to be whole blocks: refused in one line otherwise."""
    block = weights.block
    assert block is not None
    lm = causal_lm(model)
    dtype = next(lm.parameters()).dtype
    held = 0
    for i, layer in enumerate(lm.model.layers):
        for name, module in layer.named_modules():
            hf = f"model.layers.{i}.{name}"
            if type(module) is nn.Linear and weights.quantized(f"{hf}.weight"):
                freeze_linear(module, block, dtype)
                held += 1
            elif name.endswith("experts"):
                held += _keep_experts(module, hf, weights, block, dtype)
    return held


def _keep_experts(experts: nn.Module, hf: str, weights: QuantizedCheckpoint, block, dtype: torch.dtype) -> int:
    held = 0
    for proj in EXPERT_PROJECTIONS:
        param = experts._parameters.get(proj)
        transposed = getattr(experts, "is_transposed", False)  # GPT-OSS's layout: computed by HF's module, dequantized
        if param is None or param.dim() != 3 or transposed or not weights.quantized(f"{hf}.{proj}"):
            continue
        if proj == "gate_up_proj" and (param.shape[1] // 2) % block[0]:
            raise CheckpointError(
                f"{hf}.{proj}: the experts' intermediate size {param.shape[1] // 2} is not a multiple of the FP8 "
                f"block's {block[0]} rows, so the gate's and up projection's block scales cannot be fused; "
                "dequantize the checkpoint (train without LoRA) or re-quantize it"
            )
        hold_block_scaled(experts, proj, block, dtype)
        held += 1
    return held


def check_fp8_base(fp8_compute: bool) -> None:
    """A LoRA run over an FP8 checkpoint keeps its base in FP8 blocks; the FP8 compute lever (rowwise scales on
    every GEMM operand) does not take such a weight yet: refused in one line."""
    if fp8_compute:
        raise ConfigError(
            '"disagmoe.fp8" (FP8 compute) does not work yet with LoRA over a checkpoint in FP8 blocks, whose frozen '
            "base stays in FP8 and multiplies in the model's dtype: drop --fp8"
        )


def base_fp8_line(module: nn.Module) -> str | None:
    """The run log's line on a rank's frozen FP8 base (None: it holds none)."""
    held = held_weights(module)
    if not held:
        return None
    params = sum(w.data.numel() for w in held.values())
    size = held_bytes(module)
    return (
        f"the LoRA base stays FP8 (e4m3, block scales): {len(held)} weights, {params:,} parameters in "
        f"{size / 2**20:,.1f} MiB on this rank ({size / params:.3f} bytes per parameter)"
    )
