"""One rank's ends of the AF-Pipe exchanges, addressed by schedule messages.

Every message kind a rank receives arrives on exactly one channel (one sender group), matched first-in
first-out. The schedule posts receives in the sender's order but may *use* them in another order, so a wait
completes older messages first and keeps them until their own wait: nothing blocks longer than its sender needs
to reach that send.

Payloads (shape suffixes: T tokens of a micro-batch, H hidden, K top-k, E experts, R/S rows):

    m2n        lane -> each ep rank      ([(x_RH, local_idx_RK, w_RK)], pairs) on A  F side: S rows, LaneRows
    n2m        ep rank -> next lane      ((y_SH,), LaneRows) on F                    A side: [(y_RH,)] per ep rank
    m2n_grad   ep rank -> lane           ((dx_SH, dw_SK), LaneRows) on F             A side: [(dx_RH, dw_RK)]
    n2m_grad   next lane -> ep rank      ([(dy_RH,)], None) on A                     F side: (dy_SH,), LaneRows
    resid      lane -> next lane         (residual_TH, topk_idx_TK, position_ids_T, counts_E, prob_sum_E)
    resid_grad next lane -> lane         (d_residual_TH, aux_grad_E)

A-side fan-outs carry one message per ep rank and the messages' header metas: for m2n the routed pairs per ep
rank, which size the F side's expert buffers and arrive there summed in ``LaneRows.meta``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from disagmoe_ds.comm.channel import CommStream, MessageSpec, Receiver, Sender, TensorSpec
from disagmoe_ds.comm.exchange import (
    ExchangeGroups,
    Kind,
    M2NReceiver,
    M2NSender,
    N2MReceiver,
    N2MSender,
    exchange_specs,
)
from disagmoe_ds.schedule import Message

Key = tuple[str, int, int]  # (kind, layer of the sending task, micro-batch)


def message_key(message: Message) -> Key:
    return (message.kind, message.src.layer, message.src.micro_batch)


def _tag(key: Key) -> int:
    # Checked by the receiver against the oldest message on the channel: catches any schedule mismatch.
    return key[1] * (1 << 20) + key[2]


@dataclass
class _Inbox:
    post: Callable[[], None]
    wait: Callable[[int], Any]
    expected: deque[Key] = field(default_factory=deque)


def residual_specs(hidden: int, top_k: int, num_experts: int, dtype: torch.dtype) -> dict[Kind, MessageSpec]:
    fixed_e = TensorSpec(torch.float32, (num_experts,), per_row=False)
    return {
        Kind.RESID: MessageSpec(
            (
                TensorSpec(dtype, (hidden,)),
                TensorSpec(torch.int64, (top_k,)),
                TensorSpec(torch.int64, ()),
                fixed_e,
                fixed_e,
            ),
            name="resid",
        ),
        Kind.RESID_GRAD: MessageSpec((TensorSpec(dtype, (hidden,)), fixed_e), name="resid_grad"),
    }


class Mailbox:
    """Senders and receivers of one rank, built once per run; ``post``/``wait``/``send`` by schedule message.

    ``post_ahead=False`` leaves each receive to its wait (NCCL). Two H200s hung with receives posted ahead, both
    ranks blocked in host syncs of their compute; posting at the wait fixed it. The likely cause: a receive
    kernel launched ahead of need spins until its sender gets there, and the GPU's few hardware queues
    (``CUDA_DEVICE_MAX_CONNECTIONS``) serialise it with other streams' kernels, among them the compute the sender
    waits for. With gloo (CPU) a posted receive costs nothing.

    ``comm_stream=True`` runs the receives on a side CUDA stream (``CommStream``): waiting for a message then
    never waits for this rank's queued compute, and payloads land while it runs.
    """

    def __init__(
        self,
        groups: ExchangeGroups,
        *,
        hidden: int,
        top_k: int,
        num_experts: int,
        dtype: torch.dtype,
        weight_dtype: torch.dtype,
        device: torch.device,
        post_ahead: bool = True,
        comm_stream: bool = False,
    ):
        specs = exchange_specs(hidden, top_k, dtype=dtype, weight_dtype=weight_dtype)
        specs.update(residual_specs(hidden, top_k, num_experts, dtype))
        layout, rank = groups.layout, groups.rank
        role = layout.role_of(rank)
        self._senders: dict[str, Callable[[Any, int], Any]] = {}
        self._inboxes: dict[str, _Inbox] = {}
        self._flush: list[Callable[[], None]] = []
        self._stash: dict[Key, Any] = {}
        self.post_ahead = post_ahead
        comm = CommStream(device, enabled=comm_stream)

        def fan_out(kind: Kind, cls) -> None:
            end = cls.build(groups, kind, spec=specs[kind], device=device)
            self._flush.append(end.wait_all)
            self._senders[kind.value] = lambda payload, tag: end.send(payload[0], payload[1], tag=tag)

        def fan_in(kind: Kind, cls) -> None:
            end = cls.build(groups, kind, spec=specs[kind], device=device, comm=comm)
            self._inboxes[kind.value] = _Inbox(end.post, lambda tag: end.wait(tag=tag))

        if role.is_attention:
            fan_out(Kind.M2N, M2NSender)
            fan_out(Kind.N2M_GRAD, M2NSender)
            fan_in(Kind.N2M, N2MReceiver)
            fan_in(Kind.M2N_GRAD, N2MReceiver)
            if layout.depth > 1:
                nxt = layout.attention_ranks((role.group + 1) % layout.depth)[role.index]
                prv = layout.attention_ranks((role.group - 1) % layout.depth)[role.index]
                self._p2p_out(groups, Kind.RESID, rank, nxt, specs, device)
                self._p2p_out(groups, Kind.RESID_GRAD, rank, prv, specs, device)
                self._p2p_in(groups, Kind.RESID, prv, rank, specs, device, comm)
                self._p2p_in(groups, Kind.RESID_GRAD, nxt, rank, specs, device, comm)
        else:
            fan_in(Kind.M2N, M2NReceiver)
            fan_in(Kind.N2M_GRAD, M2NReceiver)
            fan_out(Kind.N2M, N2MSender)
            fan_out(Kind.M2N_GRAD, N2MSender)

    def _p2p_out(self, groups, kind: Kind, src: int, dst: int, specs, device) -> None:
        sender = Sender(groups.link(kind, src, dst), specs[kind], device)
        self._flush.append(sender.wait_all)
        self._senders[kind.value] = lambda payload, tag: sender.send(payload, tag=tag)

    def _p2p_in(self, groups, kind: Kind, src: int, dst: int, specs, device, comm: CommStream) -> None:
        receiver = Receiver(groups.link(kind, src, dst), specs[kind], device, comm)
        self._inboxes[kind.value] = _Inbox(receiver.post, lambda tag: receiver.wait(tag=tag))

    def post(self, message: Message) -> None:
        inbox = self._inboxes[message.kind]
        if self.post_ahead:
            inbox.post()  # else the receive is posted by its wait
        inbox.expected.append(message_key(message))

    def wait(self, message: Message) -> Any:
        """The payload of ``message``, completing older messages of its channel first (they are kept)."""
        key = message_key(message)
        inbox = self._inboxes[message.kind]
        while key not in self._stash:
            oldest = inbox.expected.popleft()
            self._stash[oldest] = inbox.wait(_tag(oldest))
        return self._stash.pop(key)

    def send(self, message: Message, payload: Any) -> None:
        self._senders[message.kind](payload, _tag(message_key(message)))

    def flush(self) -> None:
        """Wait until every send has left (end of step: buffers may be freed)."""
        for wait_all in self._flush:
            wait_all()
