"""Frozen FP8 base weights held by modules: a module's weight ``name`` becomes two non-persistent buffers, ``name``
(e4m3) and ``name + "_scale_inv"`` (its block scales, ``blocks.BlockScaled``), under the checkpoint's own names.

Buffers, not parameters: no optimizer, ZeRO partition or DeepSpeed broadcast ever sees them, and DeepSpeed's
mixed-precision cast leaves buffers alone (it would round float32 scales to bf16). Non-persistent: a checkpoint
leaves them out, as it leaves out every frozen base weight of a LoRA run (they come from ``--init-from``).
``BlockFp8Linear``: an ``nn.Linear`` whose weight is held so (made by a class swap, as the FP8 lever swaps).

>>> lin = nn.Linear(32, 16, bias=False)
>>> freeze_linear(lin, (16, 16), torch.float32)
>>> type(lin).__name__, [n for n, _ in lin.named_buffers()], list(lin.state_dict())
('BlockFp8Linear', ['weight', 'weight_scale_inv'], [])
"""

from __future__ import annotations

import math

import torch
from torch import nn

from disagmoe_ds.fp8.blocks import BlockScaled, block_linear
from disagmoe_ds.fp8.quantize import E4M3

SCALE_SUFFIX = "_scale_inv"  # HF's (and DeepSeek's) name of a quantized weight's block scales
_FROZEN = "_fp8_frozen"  # a module's attribute: {weight name: (block, the model's dtype)}


def hold_block_scaled(
    module: nn.Module, name: str, block: tuple[int, int], dtype: torch.dtype, value: BlockScaled | None = None
) -> None:
    """Replace ``module``'s weight ``name`` by FP8 buffers of its shape (``value``'s, else uninitialised ones on the
    weight's device: a meta model's stay on meta); ``dtype``: the model's, which the weight had."""
    if value is None:
        old = getattr(module, name)
        rows, cols = old.shape[-2:]
        scales = (*old.shape[:-2], math.ceil(rows / block[0]), math.ceil(cols / block[1]))
        value = BlockScaled(
            torch.empty(old.shape, dtype=E4M3, device=old.device),
            torch.empty(scales, dtype=torch.float32, device=old.device),
            block,
        )
    if name in module._parameters:
        del module._parameters[name]
    elif hasattr(module, name) and name not in module._buffers:
        delattr(module, name)
    module.register_buffer(name, value.data, persistent=False)
    module.register_buffer(name + SCALE_SUFFIX, value.scale_inv, persistent=False)
    setattr(module, _FROZEN, {**getattr(module, _FROZEN, {}), name: (block, dtype)})


def block_scaled(module: nn.Module, name: str) -> BlockScaled | None:
    """``module``'s weight ``name`` as it holds it in FP8, or None where it holds it as a parameter."""
    frozen = getattr(module, _FROZEN, {})
    if name not in frozen:
        return None
    return BlockScaled(getattr(module, name), getattr(module, name + SCALE_SUFFIX), frozen[name][0])


def weight_of(module: nn.Module, name: str) -> torch.Tensor | BlockScaled:
    """``module``'s weight ``name``: its parameter, or its FP8 buffers."""
    held = block_scaled(module, name)
    return getattr(module, name) if held is None else held


def model_dtype_of(module: nn.Module, name: str) -> torch.dtype:
    """The dtype the model computes weight ``name`` in (an FP8 one's model dtype)."""
    frozen = getattr(module, _FROZEN, {})
    return frozen[name][1] if name in frozen else getattr(module, name).dtype


def dequantized(module: nn.Module, name: str) -> torch.Tensor:
    """Weight ``name`` in the model's dtype (an FP8 one dequantized: a new tensor)."""
    held = block_scaled(module, name)
    return getattr(module, name) if held is None else held.dequantize(model_dtype_of(module, name))


def copy_held(source: nn.Module, target: nn.Module, name: str, value: BlockScaled | None = None) -> None:
    """Give ``target`` the FP8 weight ``name`` that ``source`` holds (``value``: another value of it, a slice)."""
    held = block_scaled(source, name)
    assert held is not None
    hold_block_scaled(target, name, held.block, model_dtype_of(source, name), held if value is None else value)


def held_weights(root: nn.Module) -> dict[str, BlockScaled]:
    """Every FP8 weight under ``root``, by its qualified name."""
    found = {}
    for prefix, module in root.named_modules():
        for name in getattr(module, _FROZEN, {}):
            held = block_scaled(module, name)
            assert held is not None
            found[f"{prefix}.{name}" if prefix else name] = held
    return found


def held_values(root: nn.Module) -> dict[str, torch.Tensor]:
    """Every FP8 weight under ``root`` dequantized (float32), by its qualified name: the values a frozen base stands
    for, where a parameter's value would be read (a verify's comparison)."""
    return {name: held.dequantize() for name, held in held_weights(root).items()}


def held_bytes(root: nn.Module) -> int:
    """Bytes of the FP8 weights under ``root``: their e4m3 data and float32 scales."""
    return sum(w.data.nbytes + w.scale_inv.nbytes for w in held_weights(root).values())


class BlockFp8Linear(nn.Linear):
    """A frozen ``nn.Linear`` whose weight is block-scaled FP8 (``freeze_linear``); its bias stays a parameter."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = block_scaled(self, "weight")
        assert weight is not None
        return block_linear(x, weight, self.bias)


def freeze_linear(linear: nn.Linear, block: tuple[int, int], dtype: torch.dtype) -> None:
    """Make a plain ``nn.Linear`` a ``BlockFp8Linear`` in place (uninitialised FP8 buffers of its shape)."""
    if type(linear) is not nn.Linear:
        raise TypeError(f"{type(linear).__name__} is no plain nn.Linear: its forward would not read an FP8 weight")
    hold_block_scaled(linear, "weight", block, dtype)
    linear.__class__ = BlockFp8Linear
