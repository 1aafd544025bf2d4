"""Tensor parallelism inside an A-lane (Megatron-style, with sequence parallelism): t ranks hold one micro-batch's
sequence in slices, as ``models.sequence_parallel``'s ranks do, every attention module's heads in shards and every
dense or shared-expert MLP's intermediate columns in shards.

Legend: B micro-batch size, S the whole sequence, S_l = S / t one rank's slice, H hidden, t the TP degree.

Outside these blocks a TP rank is an SP rank: the norms, router, its exchange with the experts, the residual hand-off
and the head run on its own slice, with ``SequenceParallel``'s slicing, loss shares and router statistics. Around
each block the normed slices are all-gathered into the whole sequence (backward: reduce-scattered); the block runs
HF's own forward with its input projections cut to the rank's part (attention: query, key and value, MLA's
``q_b_proj``/``q_proj`` and ``kv_b_proj``, by head, with the per-head sinks of GPT-OSS; MLP: gate and up by
intermediate column) and its output projection to the matching input columns; the partial outputs are
reduce-scattered back to slices (backward: all-gathered) and the output projection's bias is added once, on the
slice. MLA's low-rank input projections and per-head-dim q/k norms stay whole. The rotary embeddings and masks are
the whole sequence's. The embedding, head and routers stay whole on every rank.

With Ulysses too (an A-lane of s x t ranks: s TP groups of t consecutive lanes, the lanes of one TP rank across them
an SP group), a rank's slice is S / (s t) tokens, its TP group's gather is its SP rank's S / s tokens, and Ulysses
trades those for all S positions of the TP rank's heads / s around the core (``sequence_parallel``); the rotary
embeddings are then of the S / s positions.

Gradients. A shard's gradient is whole on its rank (the gather brings every token to it); its replicas are the lanes
of the same TP rank, which form an attention rank's DeepSpeed data-parallel group. A replicated parameter's gradient
covers the rank's slice (or, inside attention, its heads), so the TP group sums them (``TensorParallelGrads``) before
DeepSpeed averages over the replicas. The loss shares are scaled by t as with sequence parallelism (the experts'
gradients sum over every lane), and the attention side's gradients by 1/t (DeepSpeed averages over d / t replicas).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from disagmoe_ds.capabilities.rules import Job, check
from disagmoe_ds.errors import LayoutError
from disagmoe_ds.fp8.modules import linear
from disagmoe_ds.models.context import LayerContext, build_context
from disagmoe_ds.models.families import family_of
from disagmoe_ds.models.sequence_parallel import SequenceParallel, check_sequence_parallel

COLUMN = ("q_proj", "k_proj", "v_proj", "q_b_proj", "kv_b_proj")  # output rows by head: cut along dim 0
ROW = "o_proj"  # input columns by head: cut along dim 1
PER_HEAD = ("sinks",)  # one value per query head
GLU_COLUMN = ("gate_proj", "up_proj")  # a gated MLP's intermediate columns: cut along dim 0
GLU_ROW = "down_proj"  # its input columns: cut along dim 1


@dataclass(frozen=True)
class Shard:
    """The mark on a sharded parameter: part ``rank`` of ``size`` equal parts of HF's tensor along ``dim``."""

    dim: int
    rank: int
    size: int


def shard_of(param: torch.Tensor) -> Shard | None:
    """The shard a parameter is (None: whole, replicated over the TP group)."""
    return getattr(param, "disagmoe_tp", None)


@dataclass(frozen=True)
class TensorParallel(SequenceParallel):
    """This rank's place in the lanes of its micro-batch (``group``, ``size``, ``rank``: its slice, as a
    ``SequenceParallel``) and in its TP group (``shards``: shard ``shards.rank`` of every attention module's heads
    and every gated MLP's intermediate columns). Without Ulysses both are the TP group; with it (s x t lanes a
    micro-batch) a TP group's t slices are consecutive, so its gather is the SP rank's part of the sequence."""

    shards: SequenceParallel

    def gather(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim`` (1: the whole sequence from the slices; a token-wise block
        may take any order of tokens); backward: this rank's part of the summed gradients."""
        return _Pair.apply(
            x, partial(self.shards.gather_along, dim=dim), partial(self.shards.reduce_scatter_along, dim=dim)
        )

    def scatter(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's part along ``dim`` of the sum of every rank's partial ``x`` (backward: the gradient
        gathered)."""
        return _Pair.apply(
            x, partial(self.shards.reduce_scatter_along, dim=dim), partial(self.shards.gather_along, dim=dim)
        )

    def context(self, stage, h_BSH: torch.Tensor, positions_BS: torch.Tensor, full_positions_BS) -> LayerContext:
        """What the attention modules see: the rotary embeddings of the TP group's part of the sequence (all of it
        without Ulysses) and the whole sequence's masks; ``positions_BS``: the slice's, ``full_positions_BS`` the
        whole micro-batch's (None: the default ones)."""
        B, S_l, H = h_BSH.shape
        positions_BS = self.shards.gather_along(positions_BS, dim=1)
        part_BSH = h_BSH.new_empty(B, positions_BS.shape[1], 1).expand(-1, -1, H)  # shape, dtype, device only
        whole_BSH = h_BSH.new_empty(B, S_l * self.size, 1).expand(-1, -1, H)
        masks = build_context(stage.config, stage.rotary_emb, whole_BSH, full_positions_BS).masks
        return LayerContext(positions_BS, stage.rotary_emb(part_BSH, positions_BS), masks)


class _Pair(torch.autograd.Function):
    """``there`` in the forward, ``back`` (its adjoint: gather <-> reduce-scatter) in the backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, there: Callable, back: Callable) -> torch.Tensor:  # type: ignore[override]
        ctx.back = back
        return there(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return ctx.back(grad), None, None


def check_tensor_parallel(config, size: int, seq_len: int | None = None) -> None:
    """Refuse, before launch, what a TP degree of ``size`` cannot split (one line naming the reason)."""
    if size == 1:
        return
    family = family_of(config)
    check(Job.of(family.model_type, tensor_parallel=size))  # families whose attention is not sharded by heads yet
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if family.attention == "mla":
        kv_heads = heads  # MLA: every head has its own keys and values (kv_b_proj)
    for name, count in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
        if count % size:
            raise LayoutError(f"tensor_parallel {size} must divide {name} ({count}): each rank takes 1/t of them")
    if seq_len is not None and seq_len % size:
        raise LayoutError(f"tensor_parallel {size} must divide the sequence length ({seq_len})")


def check_lane(config, sp: int, tp: int, seq_len: int | None = None) -> None:
    """Refuse, before launch, an A-lane of SP ``sp`` x TP ``tp`` ranks the model cannot split: each degree's own
    rules, and with both, Ulysses over a TP rank's heads (``sequence_parallel.check_sequence_parallel``'s rules on
    1/tp of them) and slices of S / (sp tp) tokens."""
    check_sequence_parallel(config, sp, seq_len)
    check_tensor_parallel(config, tp, seq_len)
    if sp == 1 or tp == 1:
        return
    heads = config.num_attention_heads // tp
    kv_heads = (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) // tp
    if heads % sp:
        raise LayoutError(f"sequence_parallel {sp} must divide the {heads} query heads of a tensor_parallel {tp} rank")
    if family_of(config).attention != "mla" and kv_heads % sp and sp % kv_heads:
        raise LayoutError(
            f"sequence_parallel {sp} and the {kv_heads} KV heads of a tensor_parallel {tp} rank must divide one another"
        )
    if seq_len is not None and seq_len % (sp * tp):
        raise LayoutError(f"sequence_parallel x tensor_parallel ({sp * tp}) must divide the sequence length {seq_len}")


def shard_attention(attn: nn.Module, tp: TensorParallel) -> None:
    """Cut HF attention module ``attn`` to ``tp.shards.rank``'s heads in place (parameters keep HF's names) and make it
    take slices and give slices: gather before, reduce-scatter and the output bias after."""
    for name in PER_HEAD:
        if isinstance(getattr(attn, name, None), nn.Parameter):
            _cut(attn, name, 0, tp)
    _shard_block(attn, tp, COLUMN, ROW)


def glu_blocks(mlp: nn.Module) -> list[nn.Module]:
    """The gated MLPs (``gate_proj``, ``up_proj``, ``down_proj``) an attention part runs: its dense MLP itself, or
    the shared experts of its MoE block."""
    candidates = [mlp, *mlp.children()]
    return [m for m in candidates if all(isinstance(getattr(m, n, None), nn.Linear) for n in (*GLU_COLUMN, GLU_ROW))]


def shard_mlp(mlp: nn.Module, tp: TensorParallel) -> None:
    """Cut a gated MLP to ``tp.shards.rank``'s intermediate columns in place, taking and giving slices as attention
    does."""
    _shard_block(mlp, tp, GLU_COLUMN, GLU_ROW)


def _shard_block(block: nn.Module, tp: TensorParallel, column: tuple[str, ...], row: str) -> None:
    for name in column:
        linear = getattr(block, name, None)
        if linear is not None:
            _cut(linear, "weight", 0, tp)
            if linear.bias is not None:
                _cut(linear, "bias", 0, tp)
            linear.out_features //= tp.shards.size
    out = getattr(block, row)
    _cut(out, "weight", 1, tp)
    out.in_features //= tp.shards.size
    setattr(block, row, _NoBias(out))
    block.register_forward_pre_hook(_gather_input(tp), with_kwargs=True)
    block.register_forward_hook(_scatter_output(tp, getattr(block, row)))


def _cut(module: nn.Module, name: str, dim: int, tp: TensorParallel) -> None:
    whole = getattr(module, name)
    if whole.shape[dim] % tp.shards.size:
        raise LayoutError(f"tensor_parallel {tp.shards.size} does not divide {name} of shape {tuple(whole.shape)}")
    part = nn.Parameter(
        whole.detach().chunk(tp.shards.size, dim)[tp.shards.rank].clone(), requires_grad=whole.requires_grad
    )
    part.disagmoe_tp = Shard(dim, tp.shards.rank, tp.shards.size)  # type: ignore[attr-defined]
    setattr(module, name, part)


class _NoBias(nn.Linear):
    """An output projection cut to its input columns: the partial product only (its bias is added after the sum);
    ``fp8``: in FP8 (``fp8.modules``; the rowwise scales then span this rank's columns of the reduction)."""

    fp8 = False

    def __init__(self, linear: nn.Linear):  # the same parameters, under the same names
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(self, x, self.weight)


def _gather_input(tp: TensorParallel):
    def hook(module: nn.Module, args: tuple, kwargs: dict[str, Any]):
        del module
        if args:  # an MLP, token by token: its tokens ([T, H] or [B, S, H]) in rank order
            return (tp.gather(args[0], dim=0), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": tp.gather(kwargs["hidden_states"])}  # attention: keywords

    return hook


def _scatter_output(tp: TensorParallel, out: nn.Linear):
    def hook(module: nn.Module, args: tuple, output):
        del module, args
        attention = isinstance(output, tuple)  # (output, weights); an MLP gives its output alone
        partial_BSH, *rest = output if attention else (output,)
        out_BSH = tp.scatter(partial_BSH, dim=1 if attention else 0)
        if out.bias is not None:
            out_BSH = out_BSH + out.bias
        return (out_BSH, *rest) if attention else out_BSH

    return hook


def broadcast_from_first(module: nn.Module, tp: TensorParallel, first_rank: int) -> None:
    """Make every TP rank's copy of ``module`` equal to the group's first rank's (global rank ``first_rank``), before
    the attention modules are cut: replicas initialised from their own seeds, shards cut from one whole tensor."""
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.data, src=first_rank, group=tp.shards.group)


class TensorParallelGrads:
    """Sums the replicated parameters' gradients of an attention rank over its TP group, before DeepSpeed averages
    them over the rank's replicas: per backward (``per_backward``: ZeRO-2 reduces and frees the gradients inside
    each backward), else once per step (``reduce``, before ``step()``; the caller's)."""

    def __init__(self, module: nn.Module, tp: TensorParallel, *, per_backward: bool):
        self.tp = tp
        self.params = [p for p in module.parameters() if p.requires_grad and shard_of(p) is None]
        if per_backward:
            for param in self.params:
                param.register_hook(self._summed)

    def _summed(self, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad, group=self.tp.shards.group)
        return grad

    def reduce(self) -> None:
        """The step's accumulated gradients summed over the group, in one all-reduce per dtype."""
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for param in self.params:
            if param.grad is None:  # every rank sums the same tensors
                param.grad = torch.zeros_like(param)
            by_dtype.setdefault(param.grad.dtype, []).append(param)
        for params in by_dtype.values():
            flat = torch.cat([p.grad.reshape(-1) for p in params])  # type: ignore[union-attr]
            dist.all_reduce(flat, group=self.tp.shards.group)
            for param, summed in zip(params, flat.split([p.numel() for p in params]), strict=True):
                param.grad.copy_(summed.view_as(param))  # type: ignore[union-attr]
