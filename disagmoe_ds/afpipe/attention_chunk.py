"""What an attention chunk keeps between its forward and its backward, and what its residual hand-off carries.

``AttentionChunk``: what A_fwd(l, m) keeps for A_bwd(l, m) (``attention_runner``); ``PerToken``: the per-token
fields of the residual message; ``sent``: a dispatch read only once its m2n message went out.

Shape suffixes: T tokens, W residual width, C routed-sum weights, I token-id columns, R rows, H hidden, K top-k,
E experts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from disagmoe_ds.comm.messages import Tokens
from disagmoe_ds.comm.routing import PendingDispatch


def sent(dispatch: PendingDispatch) -> PendingDispatch:
    """``dispatch``, whose m2n message the mailbox has made (and so resolved): a runner that waited here for the
    sizes while the mailbox still held earlier sends could wait for its own GPU behind a receive that needs them."""
    if not dispatch.is_resolved:
        raise RuntimeError("a dispatch was read before its m2n message was sent: the schedule sends m2n first")
    return dispatch


@dataclass
class AttentionChunk:
    """What A_fwd(l, m) keeps for A_bwd(l, m)."""

    resid_leaf: torch.Tensor | None = None
    y_leaves: list[torch.Tensor] = field(default_factory=list)
    residual_out: torch.Tensor | None = None
    routed_w_out: torch.Tensor | None = None  # hyper-connections: the routed sum's weights this layer handed on
    routed_w_leaf: torch.Tensor | None = None  # ... and those it received with the residual
    dispatch: PendingDispatch | None = None  # MoE layers: the tokens packed for the ep ranks
    prob_sum_E: torch.Tensor | None = None
    layer_aux: torch.Tensor | None = None  # per-layer balancing: this layer's share of the aux loss
    scaled_loss: torch.Tensor | None = None
    aux_grad_E: torch.Tensor | None = None
    resent: list[Tokens] | None = None  # resend, p > 1: the previous layer's m2n messages

    @property
    def pieces(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each ep rank's ``(x_RH, w_RK)``; read in the backward, after the m2n message went out."""
        return sent(self.dispatch).resolved[1] if self.dispatch is not None else []

    def messages(self, *, fp8: bool) -> list[Tokens]:
        """The m2n message of each ep rank (with resend: sent again, detached); ``fp8``: its rows in FP8."""
        if self.dispatch is None:
            return []
        plan, pieces = self.dispatch.resolved
        per_rank = zip(pieces, plan.local_idx_RK, plan.pairs, strict=True)
        return [Tokens.of(x_RH, idx_RK, w_RK, pairs, fp8=fp8) for (x_RH, w_RK), idx_RK, pairs in per_rank]


@dataclass(frozen=True)
class PerToken:
    """What the residual hand-off carries per token besides the combine plan: the residual ([T, W]), positions, the
    routed sum's weights ([T, C]) and token ids ([T, I]) (``comm.messages.Residual``)."""

    residual_TW: torch.Tensor
    position_ids_T: torch.Tensor
    routed_w_TC: torch.Tensor
    token_ids_TI: torch.Tensor
