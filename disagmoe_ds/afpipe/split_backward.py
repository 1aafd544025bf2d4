"""Split backward of one chunk: input gradients now (B), parameter gradients later (W), from one autograd graph.

B is torch's own zero-bubble helper, ``torch.distributed.pipelining._backward.stage_backward_input``: one autograd
pass from the chunk's pseudo-loss to its input leaves only (autograd skips every edge that leads to a parameter
alone, so the wgrad GEMMs do not run), which also records, at each node where a parameter's path meets the input
path (an "intermediate": the GEMM whose inputs are an activation and a weight), the gradient flowing into it. The
graph is kept (``retain_graph``): a micro-batch's activations stay on the device until its W.

W (``backward_weight``) starts autograd again at those nodes with the recorded gradients, towards the parameters
only, one pass per group of parameters sharing intermediates (torch's ``stage_backward_weight`` rule, with its
clamp against counting a gradient twice through an intermediate below another). Unlike that helper it
accumulates through the parameters' own ``AccumulateGrad`` nodes, inside ``engine.backward``: tensor hooks
(``deepspeed_role.scale_gradients``), DeepSpeed's backward accounting and its epilogue (the bf16 optimizer's fp32
accumulation) apply exactly as to an unsplit backward. The graph is freed when W ends.

What cannot be split, and so runs whole in W or whole in B:

* a chunk without differentiable inputs (the embedding layer of A-group 0): nothing goes upstream, so B does
  nothing and W is the whole backward;
* a ``torch.compile``d part: its backward is one autograd node, which computes every gradient whenever it runs,
  so splitting would run it twice. The runtime therefore gives compiled attention parts and the head no W task
  (``planner.runtime_costs``, ``compiled``); the expert shards' grouped GEMMs are outside their compiled regions
  and split as usual.

ZeRO: ZeRO-2 reduces gradients from hooks during every backward, bucket by bucket, and the replicas of a parameter
must produce them in the same order: with the split, B produces none and W all, through the same hooks, in the same
order on every replica (an expert shard no token reached makes its zero row from its input, so its W reaches every
parameter too: ``ExpertShard._untouched``). An expert side at ZeRO-3 keeps its backward whole (no F-side W task,
``planner.task_costs``): ZeRO-3 releases a shard's parameters after B's module backward, so a later W would
accumulate into empty parameters; gathering them around W passed with one replica but hung with two (the release
found a parameter still active for other micro-batches in flight, and gathering only the released ones
desynchronised the replicas).

Costs of the split: non-reentrant activation checkpointing recomputes a chunk's forward once in B and once in W
(each autograd pass recomputes what it unpacks), and what B recomputed stays alive until W frees the graph; with
activation offload, a chunk's tensors come back to the device for B and stay there until W.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch
from deepspeed import DeepSpeedEngine
from torch import nn
from torch.autograd.graph import GradientEdge, Node
from torch.distributed.pipelining._backward import _get_grad_fn_or_grad_acc, stage_backward_input


@dataclass
class DeferredWeightGrad:
    """What a chunk's B leaves for its W.

    Attributes:
        groups: ``stage_backward_input``'s parameter groups (intermediate nodes, the gradients recorded there, the
            parameters' gradient accumulators).
        params: gradient accumulator -> parameter, for the groups' parameters.
        loss: set instead of ``groups`` when the chunk has no differentiable input: W is its whole backward.
    """

    groups: list[dict[str, Any]] = field(default_factory=list)  # torch's type for them (``stage_backward_input``)
    params: dict[Node, torch.Tensor] = field(default_factory=dict)
    loss: torch.Tensor | None = None


def backward_input(
    loss: torch.Tensor, inputs: Iterable[torch.Tensor | None], params: Iterable[nn.Parameter]
) -> DeferredWeightGrad:
    """B: accumulate d ``loss`` / d ``inputs`` into the inputs' ``.grad`` (no parameter's) and keep what W needs.

    Args:
        loss: the chunk's scalar pseudo-loss (``sum(out * grad)``, or the head's loss).
        inputs: the chunk's input leaves (None and leaves without ``requires_grad`` are skipped).
        params: the rank's parameters (those the chunk does not reach are ignored).
    """
    leaves = [t for t in inputs if t is not None and t.requires_grad]
    if not loss.requires_grad:
        return DeferredWeightGrad()
    if not leaves:
        return DeferredWeightGrad(loss=loss)
    weights = [p for p in params if p.requires_grad]
    _, groups = stage_backward_input([loss], None, leaves, iter(weights))
    # A parameter that requires grad always has its gradient accumulator.
    return DeferredWeightGrad(groups, {cast(Node, _get_grad_fn_or_grad_acc(p)): p for p in weights})


def backward_weight(engine: DeepSpeedEngine, deferred: DeferredWeightGrad) -> None:
    """W: the parameter gradients ``deferred`` holds, accumulated by ``engine.backward`` (see the module docstring)."""
    if deferred.loss is not None:
        engine.backward(deferred.loss, scale_wrt_gas=False)
    elif deferred.groups:
        device = next(iter(deferred.params.values())).device
        anchor = torch.zeros((), device=device, requires_grad=True)
        # torch leaves ``Function.apply`` unannotated (it returns what ``forward`` does: a tensor here)
        loss: torch.Tensor = _WeightPass.apply(anchor, deferred)  # type: ignore[no-untyped-call]
        engine.backward(loss, scale_wrt_gas=False)


class _WeightPassContext(Protocol):
    """torch's ``FunctionCtx`` as ``_WeightPass`` uses it: the deferred pass, kept from its forward to its backward."""

    deferred: DeferredWeightGrad | None


class _WeightPass(torch.autograd.Function):
    """A scalar whose backward runs a deferred weight pass, so that ``engine.backward`` can wrap it."""

    @staticmethod
    def forward(ctx: _WeightPassContext, anchor: torch.Tensor, deferred: DeferredWeightGrad) -> torch.Tensor:
        ctx.deferred = deferred
        return anchor.detach().clone()

    @staticmethod
    def backward(ctx: _WeightPassContext, grad: torch.Tensor) -> tuple[None, None]:
        # ``grad`` is 1: no loss scaling (fp16 is refused; bf16 and fp32 do not scale), as for the input gradients
        # B already sent, which ran outside the engine.
        del grad
        deferred, ctx.deferred = ctx.deferred, None
        assert deferred is not None, "a weight pass runs once"
        for group in deferred.groups:
            _weight_pass(group, deferred.params)
        deferred.groups.clear()  # the recorded gradients and the graph's last references go here
        return None, None


def _weight_pass(group: dict[str, Any], params: dict[Node, torch.Tensor]) -> None:
    """One parameter group's gradients, from its intermediates' recorded gradients (torch's stage_backward_weight,
    accumulating through autograd instead of into ``.grad`` by hand)."""
    intermediates, recorded = group.pop("intermediates"), group.pop("grads", None)
    if recorded is None:  # no gradient reached these nodes in B: none reaches their parameters either
        return
    edges, grads = [], []
    for node, grads_in in zip(intermediates, recorded, strict=True):
        for i, grad in enumerate(grads_in):
            if grad is not None:
                edges.append(GradientEdge(node, i))
                grads.append(grad)
    # An intermediate below another would get that one's gradient again on top of its own recorded total.
    clamps = (
        [n.register_prehook(lambda _, g=g: g) for n, g in zip(intermediates, recorded)]
        if len(intermediates) > 1
        else []
    )
    try:
        if edges:
            torch.autograd.backward(edges, grads, inputs=[params[acc] for acc in group["params"]])
    finally:
        for handle in clamps:
            handle.remove()


def retained_graph_compiles() -> AbstractContextManager[object]:
    """Context for code that may ``torch.compile`` a graph B backpropagates through (the expert shards' compiled
    elementwise middle, on the input path): AOTAutograd otherwise lets a compiled backward reuse ("donate") its
    saved buffers, and then refuses B's ``retain_graph=True``. Read when a graph compiles, so it wraps forwards."""
    patched: AbstractContextManager[object] = torch._functorch.config.patch(donated_buffer=False)  # untyped in torch
    return patched


class ChunkBackward:
    """A runner's chunk backwards: whole through ``engine.backward``, or split (B now, W at ``weight_grad``) for the
    layers whose W tasks the worker's schedule runs.

    Args:
        engine: the rank's DeepSpeed engine (its module's parameters are the weights).
        split_layers: layers whose chunks split; their W must run (``weight_grad``) before ``ReduceGrads``.
    """

    def __init__(self, engine: DeepSpeedEngine, split_layers: frozenset[int] = frozenset()) -> None:
        self.engine, self.split_layers = engine, split_layers
        self.deferred: dict[tuple[int, int], DeferredWeightGrad] = {}  # (layer, micro-batch) -> B's leftovers

    def run(self, key: tuple[int, int], loss: torch.Tensor, inputs: Iterable[torch.Tensor | None]) -> None:
        """The backward of chunk ``key`` from ``loss``: its inputs' ``.grad`` are set on return either way."""
        if key[0] in self.split_layers:
            self.deferred[key] = backward_input(loss, inputs, self.engine.module.parameters())
        else:
            self.engine.backward(loss, scale_wrt_gas=False)

    def weight_grad(self, key: tuple[int, int]) -> None:
        """W of chunk ``key``: its parameter gradients; its activations are freed afterwards."""
        backward_weight(self.engine, self.deferred.pop(key))
