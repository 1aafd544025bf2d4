"""Run one co-located pipeline stage's step: 1F1B over the stages, each micro-batch handed on between them.

Every rank of stage s runs its layers (attention and its expert slice, ``colocated.model``) for lane d's
micro-batches; rank ``s * D + d`` receives each forward from lane d of stage s - 1 and each gradient from lane d of
stage s + 1 (``StageLinks``: one one-way communicator per direction and stage boundary, on the job's transport, so
the rendezvous transport checks the protocol on CPU ranks). Every rank reads its lane's batches itself: the first
stage embeds the tokens, every stage builds the attention context from them, the last reads the labels.

Deadlock freedom: a host blocks only where it waits for a message (sends never block; the next receive of each
direction is posted as soon as the previous one is taken), and the passes run in 1F1B order
(``pipe_schedule.one_f_one_b``), which ``pipe_schedule.check_pipeline`` runs against exactly that model.

Gradients: a stage below the head backpropagates ``(h_out * dh).sum()`` plus the aux loss's share through its router
sums (``handoff.AuxGrads``), the head stage ``loss / K``; DeepSpeed averages each parameter's gradient over its
replicas in the stage, and the global norm adds up the stages (``PipelineGradNorm``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from deepspeed import DeepSpeedEngine

from disagmoe_ds.colocated.executor import ColocatedExecutor, ColocatedGradNorm
from disagmoe_ds.colocated.handoff import AuxGrads, RouterSums, StageOutput
from disagmoe_ds.colocated.layout import ColocatedLayout
from disagmoe_ds.colocated.model import ColocatedModel, ColocatedOutput
from disagmoe_ds.colocated.pipe_schedule import one_f_one_b
from disagmoe_ds.comm.transport import Comm, Op, Transport, Work
from disagmoe_ds.data.packing import labelled_tokens
from disagmoe_ds.models.aux_loss import balance_per_layer
from disagmoe_ds.models.moe_pattern import aux_layer_pattern
from disagmoe_ds.runtime.deepspeed_role import GlobalGradNorm
from disagmoe_ds.runtime.step import EvalResult, StepResult, evaluating, summed_lm_loss


@dataclass(frozen=True)
class Link:
    """One direction of a stage boundary as one rank sees it: the communicator and the peer at its other end."""

    comm: Comm
    peer: int


class Inflow:
    """The receives of one link, in micro-batch order, the next one posted as soon as the previous is taken."""

    def __init__(self, transport: Transport, link: Link, micro_batches: int):
        self.transport, self.link, self.micro_batches = transport, link, micro_batches
        self.pending: tuple[int, Work, list[torch.Tensor]] | None = None

    def post(self, mb: int, buffers: list[torch.Tensor]) -> None:
        ops = [Op("recv", buffer, self.link.peer) for buffer in buffers]
        self.pending = (mb, self.transport.start(self.link.comm, ops), buffers)

    def take(self, mb: int, next_buffers: list[torch.Tensor] | None) -> list[torch.Tensor]:
        """Micro-batch ``mb``'s message; posts the next one's receive into ``next_buffers`` (None: none follows)."""
        assert self.pending is not None and self.pending[0] == mb, f"receive of micro-batch {mb} posted in order"
        _, work, buffers = self.pending
        work.wait()
        self.pending = None
        if next_buffers is not None:
            self.post(mb + 1, next_buffers)
        return buffers


class StageLinks:
    """A rank's links to the stages before and after it (None at the first / last stage); every rank creates every
    boundary's two communicators, in the same order (``Transport.new_comm`` is collective)."""

    def __init__(self, transport: Transport, layout: ColocatedLayout, rank: int):
        self.transport = transport
        D, stage = layout.stage_size, layout.stage_of(rank)
        self.forward_out = self.forward_in = self.backward_out = self.backward_in = None
        self.comms: list[Comm] = []
        for boundary in range(layout.pp_size - 1):
            ranks = range(boundary * D, (boundary + 2) * D)
            pairs = [(boundary * D + d, (boundary + 1) * D + d) for d in range(D)]
            forward = transport.new_comm(f"pipeline forward {boundary}->{boundary + 1}", ranks, pairs)
            backward = transport.new_comm(
                f"pipeline backward {boundary + 1}->{boundary}", ranks, [(dst, src) for src, dst in pairs]
            )
            self.comms += [forward, backward]
            if stage == boundary:
                self.forward_out, self.backward_in = Link(forward, rank + D), Link(backward, rank + D)
            elif stage == boundary + 1:
                self.forward_in, self.backward_out = Link(forward, rank - D), Link(backward, rank - D)

    def warm_up(self, device: torch.device) -> None:
        self.transport.warm_up(self.comms, device)


class PipelineGradNorm(ColocatedGradNorm):
    """The global gradient norm of a pipeline stage's rank: ZeRO 1/2 combine each stage's norm (DeepSpeed's, global
    over the stage) over the world (``GlobalGradNorm``, one count per stage); ZeRO 0 counts every unique parameter
    once over the world as ``ColocatedGradNorm`` does over one stage."""

    def __init__(self, world: dist.ProcessGroup, *, attention_replicas: int, expert_replicas: int):
        super().__init__(world, attention_replicas=attention_replicas, expert_replicas=expert_replicas)
        self._stages = GlobalGradNorm(domain_size=attention_replicas)

    def install(self, engine: DeepSpeedEngine) -> None:
        if engine.zero_optimization():
            self._stages.install(engine)
        super().install(engine)

    @property
    def last_norm(self) -> float | None:
        if self._engine is not None and self._engine.zero_optimization():
            return self._stages.last_norm
        return self._own_norm


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
        self.stage, self.stages = layout.stage_of(rank), layout.pp_size
        module: ColocatedModel = self.engine.module
        self.first, self.last = module.attention.embed_tokens is not None, module.attention.head is not None
        config = module.config
        learned = aux_layer_pattern(config.to_dict())
        first_layer = layout.stage_layer_range(self.stage).start
        self.layers_before = sum(learned[:first_layer])  # MoE layers with a learned choice before the stage
        self.num_experts, self.residual_dims = layout.num_experts, module.attention.residual_dims
        self.aux_coef, self.per_layer = module.aux_coef, balance_per_layer(config)
        self.dtype = dtype  # the residual's, handed on

    def train_batch(self, batches: list[dict[str, torch.Tensor]] | None = None) -> StepResult:
        """One optimizer step over this lane's K micro-batches, in 1F1B order with the stages before and after."""
        batches = self._checked(batches)
        start = time.perf_counter()
        self.runner.start_step()
        sent: list[Sent] = []
        try:
            with self._cast_scope():
                inflows = self._inflows(batches, backward=True)
                kept: dict[int, Forward] = {}
                for kind, mb in one_f_one_b(self.stage, self.stages, len(batches)):
                    if kind == "F":
                        kept[mb] = self._timed(
                            f"forward {mb}", "compute", partial(self._forward, batches, mb, inflows, sent)
                        )
                        self.runner.add(kept[mb][0])
                    else:
                        backward = partial(self._backward, batches, mb, kept.pop(mb), inflows, sent)
                        self._timed(f"backward {mb}", "compute", backward)
                _wait(sent)
            self._timed("step", "optimizer", self._step)
        finally:
            self.stall_watch.stop()
        sums = self.runner.sums  # the last stage's; zeros elsewhere
        dist.all_reduce(sums, group=self.group)
        sums = sums.cpu()  # waits for the reduce, which the step's time includes
        return StepResult.of_sums(sums, self.grad_norm.last_norm, time.perf_counter() - start, self.runner.load_LE)

    def eval_batch(self, batches: list[dict[str, torch.Tensor]] | None = None) -> EvalResult:
        """HF's LM loss of this lane's micro-batches summed over their labelled tokens, over all lanes: forwards
        alone, handed on from stage to stage; the step's sums untouched."""
        batches = self._checked(batches)
        sums = torch.zeros(2, dtype=torch.float64, device=self.engine.device)
        sent: list[Sent] = []
        try:
            with evaluating(self.engine.module), self._cast_scope():
                inflows = self._inflows(batches, backward=False)
                for mb, batch in enumerate(batches):
                    out, _ = self._timed(f"eval {mb}", "compute", partial(self._forward, batches, mb, inflows, sent))
                    if isinstance(out, ColocatedOutput):
                        sums += summed_lm_loss(out.lm_loss, labelled_tokens(batch["labels"]))
                _wait(sent)
        finally:
            self.stall_watch.stop()
        dist.all_reduce(sums, group=self.group)
        return EvalResult(sums[0].item(), int(sums[1].item()))

    def _checked(self, batches: list[dict[str, torch.Tensor]] | None) -> list[dict[str, torch.Tensor]]:
        assert batches is not None, "every rank reads its lane's data"
        if len(batches) != self.num_micro_batches:
            raise ValueError(f"{self.name}: got {len(batches)} micro-batches, it accumulates {self.num_micro_batches}")
        return batches

    def _forward(
        self, batches: Sequence[dict[str, torch.Tensor]], mb: int, inflows: dict[str, Inflow], sent: list[Sent]
    ) -> Forward:
        """Micro-batch ``mb`` through the stage's layers: from its tokens (first stage) or the previous stage's
        hand-off, on to the next stage (or the loss, at the head)."""
        batch = batches[mb]
        if self.first:
            h_leaf, out = None, self.engine(**batch)
        else:
            h_leaf, wire = self._take(inflows, "F", batches, mb)
            h_leaf.requires_grad_(torch.is_grad_enabled())
            sums = RouterSums.from_wire(wire, tokens=batch["input_ids"].numel(), layers=self.layers_before)
            out = self.engine(**batch, inbound=(h_leaf, sums))
        if isinstance(out, StageOutput):
            assert self.links.forward_out is not None, "every stage below the head hands on"
            sent.append(self._send(self.links.forward_out, [out.h_BSH.detach(), out.sums.to_wire()]))
        return out, h_leaf

    def _backward(
        self,
        batches: Sequence[dict[str, torch.Tensor]],
        mb: int,
        kept: Forward,
        inflows: dict[str, Inflow],
        sent: list[Sent],
    ) -> None:
        """Micro-batch ``mb``'s backward: from the loss (head stage) or the next stage's gradients; the gradients of
        the stage's input go back to the previous stage."""
        out, h_leaf = kept
        if isinstance(out, ColocatedOutput):
            grads = self._aux_grads(out)
            self.engine.backward(out.loss / self.num_micro_batches, scale_wrt_gas=False)
        else:
            dh, wire = self._take(inflows, "B", batches, mb)
            grads = AuxGrads.from_wire(wire)
            surrogate = (out.h_BSH * dh).sum().float() + grads.surrogate(out.sums)
            self.engine.backward(surrogate, scale_wrt_gas=False)
        if h_leaf is not None:
            assert self.links.backward_out is not None and h_leaf.grad is not None, "every stage after the first"
            sent.append(self._send(self.links.backward_out, [h_leaf.grad, grads.to_wire()]))

    def _aux_grads(self, out: ColocatedOutput) -> AuxGrads:
        """What the head stage sends back of the aux loss's gradient (zeros where the model has no aux loss)."""
        if self.aux_coef is None or out.sums is None:
            return AuxGrads(torch.zeros(self.num_experts, dtype=torch.float32, device=out.loss.device), 0.0)
        return out.sums.grads(self.aux_coef, per_layer=self.per_layer, micro_batches=self.num_micro_batches)

    def _inflows(self, batches: Sequence[dict[str, torch.Tensor]], *, backward: bool) -> dict[str, Inflow]:
        """The receives of the step (``backward``: the gradients' too), each direction's first one posted."""
        links = {"F": self.links.forward_in, "B": self.links.backward_in if backward else None}
        inflows = {}
        for kind, link in links.items():
            if link is not None:
                inflows[kind] = Inflow(self.links.transport, link, len(batches))
                inflows[kind].post(0, self._buffers(batches[0], kind))
        return inflows

    def _take(
        self, inflows: dict[str, Inflow], kind: str, batches: Sequence[dict[str, torch.Tensor]], mb: int
    ) -> list[torch.Tensor]:
        follows = mb + 1 < len(batches)
        return inflows[kind].take(mb, self._buffers(batches[mb + 1], kind) if follows else None)

    def _buffers(self, batch: dict[str, torch.Tensor], kind: str) -> list[torch.Tensor]:
        """A hand-off's tensors, received into: the residual (or its gradient) and the router sums (or the aux
        gradients)."""
        device = self.engine.device
        h_BSH = torch.empty(*batch["input_ids"].shape, *self.residual_dims, dtype=self.dtype, device=device)
        wire = 2 * self.num_experts + 1 if kind == "F" else self.num_experts + 1
        return [h_BSH, torch.empty(wire, dtype=torch.float32, device=device)]

    def _send(self, link: Link, tensors: list[torch.Tensor]) -> Sent:
        tensors = [t.contiguous() for t in tensors]
        return self.links.transport.start(link.comm, [Op("send", t, link.peer) for t in tensors]), tensors


Forward = tuple[ColocatedOutput | StageOutput, torch.Tensor | None]  # a forward's output and its input leaf
Sent = tuple[Work, list[torch.Tensor]]  # a send in flight and its tensors, kept alive until it completes


def _wait(sent: list[Sent]) -> None:
    for work, _ in sent:
        work.wait()
    sent.clear()
