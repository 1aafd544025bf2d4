"""One callable replayed as CUDA graphs (``GraphedPart``): one launch for its forward and one for its backward.

How: as ``torch.cuda.make_graphed_callables`` does (forward and backward captured as one autograd function whose
backward returns the parameters' gradients, which accumulate outside the graph: DeepSpeed's gradient hooks and
ZeRO see them as from any module), with what a pipeline needs on top:

- **slots.** A graph's outputs and saved activations live at fixed addresses, so it must not run again for another
  micro-batch before the backward of the one in flight. A ``GraphedPart`` holds ``slots`` copies, each with its own
  memory pool, one per micro-batch of its layer in flight at once on the rank (``schedule.layer_in_flight``); a
  forward takes a free slot and its backward frees it.
- **variants.** One capture per input structure and shape (no mask, or a packed-documents mask), all in the slot's
  pool: a slot serves one micro-batch at a time, so its variants never hold memory at the same time. A call with
  a structure nobody captured runs the part itself (``misses`` counts them): capturing mid-step could synchronise
  the GPU behind a posted receive.
- **copies out.** The gradients the backward returns are copies: a residual gradient can outlive the slot (it waits
  for the previous layer's backward, which may come after the slot's next replay). Inputs are copied into the
  graph's static inputs (one device copy each); outputs are views of its static outputs, valid until the slot
  runs again, which is after the micro-batch's backward.

Without autograd (``torch.no_grad``: resend's expert forward) the part runs as it is.

``graphs`` says why and which parts of a rank are graphed.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

WARMUP_CALLS = 2  # before capture, on a side stream: compiled parts compile, libraries allocate their workspaces


class GraphError(RuntimeError):
    """A graphed part was used outside what was captured (every slot busy): a bug in the slot count."""


_TENSOR = "tensor"  # the tag of a tensor leaf in a structure key


def _flatten(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """The key of ``obj``'s structure (tensors by shape and dtype, other leaves by value); its tensors go to
    ``tensors`` in order. Written out, not torch's pytree: this runs twice per call on the critical path, and
    pytree's spec hashing cost about a tenth of a graphed part's host time."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return (_TENSOR, tuple(obj.shape), obj.dtype)
    if isinstance(obj, (tuple, list)):
        return (type(obj), tuple(_flatten(x, tensors) for x in obj))
    if isinstance(obj, dict):
        return (dict, tuple((k, _flatten(v, tensors)) for k, v in obj.items()))
    return obj


def _unflatten(key: Any, tensors: Iterator[torch.Tensor]) -> Any:
    """The inverse of ``_flatten``: the structure ``key`` describes, with the next of ``tensors`` at each tensor."""
    if not isinstance(key, tuple):  # a leaf, given by value
        return key
    kind = key[0]
    if kind == _TENSOR:
        return next(tensors)
    if kind is dict:
        return {k: _unflatten(v, tensors) for k, v in key[1]}
    return kind(_unflatten(x, tensors) for x in key[1])  # a tuple or a list


@dataclass(eq=False)
class _Capture:
    """One input structure of one slot: static inputs, the two graphs and their static outputs and gradients."""

    inputs: tuple[torch.Tensor, ...]
    outputs: tuple[torch.Tensor, ...]  # the tensor leaves of the result, detached
    out_key: Any  # the result's structure (``_flatten``)
    grad_outputs: tuple[torch.Tensor | None, ...]  # one per output; None where it is not differentiable
    input_grads: tuple[torch.Tensor | None, ...]  # one per input; None where none is computed
    param_grads: tuple[torch.Tensor | None, ...]  # one per parameter, likewise
    forward: torch.cuda.CUDAGraph
    backward: torch.cuda.CUDAGraph | None  # None: no output is differentiable
    # What each static input last received (a dead reference: nothing yet). Inputs that do not change between
    # calls (a micro-batch's rotary embeddings and position ids are the same tensors every time) are not copied.
    sources: list[weakref.ref | None] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    zeroed: set[int] = field(default_factory=set)  # output gradients whose static buffer holds zeros

    def __post_init__(self) -> None:
        self.sources = [None] * len(self.inputs)
        self.versions = [-1] * len(self.inputs)

    def copy_in(self, tensors: Sequence[torch.Tensor]) -> None:
        """Every given input into its static input, as one multi-tensor launch; skipped where the static input
        already holds it (the same tensor, unmodified since)."""
        pairs = []
        for i, (static, given) in enumerate(zip(self.inputs, tensors, strict=False)):
            source = self.sources[i]
            if static is given or (source is not None and source() is given and self.versions[i] == given._version):
                continue
            pairs.append((static, given))
            self.sources[i], self.versions[i] = weakref.ref(given), given._version
        _copy_all(pairs)

    def copy_grads_in(self, grads: Sequence[torch.Tensor | None]) -> None:
        """The output gradients into the static ones; an output nothing downstream used gets zeros (once: the
        buffer stays zero until a real gradient lands there)."""
        pairs, missing = [], []
        for i, (static, given) in enumerate(zip(self.grad_outputs, grads, strict=True)):
            if static is None:
                continue
            if given is not None:
                pairs.append((static, given))
                self.zeroed.discard(i)
            elif i not in self.zeroed:
                missing.append(static)
                self.zeroed.add(i)
        _copy_all(pairs)
        if missing:
            torch._foreach_zero_(missing)

    def result(self, outputs: Sequence[torch.Tensor]) -> Any:
        return _unflatten(self.out_key, iter(outputs))


@dataclass(eq=False)
class _Slot:
    pool: Any = field(default_factory=torch.cuda.graph_pool_handle)
    captures: dict[Any, _Capture] = field(default_factory=dict)
    busy: bool = False
    grad_ptrs: set[int] = field(default_factory=set)  # where its captures' parameter gradients live

    def keep_grads(self, params: Sequence[nn.Parameter]) -> None:
        """Before any replay in this slot: a parameter whose ``.grad`` still is one of the slot's gradient buffers
        (taken over by autograd, not yet consumed) gets a copy of it. Any replay may write there: a forward's
        temporaries can sit where a backward's gradients were captured, in the pool they share."""
        for param in params:
            if param.grad is not None and param.grad.data_ptr() in self.grad_ptrs:
                param.grad = param.grad.clone()


class GraphedPart:
    """``fn(*args)`` of a part as CUDA graphs; ``args``: tensors in tuples, dicts and None, and hashable values
    (a capture per value, e.g. a pair count).

    Args:
        module: the part; its parameters are the graph's too (the backward returns their gradients).
        fn: the computation, a pure function of ``args`` and ``module``'s parameters.
        slots: micro-batches of this part in flight at once on the rank.
        name: for errors.
    """

    def __init__(self, module: nn.Module, fn: Callable[..., Any], *, slots: int, name: str) -> None:
        if slots < 1:
            raise ValueError(f"{name}: a graphed part needs at least one slot, got {slots}")
        self.fn, self.name = fn, name
        self.params = tuple(module.parameters())
        self.slots = [_Slot() for _ in range(slots)]
        self.misses = 0  # calls whose input structure no capture has: they ran as the part itself

    def forget(self) -> None:
        """Drop every capture (and its memory pool): the next ``capture`` starts afresh."""
        self.slots = [_Slot() for _ in self.slots]

    def capture(self, *args: Any) -> None:
        """Capture ``fn(*args)``'s structure in every slot (before the first step; synchronises the device).

        ``args``' tensors give the shapes and which inputs need gradients; their values do not matter.
        """
        tensors: list[torch.Tensor] = []
        key = _flatten(args, tensors)
        for slot in self.slots:
            if key not in slot.captures:
                capture = slot.captures[key] = self._capture(slot, key, tensors)
                slot.grad_ptrs |= {g.data_ptr() for g in capture.param_grads if g is not None}
        torch.cuda.synchronize()

    def __call__(self, *args: Any) -> Any:
        tensors: list[torch.Tensor] = []
        key = _flatten(args, tensors)
        if not torch.is_grad_enabled() or key not in self.slots[0].captures:
            self.misses += torch.is_grad_enabled()
            return self.fn(*args)
        slot = next((s for s in self.slots if not s.busy), None)
        if slot is None:
            raise GraphError(
                f"{self.name}: all {len(self.slots)} graph slots hold micro-batches whose backward has not run; "
                "the slot count must be the most micro-batches of this part in flight at once"
            )
        capture = slot.captures[key]
        for static, given in zip(capture.inputs, tensors, strict=True):
            if given.requires_grad and not static.requires_grad:
                raise GraphError(f"{self.name}: an input needs a gradient that the captured graph does not compute")
        return capture.result(_Replay.apply(slot, capture, self.params, *tensors, *self.params))

    def _capture(self, slot: _Slot, key: Any, tensors: Sequence[torch.Tensor]) -> _Capture:
        inputs = tuple(t.detach().clone().requires_grad_(t.requires_grad) for t in tensors)
        wrt = [t for t in (*inputs, *self.params) if t.requires_grad]
        static_args = _unflatten(key, iter(inputs))

        def run() -> tuple[Any, list[torch.Tensor]]:
            outputs: list[torch.Tensor] = []
            return _flatten(self.fn(*static_args), outputs), outputs

        stream = _capture_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up and capture on one stream that is not the legacy default
            for _ in range(WARMUP_CALLS):
                _, outputs = run()
                _grads_of(outputs, wrt, [torch.zeros_like(o) for o in outputs if o.requires_grad])
            forward = torch.cuda.CUDAGraph()
            with torch.cuda.graph(forward, pool=slot.pool, stream=stream, capture_error_mode="thread_local"):
                out_key, outputs = run()
            grad_outputs = tuple(torch.zeros_like(o) if o.requires_grad else None for o in outputs)
            backward, grads = None, ()
            if any(g is not None for g in grad_outputs):
                backward = torch.cuda.CUDAGraph()
                with torch.cuda.graph(backward, pool=slot.pool, stream=stream, capture_error_mode="thread_local"):
                    grads = _grads_of(outputs, wrt, [g for g in grad_outputs if g is not None])
        torch.cuda.current_stream().wait_stream(stream)
        computed = iter(grads)
        every = [next(computed) if t.requires_grad and grads else None for t in (*inputs, *self.params)]
        # Nothing of the capture's autograd graph may outlive it: its nodes were made on the capture stream, and a
        # parameter's gradient accumulator kept from there would make every later backward wait across streams.
        detached = tuple(o.detach() for o in outputs)
        n = len(inputs)
        return _Capture(inputs, detached, out_key, grad_outputs, tuple(every[:n]), tuple(every[n:]), forward, backward)


def _capture_stream() -> torch.cuda.Stream:
    """The current stream if the rank computes on one of its own (``cuda_graphs`` jobs: the parameters' gradient
    accumulators belong to it), else a side stream (the legacy default stream cannot capture)."""
    current = torch.cuda.current_stream()
    return torch.cuda.Stream() if current == torch.cuda.default_stream() else current


def _grads_of(outputs: Sequence[torch.Tensor], wrt: Sequence[torch.Tensor], grad_outputs: Sequence[torch.Tensor]):
    differentiable = [o for o in outputs if o.requires_grad]
    if not differentiable or not wrt:
        return ()
    return torch.autograd.grad(differentiable, wrt, grad_outputs, allow_unused=True)


def _copy_all(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``dst.copy_(src)`` for every pair, as one multi-tensor launch."""
    if pairs:
        torch._foreach_copy_([dst for dst, _ in pairs], [src for _, src in pairs])


class _Replay(torch.autograd.Function):
    """The forward graph of one slot and capture; its backward replays the backward graph and frees the slot.

    Gradients out: the inputs' are copies (they can outlive the slot). The parameters' are the graph's buffers
    themselves, which autograd's gradient accumulation takes over as ``.grad`` when a parameter has none (no copy:
    the experts' weight gradients are most of a shard's bytes); before the slot replays anything again, a parameter
    whose ``.grad`` still is such a buffer gets a copy of it (``_Slot.keep_grads``: gradients accumulated in
    ``.grad`` over micro-batches). DeepSpeed's ZeRO-1/2 hooks usually read a ``.grad`` as it lands and drop it.
    """

    @staticmethod
    def forward(ctx, slot: _Slot, capture: _Capture, params: tuple, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        capture.copy_in(tensors)  # the parameters follow the inputs in ``tensors``: they are in place already
        slot.keep_grads(params)
        capture.forward.replay()
        slot.busy = capture.backward is not None
        ctx.slot, ctx.capture, ctx.params = slot, capture, params
        ctx.set_materialize_grads(False)  # an unused output's zeros are written once (``copy_grads_in``)
        outputs = tuple(o.detach() for o in capture.outputs)
        ctx.mark_non_differentiable(*(o for o, g in zip(outputs, capture.grad_outputs, strict=True) if g is None))
        return outputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads: torch.Tensor | None):
        slot, capture = ctx.slot, ctx.capture
        slot.keep_grads(ctx.params)
        capture.copy_grads_in(grads)
        capture.backward.replay()
        slot.busy = False
        input_grads = (g.clone() if g is not None else None for g in capture.input_grads)
        param_grads = (g.detach() if g is not None else None for g in capture.param_grads)
        return None, None, None, *input_grads, *param_grads
