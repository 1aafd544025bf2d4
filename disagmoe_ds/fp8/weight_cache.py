"""FP8 weights cast once per optimizer step, not once per micro-batch and pass (Transformer Engine's
``is_first_microbatch``, done by scope).

A weight's FP8 copies (rowwise for the forward, of its transpose for the input gradient) depend only on the weight,
which changes only at the optimizer step; casting them in every call costs an HBM pass over every weight per
micro-batch, as much as the FP8 GEMMs save on an expert shard (performance-log §24). Inside ``cast_once_per_step``
(an executor's step or evaluation) each parameter's copies are made on first use and kept until the step changes the
weights (``weights_changed``, the executors' optimizer step) or the scope ends. Outside it nothing is kept.

What is kept: an expert projection's parameter used whole (the tensor an FP8 grouped GEMM gets is the parameter, a
view of it with the same shape and strides, or its last two dimensions swapped, as HF hands GPT-OSS's ``[e, in, out]``
weights over; linear layers cast in every call, ``fp8.projections``). A slice, or a
weight computed in the call (a LoRA merge, a dequantized frozen base), is cast each time, and so is every weight
inside a compiled region or a CUDA graph capture. Memory: two FP8 bytes per such parameter for the step (the
planner prices them, ``planner.memory``).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from disagmoe_ds.fp8.quantize import Quantized, quantize

_Key = tuple[int, bool]  # (id of the parameter, transposed)
_kept: dict[_Key, tuple[weakref.ref[nn.Parameter], Quantized]] | None = None


@contextmanager
def cast_once_per_step() -> Iterator[None]:
    """Keep each parameter's FP8 copies from its first use until ``weights_changed`` or the end of the scope."""
    global _kept
    outer, _kept = _kept, {}
    try:
        yield
    finally:
        _kept = outer


def weights_changed() -> None:
    """Drop every kept copy (the optimizer step is about to change the weights)."""
    if _kept is not None:
        _kept.clear()


def quantized_weight(weight: torch.Tensor, transposed: bool = False) -> Quantized:
    """``quantize(weight, -1)`` (``transposed``: of ``weight``'s last two dimensions swapped), kept for the step where
    ``weight`` is a whole parameter inside ``cast_once_per_step``."""
    rows = weight.transpose(-2, -1) if transposed else weight
    found = None if _kept is None or _inside_a_graph() else _whole_parameter(weight)
    if _kept is None or found is None:
        return quantize(rows, -1)
    owner, swapped = found
    key = (id(owner), transposed != swapped)  # the rows' orientation relative to the parameter's
    kept = _kept.get(key)
    if kept is not None and kept[0]() is owner:
        return kept[1]
    q = quantize(rows, -1)
    _kept[key] = (weakref.ref(owner), q)
    return q


def _inside_a_graph() -> bool:
    """Being compiled or captured: a graph must cast the weights itself (a kept copy would be a constant to it, stale
    after the next optimizer step)."""
    return torch.compiler.is_compiling() or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _whole_parameter(weight: torch.Tensor) -> tuple[nn.Parameter, bool] | None:
    """The parameter ``weight`` is, or is an identical view of (False), or is that parameter with its last two
    dimensions swapped (True); None for anything else (a slice, a computed weight)."""
    owner = weight if weight._base is None else weight._base
    if not isinstance(owner, nn.Parameter) or weight.storage_offset() != owner.storage_offset():
        return None
    for swapped, view in ((False, owner), (True, owner.transpose(-2, -1))):
        if view.shape == weight.shape and view.stride() == weight.stride():
            return owner, swapped
    return None
