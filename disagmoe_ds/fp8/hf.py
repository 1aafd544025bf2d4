"""HF's own modules computing with the FP8 recipe: an experts module's GEMMs (``Fp8Experts``) and a whole HF model
converted as the lever converts the ranks' parts (``to_fp8_reference``): the single-process FP8 reference the parity
tests hold both modes to, and the path an expert shard takes where it calls HF's module (``ExpertShard.forward_hf``).

The experts' GEMMs are intercepted inside their forward by a ``TorchFunctionMode``: ``F.grouped_mm`` (transformers'
``grouped_mm`` experts implementation, seen as ``torch._grouped_mm``) and ``F.linear`` (its ``eager`` one, a GEMM per
expert) become ``fp8_grouped_mm`` / ``fp8_linear``, the same rowwise recipe with per-expert scales as the ranks'
grouped GEMMs; the routing, the activation and the routing weight (applied after the down projection, as the FP8 ranks
apply it) stay HF's. Under PEFT's ``target_parameters`` the experts see ``W + s * lhs @ rhs`` (one
``torch.baddbmm``): the mode keeps the two terms apart, the base ``W`` in FP8 and the update in high precision, as the
ranks compute adapters.

The experts' input rows are the FP8 values the ranks dispatch (``quantize.round_trip``): the lever sends the routed
tokens in FP8 in every layout (``comm.messages.Tokens``, ``comm.dispatch``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from disagmoe_ds.fp8.modules import convert_linears
from disagmoe_ds.fp8.projections import fp8_grouped_mm, fp8_linear
from disagmoe_ds.fp8.quantize import round_trip
from disagmoe_ds.fp8.shapes import BF16_WIDTH

_PARTS = "_fp8_lora_parts"  # a merged LoRA weight's (base, update), kept on the tensor and its views
_VIEWS = (torch.Tensor.__getitem__, torch.Tensor.transpose)
_PEFT_ADAPTERS = ("lora_A", "lora_B")  # PEFT's ModuleDicts of adapter Linears: they stay in high precision
_GROUPED = (F.grouped_mm, torch._grouped_mm)  # the wrapper does not dispatch to modes itself: its op does


class Fp8Experts(TorchFunctionMode):
    """An HF experts module's GEMMs in FP8 while it is entered (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, w = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            return _product(w, lambda base: fp8_linear(x, base, bias), lambda update: F.linear(x, update))
        if func in _GROUPED:  # (x, w^T, offs=...): HF passes the [e, N, K] weight transposed
            x, w_t, offs = args[0], args[1], kwargs.get("offs", args[2] if len(args) > 2 else None)
            return _product(
                w_t,
                lambda base: fp8_grouped_mm(x, base.transpose(-2, -1), offs),
                lambda update: F.grouped_mm(x, update, offs=offs),
            )
        out = func(*args, **kwargs)
        if func is torch.baddbmm:  # PEFT's merge: W + alpha * lhs @ rhs
            w, lhs, rhs = args[:3]
            setattr(out, _PARTS, (w, torch.bmm(lhs, rhs) * kwargs.get("alpha", 1)))
        elif func in _VIEWS and hasattr(args[0], _PARTS):
            setattr(out, _PARTS, tuple(func(part, *args[1:], **kwargs) for part in getattr(args[0], _PARTS)))
        return out


def _product(
    w: torch.Tensor, fp8: Callable[[torch.Tensor], torch.Tensor], high: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    parts = getattr(w, _PARTS, None)
    if parts is None:
        return fp8(w)
    base, update = parts
    return fp8(base) + high(update)


def compute_experts_on_fp8_rows(experts: nn.Module, fp8_gemms: bool = True) -> None:
    """Make ``experts`` (an HF experts module, whose forward takes the routed hidden states first) run its forward on
    the FP8 values of its input rows (as the lever sends them), under ``Fp8Experts`` where ``fp8_gemms``."""
    forward = experts.forward

    def fp8_forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        with Fp8Experts() if fp8_gemms else contextlib.nullcontext():
            return forward(round_trip(hidden_states), *args, **kwargs)

    experts.forward = fp8_forward


def to_fp8_reference(
    model: nn.Module, router_attr: str, bf16_width: int = BF16_WIDTH, fp8_experts: bool = True
) -> nn.Module:
    """``model`` (an HF causal LM, or PEFT's base model of one; ``router_attr``: its family's router attribute) with
    every decoder layer's projections in FP8 as the lever puts the ranks' (``fp8.modules.convert_linears`` at
    ``bf16_width``: not the router, not the LM head, not PEFT's adapters, not those too narrow to pay), its experts
    modules on FP8 rows and, with ``fp8_experts`` (``models.parts.experts_in_fp8``), their GEMMs under
    ``Fp8Experts``. In place."""
    layers = model.get_submodule("model.layers")  # the decoder layers (nn.Module's attributes are typed loosely)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(model).__name__}.model.layers is no ModuleList: not an HF causal LM")
    for layer in layers:
        experts = getattr(layer.mlp, "experts", None)
        skip = [m for name, m in layer.named_modules() if name.rsplit(".", 1)[-1] in _PEFT_ADAPTERS]
        if experts is not None:
            skip += [experts, getattr(layer.mlp, router_attr)]
        convert_linears(layer, skip=skip, bf16_width=bf16_width)
        if experts is not None:
            compute_experts_on_fp8_rows(experts, fp8_experts)
    return model
