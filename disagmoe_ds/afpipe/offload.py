"""Activation offload to host memory: the planner's "offload" variant, a share f of each side's layers.

Between a chunk's forward and its backward many micro-batches are in flight, and autograd's saved tensors are what
fills the GPU. For the chunks of the chosen layers (``offloaded_layers``) a ``saved_tensors_hooks`` pair copies
every saved tensor to host memory during the forward (on GPUs: pinned buffers, a side stream) and brings it back for
the backward: when the backward before it in the worker's schedule starts (prefetch), at its own start at the
latest. So a rank holds two offloaded chunks on the device for the backward (the one running, the one prefetched),
plus at most one whose copy out is finishing: the planner's copy window of two layers
(``planner.memory._offload_window``), and one more at the worst moment. On a CPU the host copy is a clone and the way
back a no-op: the same code path without streams, which is what the CPU tests run.

What stays on the device: parameters (also ZeRO's flat buffers, by storage), tensors under ``MIN_BYTES`` (their copy
costs more launches than memory), tensors of another device or a tensor subclass, and whatever the runner itself
holds (a chunk's input leaves and the outputs its backward starts from). Saved views of one storage are copied once,
as the storage, and come back as views of it (q, k, v of a fused projection; an expanded mask stays small); a view
into a storage more than twice its size is copied alone.

Checkpointed chunks save only their inputs through these hooks (non-reentrant checkpointing saves them with the
hooks in force, and recomputes under its own), and compiled parts save theirs through them too (AOTAutograd's
autograd function calls ``save_for_backward``); ``tests/test_offload.py`` checks both.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial

import torch

Key = tuple[int, int]  # (layer, micro-batch): one chunk
MIN_BYTES = 1024  # smaller saved tensors (scalars, per-expert statistics) stay on the device


def offloaded_layers(layers: Sequence[int], share: float) -> frozenset[int]:
    """The layers (of a worker's, in forward order) whose chunks go to host memory: the first ceil(share x count).

    At least the share the planner asked for, so its memory estimate holds. The first layers' activations wait the
    longest for their backward, so the copies have the most time to hide, and the last layers, whose backward
    follows their forward almost at once (the turn), stay on the device.

    >>> sorted(offloaded_layers([0, 2, 4, 6], 0.5)), sorted(offloaded_layers([1, 3, 5], 0.5))
    ([0, 2], [1, 3])
    """
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"offload share must be in [0, 1], got {share}")
    ordered = sorted(layers)
    return frozenset(ordered[: math.ceil(share * len(ordered) - 1e-9)])


@dataclass
class _Storage:
    """One saved storage: its bytes in host memory after the forward, on the device again after the load."""

    host: torch.Tensor | None  # uint8
    device: torch.Tensor | None = None  # uint8, set by the load


@dataclass
class _ChunkCopy:
    """One chunk's saved tensors on their way to host memory and back."""

    storages: list[_Storage] = field(default_factory=list)
    by_address: dict[int, _Storage] = field(default_factory=dict)  # whole storages, by the original's address
    originals: list[torch.Tensor] = field(default_factory=list)  # held until the forward ends: no address reused
    copied: torch.cuda.Event | None = None  # the copies out are done (GPU)
    ready: torch.cuda.Event | None = None  # the copies back are done (GPU)
    loaded: bool = False

    @property
    def host_bytes(self) -> int:
        return sum(s.host.numel() for s in self.storages if s.host is not None)


@dataclass(frozen=True)
class _Packed:
    """What autograd keeps of one offloaded saved tensor: where its bytes are and how to view them."""

    chunk: _ChunkCopy
    storage: _Storage
    dtype: torch.dtype
    offset: int  # in elements of ``dtype``
    size: tuple[int, ...]
    stride: tuple[int, ...]
    original: weakref.ref[torch.Tensor]  # the saved tensor and its version then: autograd's in-place check, kept
    version: int

    def view(self) -> torch.Tensor:
        saved = self.original()
        if saved is not None and saved._version != self.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace operation "
                f"after its chunk's forward saved it (offloaded to host memory at version {self.version}, now "
                f"{saved._version})"
            )
        assert self.storage.device is not None
        out = torch.empty(0, dtype=self.dtype, device=self.storage.device.device)
        return out.set_(self.storage.device.untyped_storage(), self.offset, self.size, self.stride)


def _bytes_of(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


class ActivationOffloader:
    """Offloads the saved tensors of one rank's chosen chunks: ``with forward(key)`` around a chunk's forward,
    ``with backward(key)`` around its backward.

    Args:
        layers: the layers of which this rank runs chunks to offload (``offloaded_layers``).
        device: the rank's device; a CUDA device gets pinned host buffers and two copy streams (out, back).
        params: the rank's parameters, never copied (checked by storage, so ZeRO's flat buffers count too).
        backward_order: this rank's backward chunks in schedule order, one step (for the prefetch).
        min_bytes: saved tensors smaller than this stay on the device.
    """

    def __init__(
        self,
        layers: Iterable[int],
        *,
        device: torch.device,
        params: Iterable[torch.Tensor] = (),
        backward_order: Sequence[Key] = (),
        min_bytes: int = MIN_BYTES,
    ):
        self.layers = frozenset(layers)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device  # with its index: saved tensors are matched against it
        self.params = list(params)
        self.min_bytes = min_bytes
        ours = [key for key in backward_order if key[0] in self.layers]
        self.next = dict(zip(ours, ours[1:]))  # chunk -> the offloaded chunk whose backward comes next
        cuda = device.type == "cuda"
        self.out_stream = torch.cuda.Stream(device) if cuda else None
        self.back_stream = torch.cuda.Stream(device) if cuda else None
        self.chunks: dict[Key, _ChunkCopy] = {}
        self.tensors_out = 0  # saved tensors sent to host memory so far (tests, logs)
        self.bytes_out = 0  # bytes copied out so far (each storage once)

    @property
    def host_bytes(self) -> int:
        """Bytes of saved tensors in host memory now."""
        return sum(chunk.host_bytes for chunk in self.chunks.values())

    @contextmanager
    def forward(self, key: Key) -> Iterator[None]:
        """Run a chunk's forward: its saved tensors go to host memory if its layer is offloaded."""
        if key[0] not in self.layers:
            yield
            return
        chunk = self.chunks[key] = _ChunkCopy()
        keep = {p.untyped_storage().data_ptr() for p in self.params}
        with torch.autograd.graph.saved_tensors_hooks(partial(self._pack, chunk, keep), self._unpack):
            yield
        if self.out_stream is not None:
            chunk.copied = self.out_stream.record_event()
        chunk.originals.clear()  # the allocator reuses them only after the copies (``record_stream``)

    @contextmanager
    def backward(self, key: Key) -> Iterator[None]:
        """Run a chunk's backward: its tensors come back now unless prefetched, and the next offloaded chunk's
        start coming back; the chunk's copies are dropped afterwards."""
        chunk = self.chunks.get(key)
        if chunk is not None:
            self._load(chunk)
        following = self.chunks.get(self.next[key]) if key in self.next else None  # None before its forward
        if following is not None:
            self._load(following)
        try:
            yield
        finally:
            self.chunks.pop(key, None)

    # ----- hooks -----
    def _pack(self, chunk: _ChunkCopy, keep: set[int], t: torch.Tensor) -> torch.Tensor | _Packed:
        if (
            type(t) is not torch.Tensor  # parameters, subclasses, fake tensors while tracing
            or t.device != self.device
            or t.layout != torch.strided
            or t.numel() * t.element_size() < self.min_bytes
            or t.untyped_storage().data_ptr() in keep
        ):
            return t
        self.tensors_out += 1
        storage = t.untyped_storage()
        if storage.nbytes() > 2 * t.numel() * t.element_size():  # a small view of a large storage: itself alone
            stored = self._copy_out(t, chunk)
            contiguous = torch.empty(t.shape, device="meta").stride()
            return _Packed(chunk, stored, t.dtype, 0, t.shape, contiguous, weakref.ref(t), t._version)
        address = storage.data_ptr()  # else the storage, once for all its views
        if address not in chunk.by_address:
            chunk.by_address[address] = self._copy_out(_bytes_of(storage, t.device), chunk)
        stored = chunk.by_address[address]
        return _Packed(chunk, stored, t.dtype, int(t.storage_offset()), t.shape, t.stride(), weakref.ref(t), t._version)

    def _unpack(self, packed: torch.Tensor | _Packed) -> torch.Tensor:
        if not isinstance(packed, _Packed):
            return packed
        self._load(packed.chunk)  # a no-op once loaded; also serves a backward run without ``backward(key)``
        if packed.chunk.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(packed.chunk.ready)
        return packed.view()

    # ----- copies -----
    def _copy_out(self, src: torch.Tensor, chunk: _ChunkCopy) -> _Storage:
        """Start copying ``src`` to a new (dense) host buffer; it stays referenced until the chunk's forward ends."""
        host = torch.empty(src.shape, dtype=src.dtype, pin_memory=self.out_stream is not None)
        with self._on(self.out_stream):
            host.copy_(src, non_blocking=True)
        if self.out_stream is not None:
            src.record_stream(self.out_stream)  # its memory is not reused before the copy has read it
        chunk.originals.append(src)
        self.bytes_out += host.numel() * host.element_size()
        chunk.storages.append(_Storage(_bytes_of(host.untyped_storage(), host.device)))
        return chunk.storages[-1]

    def _load(self, chunk: _ChunkCopy) -> None:
        """Start copying a chunk's storages back to the device (after their copies out)."""
        if chunk.loaded:
            return
        chunk.loaded = True
        compute = torch.cuda.current_stream(self.device) if self.back_stream is not None else None
        if self.back_stream is not None and chunk.copied is not None:
            self.back_stream.wait_event(chunk.copied)
        with self._on(self.back_stream, after_compute=False):  # a prefetch need not wait for queued compute
            for stored in chunk.storages:
                assert stored.host is not None
                stored.device = stored.host.to(self.device, non_blocking=True)
                if compute is not None:
                    stored.device.record_stream(compute)  # allocated on the copy stream, used by the compute one
                stored.host = None  # the host allocator keeps the buffer until the copy has read it
        if self.back_stream is not None:
            chunk.ready = self.back_stream.record_event()

    def _on(self, stream: torch.cuda.Stream | None, *, after_compute: bool = True) -> AbstractContextManager[object]:
        """Work on ``stream``, after what the compute stream has queued so far (nothing to order on CPUs)."""
        if stream is None:
            return nullcontext()
        if after_compute:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(stream)
