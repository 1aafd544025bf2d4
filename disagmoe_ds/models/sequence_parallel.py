"""Sequence parallelism inside an A-lane (DeepSpeed-Ulysses): s ranks hold one micro-batch's sequence in slices.

Legend: B micro-batch size, S the whole sequence, S_l = S / s one rank's slice, H hidden, s the SP degree.

Every part of a layer works token by token except the attention core, so an SP rank runs the norms, projections,
rotary embeddings, router and shared experts on its own slice, and its own tokens go to the experts (its M2N and
N2M are those of a lane of S_l tokens). Around the core, DeepSpeed's ``UlyssesSPAttentionHF`` trades the sequence
for the heads (all-to-all: each rank then holds all S positions of H/s heads), runs HF's own attention function
and trades back. The mask is the whole sequence's, built from the whole micro-batch's positions (packed documents
included); the rotary embeddings are the slice's, from its global positions.

The loss of a micro-batch is HF's mean over its labelled tokens; each rank computes its share (its slice's sum over
the micro-batch's count, with the labels shifted before slicing so a slice's last token predicts the next slice's
first). The router's aux loss needs every slice's expert counts: they are summed over the SP group (no gradient),
and each rank's share uses its own probability sums, whose gradient is then exactly the whole loss's. DeepSpeed
averages gradients over every lane, s of which hold one micro-batch, so each rank's objective is s times its share.
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from disagmoe_ds.capabilities.rules import Job, check
from disagmoe_ds.errors import LayoutError
from disagmoe_ds.models.aux_loss import RouterStats
from disagmoe_ds.models.context import LayerContext, build_context
from disagmoe_ds.models.families import family_of

ATTENTION_KEY = "disagmoe_ulysses"  # the HF attention implementation an SP rank's attention modules use
IGNORE_INDEX = -100


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's place in its SP group: ``size`` ranks, ``rank`` holds slice ``rank`` of every micro-batch."""

    group: dist.ProcessGroup | None
    size: int
    rank: int

    def slice_of(self, t_BS: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a [B, S, ...] tensor."""
        S_l = t_BS.shape[1] // self.size
        return t_BS[:, self.rank * S_l : (self.rank + 1) * S_l].contiguous()

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the SP group (no gradient: counts)."""
        t = t.detach().clone()
        dist.all_reduce(t, group=self.group)
        return t

    def gather_sequence(self, t_BS: torch.Tensor) -> torch.Tensor:
        """The whole micro-batch's [B, S] from every rank's slice (no gradient: positions)."""
        return self.gather_along(t_BS, dim=1)

    def gather_along(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim`` in rank order (no gradient)."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def reduce_scatter_along(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's part along ``dim`` of the sum of every rank's ``x`` (no gradient)."""
        if dist.get_backend(self.group) == "gloo":  # gloo has no reduce-scatter
            whole = x.contiguous().clone()
            dist.all_reduce(whole, group=self.group)
            return whole.chunk(self.size, dim=dim)[self.rank].contiguous()
        chunks = [c.contiguous() for c in x.chunk(self.size, dim=dim)]
        out = torch.empty_like(chunks[self.rank])
        dist.reduce_scatter(out, chunks, group=self.group)
        return out

    def share_of(self, stats: RouterStats) -> RouterStats:
        """This rank's share of a micro-batch's router statistics: the group's expert counts, its own probability
        sums (whose gradient is then the whole loss's), the group's rows. The shares' Switch losses sum to the
        whole micro-batch's."""
        return RouterStats(self.all_sum(stats.counts_E), stats.prob_sum_E, stats.rows * self.size)

    def context(self, stage, h_BSH: torch.Tensor, positions_BS: torch.Tensor, full_positions_BS) -> LayerContext:
        """The slice's context: rotary embeddings of its own (global) positions, masks of the whole sequence
        (``full_positions_BS`` None: the default positions, as ``build_context`` takes them)."""
        B, S_l, H = h_BSH.shape
        whole_BSH = h_BSH.new_empty(B, S_l * self.size, 1).expand(-1, -1, H)  # shape, dtype, device only
        masks = build_context(stage.config, stage.rotary_emb, whole_BSH, full_positions_BS).masks
        return LayerContext(positions_BS, stage.rotary_emb(h_BSH, positions_BS), masks)


def slice_batch(batch: dict[str, torch.Tensor], sp: SequenceParallel) -> dict[str, torch.Tensor]:
    """A micro-batch (input_ids, labels[, position_ids] of [B, S]) as SP rank ``sp.rank`` trains on it.

    ``labels`` become the slice of the labels shifted by one (HF's causal-LM loss shifts them itself, which would cut
    across slices), ``num_items`` the micro-batch's labelled tokens (the loss divides every slice's sum by it), and
    ``full_position_ids`` the whole micro-batch's positions (the mask). Without ``position_ids`` the slice gets its
    global ones and ``full_position_ids`` stays out (the default positions: a causal mask needs no tensor).
    """
    labels_BS = batch["labels"]
    shifted_BS = F.pad(labels_BS, (0, 1), value=IGNORE_INDEX)[:, 1:]
    out = {
        "input_ids": sp.slice_of(batch["input_ids"]),
        "shift_labels": sp.slice_of(shifted_BS),
        "num_items": (shifted_BS != IGNORE_INDEX).sum(),
    }
    positions_BS = batch.get("position_ids")
    if positions_BS is None:
        B, S = labels_BS.shape
        out["position_ids"] = sp.slice_of(torch.arange(S, device=labels_BS.device).expand(B, S))
    else:
        out["position_ids"] = sp.slice_of(positions_BS)
        out["full_position_ids"] = positions_BS
    return out


def check_sequence_parallel(config, size: int, seq_len: int | None = None) -> None:
    """Refuse, before launch, what an SP degree of ``size`` cannot split (one line naming the reason)."""
    if size == 1:
        return
    check(Job.of(family_of(config).model_type, sequence_parallel=size))  # what the family's cut cannot split
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % size:
        raise LayoutError(
            f"sequence_parallel {size} must divide num_attention_heads ({heads}): each rank takes H/s heads"
        )
    if kv_heads % size and size % kv_heads:
        raise LayoutError(
            f"sequence_parallel {size} and num_key_value_heads ({kv_heads}) must divide one another (KV heads are "
            "split, or replicated when fewer than the SP degree)"
        )
    if seq_len is not None and seq_len % size:
        raise LayoutError(f"sequence_parallel {size} must divide the sequence length ({seq_len})")


class _Ulysses:
    """The attention function of one SP rank's attention module: DeepSpeed's Ulysses around HF's core attention."""

    def __init__(self, core, sp: SequenceParallel) -> None:
        self.core, self.sp = core, sp
        self.ulysses: Any = None  # DeepSpeed's UlyssesSPAttentionHF, made at the first call (it needs the shapes)

    def __call__(self, module: nn.Module, q, k, v, mask, *args, **kwargs):
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

        v_dim = v.shape[-1]
        if v_dim != q.shape[-1]:  # MLA: values narrower than queries and keys; zero columns change nothing
            v = F.pad(v, (0, q.shape[-1] - v_dim))
        if self.ulysses is None:
            self.ulysses = UlyssesSPAttentionHF(
                attn=self.core,
                batch_size=q.shape[0],
                attn_head_count=q.shape[1],
                attn_head_size=q.shape[-1],
                kv_head_count=k.shape[1],
                num_hidden_layers=1,
                process_group=self.sp.group,
                seq_length_is_variable=True,
            )
        traded = _TradedHeads(module, self.sp, q.shape[1], k.shape[1])
        if kwargs.get("s_aux") is not None:  # GPT-OSS's sinks as the flash kernels take them
            kwargs["s_aux"] = traded.sinks
        out, weights = self.ulysses(traded, q, k, v, mask, *args, **kwargs)
        if v_dim != q.shape[-1]:
            out = out.view(*out.shape[:2], q.shape[1], q.shape[-1])[..., :v_dim]
        return out, weights


class _TradedHeads:
    """An attention module as the core attention sees it after Ulysses' trade: this rank's H/s query heads over its
    KV heads (kv/s, or one where DeepSpeed replicates fewer than s), so eager attention repeats them by the right
    ``num_key_value_groups``, and GPT-OSS's per-head sinks sliced to those heads. Everything else is the module's."""

    def __init__(self, module: nn.Module, sp: SequenceParallel, q_heads: int, kv_heads: int) -> None:
        self._module = module
        self.num_key_value_groups = (q_heads // sp.size) // max(kv_heads // sp.size, 1)
        sinks = getattr(module, "sinks", None)
        self.sinks = None if sinks is None else sinks.chunk(sp.size)[sp.rank]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _core_attention(module: nn.Module, implementation: str):
    """HF's attention function of ``implementation`` for ``module``: eager is the modeling file's own (GPT-OSS, with
    its sinks, has no SDPA), the others are registered."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if implementation == "eager":
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[implementation]


def install_ulysses(attention_modules: list[nn.Module], sp: SequenceParallel) -> None:
    """Make every attention module in ``attention_modules`` run Ulysses over ``sp`` (its own config copy names
    the implementation; the model's config, which builds the masks, keeps HF's)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if ATTENTION_KEY not in ALL_ATTENTION_FUNCTIONS:
        ALL_ATTENTION_FUNCTIONS.register(
            ATTENTION_KEY, lambda module, *a, **kw: module._disagmoe_ulysses(module, *a, **kw)
        )
    for module in attention_modules:
        config: Any = copy.copy(module.config)
        core = _core_attention(module, config._attn_implementation)
        config._attn_implementation = ATTENTION_KEY
        module.config = config
        object.__setattr__(module, "_disagmoe_ulysses", _Ulysses(core, sp))  # not a submodule: no state
