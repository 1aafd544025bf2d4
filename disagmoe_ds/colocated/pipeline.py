"""Run one co-located pipeline stage's step: 1F1B (or interleaved 1F1B) over the stages, each micro-batch handed
on between them.

Every rank of stage s runs its chunks' layers (attention and its expert slice, ``colocated.model``) for lane d's
micro-batches; rank ``s * D + d`` receives each forward from lane d of the stage before it and each gradient from
lane d of the stage after it, the last stage handing chunk k on to the first stage's chunk k + 1 (``StageLinks``:
one one-way communicator per direction and stage boundary, plus the wrap-around pair with virtual stages, on the
job's transport, so the rendezvous transport checks the protocol on CPU ranks). Every rank reads its lane's batches
itself: the first stage embeds the tokens, every stage builds the attention context from them, the last reads the
labels.

Deadlock freedom: a host blocks only where it waits for a message (sends never block; each link's next receive is
posted as soon as the previous one is taken, in the order its sender sends), and the passes run in the order
``pipe_schedule.schedule`` gives, which ``pipe_schedule.check_pipeline`` runs against exactly that model.

Gradients: a chunk below the head backpropagates ``(h_out * dh).sum()`` plus the aux loss's share through its router
sums (``handoff.AuxGrads``), the head ``loss / K``; DeepSpeed averages each parameter's gradient over its replicas
in the stage, and the global norm adds up the stages (``ColocatedGradNorm``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from disagmoe_ds.colocated.executor import ColocatedExecutor
from disagmoe_ds.colocated.handoff import AuxGrads, RouterSums, StageOutput
from disagmoe_ds.colocated.layout import ColocatedLayout
from disagmoe_ds.colocated.model import ColocatedModel, ColocatedOutput
from disagmoe_ds.colocated.pipe_schedule import Pass, destination, schedule, source
from disagmoe_ds.comm.transport import Comm, Op, Transport, Work
from disagmoe_ds.models.aux_loss import balance_per_layer
from disagmoe_ds.models.moe_pattern import aux_layer_pattern
from disagmoe_ds.runtime.step import EvalResult, StepResult, evaluating

Batch = dict[str, torch.Tensor]
LinkKey = tuple[str, int]  # the messages' kind ("F": residuals, "B": gradients) and the stage at the other end


@dataclass(frozen=True)
class Link:
    """One direction of a stage boundary as one rank sees it: the communicator and the peer at its other end."""

    comm: Comm
    peer: int


class Inflow:
    """The receives of one link, in the order its sender sends (``order``: their micro-batches), the next one
    posted as soon as the previous is taken."""

    def __init__(
        self, transport: Transport, link: Link, order: list[int], buffers: Callable[[int], list[torch.Tensor]]
    ):
        self.transport, self.link, self.order, self.buffers = transport, link, order, buffers
        self.taken = 0
        self.pending: Work | None = None
        self.received: list[torch.Tensor] = []
        self._post()

    def take(self, mb: int) -> list[torch.Tensor]:
        """Micro-batch ``mb``'s message (the next in order); posts the receive of the one after it."""
        assert self.pending is not None and self.order[self.taken] == mb, f"micro-batch {mb} taken out of order"
        self.pending.wait()
        message = self.received
        self.taken += 1
        self._post()
        return message

    def _post(self) -> None:
        if self.taken == len(self.order):
            self.pending = None
            return
        self.received = self.buffers(self.order[self.taken])
        ops = [Op("recv", buffer, self.link.peer) for buffer in self.received]
        self.pending = self.transport.start(self.link.comm, ops)


class StageLinks:
    """A rank's links to the stages it exchanges with (``send_to`` / ``recv_from``, by ``LinkKey``); every rank
    creates every communicator, in the same order (``Transport.new_comm`` is collective)."""

    def __init__(self, transport: Transport, layout: ColocatedLayout, rank: int):
        self.transport = transport
        D, stage, P = layout.stage_size, layout.stage_of(rank), layout.pp_size
        peers = layout.pipeline_peers(rank)  # this lane's rank in every stage
        self.send_to: dict[LinkKey, Link] = {}
        self.recv_from: dict[LinkKey, Link] = {}
        self.comms: list[Comm] = []
        hops = [(s, s + 1) for s in range(P - 1)] + ([(P - 1, 0)] if layout.virtual_stages > 1 else [])
        for src, dst in hops:  # forward src -> dst; the gradients come back dst -> src
            ranks = sorted({*range(src * D, (src + 1) * D), *range(dst * D, (dst + 1) * D)})
            pairs = [(src * D + d, dst * D + d) for d in range(D)]
            for kind, (a, b), edges in (("F", (src, dst), pairs), ("B", (dst, src), [(y, x) for x, y in pairs])):
                comm = transport.new_comm(f"pipeline {kind} {a}->{b}", ranks, edges)
                self.comms.append(comm)
                if stage == a:
                    self.send_to[(kind, b)] = Link(comm, peers[b])
                if stage == b:
                    self.recv_from[(kind, a)] = Link(comm, peers[a])

    def warm_up(self, device: torch.device) -> None:
        self.transport.warm_up(self.comms, device)


class PipelineExecutor(ColocatedExecutor):
    """``train_batch`` for one rank of a co-located pipeline (the ``AFPipeExecutor.train_batch`` contract).

    Args (beyond ``ColocatedExecutor``'s):
        layout: the pipelined layout, ``rank``: this rank, ``links``: its hand-offs.
        world: every rank (the step's loss sums, held by the last stage, are reduced over it).
        dtype: the model's (the residual's between stages).
    """

    def __init__(
        self,
        *,
        layout: ColocatedLayout,
        rank: int,
        links: StageLinks,
        world: dist.ProcessGroup,
        dtype: torch.dtype,
        **kwargs: Any,
    ):
        super().__init__(group=world, **kwargs)
        self.links = links
        self.stage, self.stages, self.chunks = layout.stage_of(rank), layout.pp_size, layout.virtual_stages
        module: ColocatedModel = self.engine.module
        learned = aux_layer_pattern(module.config.to_dict())
        # per chunk, the MoE layers with a learned choice before it (the router sums it receives count them)
        self.layers_before = [sum(learned[: chunk.start]) for chunk in layout.chunk_layers(self.stage)]
        self.num_experts, self.residual_dims = layout.num_experts, module.attention.residual_dims
        self.aux_coef, self.per_layer = module.aux_coef, balance_per_layer(module.config)
        self.share_scale = module.share_scale
        self.dtype = dtype  # the residual's, handed on

    def train_batch(self, batches: list[Batch] | None = None) -> StepResult:
        """One optimizer step over this lane's K micro-batches, in the schedule's order with the other stages."""
        batches = self._checked(batches)
        start = time.perf_counter()
        self.runner.start_step()
        sent: list[Sent] = []
        passes = schedule(self.stage, self.stages, self.chunks, len(batches))
        try:
            with self._cast_scope():
                inflows = self._inflows(batches, passes)
                kept: dict[tuple[int, int], Forward] = {}
                for kind, chunk, mb in passes:
                    name = f"{'forward' if kind == 'F' else 'backward'} {mb}" + (
                        f" chunk {chunk}" if self.chunks > 1 else ""
                    )
                    if kind == "F":
                        forward = partial(self._forward, batches, chunk, mb, inflows, sent)
                        kept[(chunk, mb)] = self._timed(name, "compute", forward)
                        self.runner.add(kept[(chunk, mb)][0])
                    else:
                        backward = partial(self._backward, chunk, mb, kept.pop((chunk, mb)), inflows, sent)
                        self._timed(name, "compute", backward)
                _wait(sent)
            self._timed("step", "optimizer", self._step)
        finally:
            self.stall_watch.stop()
        sums = self.runner.sums  # the last stage's; zeros elsewhere
        dist.all_reduce(sums, group=self.group)
        sums = sums.cpu()  # waits for the reduce, which the step's time includes
        return StepResult.of_sums(sums, self.grad_norm.last_norm, time.perf_counter() - start, self.runner.load_LE)

    def eval_batch(self, batches: list[Batch] | None = None) -> EvalResult:
        """HF's LM loss of this lane's micro-batches summed over their labelled tokens, over all lanes: the step's
        forwards alone, in its order, handed on from stage to stage; the step's sums untouched."""
        batches = self._checked(batches)
        sums = torch.zeros(2, dtype=torch.float64, device=self.engine.device)
        sent: list[Sent] = []
        forwards = [p for p in schedule(self.stage, self.stages, self.chunks, len(batches)) if p[0] == "F"]
        try:
            with evaluating(self.engine.module), self._cast_scope():
                inflows = self._inflows(batches, forwards)
                for _, chunk, mb in forwards:
                    forward = partial(self._forward, batches, chunk, mb, inflows, sent)
                    out, _ = self._timed(f"eval {mb}", "compute", forward)
                    if isinstance(out, ColocatedOutput):
                        sums += out.lm_token_sums(batches[mb])
                _wait(sent)
        finally:
            self.stall_watch.stop()
        dist.all_reduce(sums, group=self.group)
        return EvalResult(sums[0].item(), int(sums[1].item()))

    def _forward(
        self, batches: Sequence[Batch], chunk: int, mb: int, inflows: dict[LinkKey, Inflow], sent: list[Sent]
    ) -> Forward:
        """Micro-batch ``mb`` through ``chunk``'s layers: from its tokens (the first virtual stage) or the previous
        one's hand-off, on to the next virtual stage (or the loss, at the head)."""
        batch = batches[mb]
        src = source(self.stages, self.chunks, self.stage, ("F", chunk, mb))
        if src is None:
            h_leaf, out = None, self.engine(**batch, chunk=chunk)
        else:
            h_leaf, wire = inflows[("F", src[0])].take(mb)
            h_leaf.requires_grad_(torch.is_grad_enabled())
            tokens = batch["input_ids"].numel() * (1 if self.lane is None else self.lane.size)  # the micro-batch's
            sums = RouterSums.from_wire(wire, tokens=tokens, layers=self.layers_before[chunk])
            out = self.engine(**batch, inbound=(h_leaf, sums), chunk=chunk)
        if isinstance(out, StageOutput):
            dst = destination(self.stages, self.chunks, self.stage, ("F", chunk, mb))
            assert dst is not None, "every virtual stage below the head hands on"
            sent.append(self._send(("F", dst[0]), [out.h_BSH.detach(), out.sums.to_wire()]))
        return out, h_leaf

    def _backward(self, chunk: int, mb: int, kept: Forward, inflows: dict[LinkKey, Inflow], sent: list[Sent]) -> None:
        """Micro-batch ``mb``'s backward through ``chunk``: from the loss (the head) or the next virtual stage's
        gradients; the gradients of the chunk's input go back to the previous one."""
        out, h_leaf = kept
        if isinstance(out, ColocatedOutput):
            grads = self._aux_grads(out)
            self.engine.backward(out.loss / self.num_micro_batches, scale_wrt_gas=False)
        else:
            src = source(self.stages, self.chunks, self.stage, ("B", chunk, mb))
            assert src is not None, "every virtual stage below the head gets its output's gradient"
            dh, wire = inflows[("B", src[0])].take(mb)
            grads = AuxGrads.from_wire(wire)
            surrogate = (out.h_BSH * dh).sum().float() + grads.surrogate(out.sums)
            self.engine.backward(surrogate, scale_wrt_gas=False)
        if h_leaf is not None:
            dst = destination(self.stages, self.chunks, self.stage, ("B", chunk, mb))
            assert dst is not None and h_leaf.grad is not None, "every virtual stage after the first"
            sent.append(self._send(("B", dst[0]), [h_leaf.grad, grads.to_wire()]))

    def _aux_grads(self, out: ColocatedOutput) -> AuxGrads:
        """What the head sends back of the aux loss's gradient (zeros where the model has no aux loss)."""
        if self.aux_coef is None or out.sums is None:
            return AuxGrads(torch.zeros(self.num_experts, dtype=torch.float32, device=out.loss.device), 0.0)
        coef = self.aux_coef * self.share_scale  # a slice's share counts s x t (``ColocatedModel.share_scale``)
        return out.sums.grads(coef, per_layer=self.per_layer, micro_batches=self.num_micro_batches)

    def _inflows(self, batches: Sequence[Batch], passes: Sequence[Pass]) -> dict[LinkKey, Inflow]:
        """The step's receives, per link in the order of ``passes`` (the order their senders send in), each link's
        first one posted."""
        orders: dict[LinkKey, list[int]] = {}
        for kind, chunk, mb in passes:
            src = source(self.stages, self.chunks, self.stage, (kind, chunk, mb))
            if src is not None:
                orders.setdefault((kind, src[0]), []).append(mb)
        return {
            key: Inflow(self.links.transport, self.links.recv_from[key], order, partial(self._buffers, batches, key[0]))
            for key, order in orders.items()
        }

    def _buffers(self, batches: Sequence[Batch], kind: str, mb: int) -> list[torch.Tensor]:
        """A hand-off's tensors, received into: the residual (or its gradient) and the router sums (or the aux
        gradients)."""
        device = self.engine.device
        shape = (*batches[mb]["input_ids"].shape, *self.residual_dims)
        wire = 2 * self.num_experts + 1 if kind == "F" else self.num_experts + 1
        return [
            torch.empty(shape, dtype=self.dtype, device=device),
            torch.empty(wire, dtype=torch.float32, device=device),
        ]

    def _send(self, key: LinkKey, tensors: list[torch.Tensor]) -> Sent:
        link = self.links.send_to[key]
        tensors = [t.contiguous() for t in tensors]
        return self.links.transport.start(link.comm, [Op("send", t, link.peer) for t in tensors]), tensors


Forward = tuple[ColocatedOutput | StageOutput, torch.Tensor | None]  # a forward's output and its input leaf
Sent = tuple[Work, list[torch.Tensor]]  # a send in flight and its tensors, kept alive until it completes


def _wait(sent: list[Sent]) -> None:
    for work, _ in sent:
        work.wait()
    sent.clear()
