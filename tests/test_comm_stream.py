"""Receives on a side CUDA stream (``CommStream``): the host reads a header without waiting for queued compute, and
the compute stream sees the payload. NCCL itself needs two GPUs; here ``dist.irecv`` is replaced by a stand-in
that delivers on the stream it is called on and returns a work whose ``wait`` is a device-side wait of the caller's
stream, as ProcessGroupNCCL's is. The CUDA cases run on the GPU machine and are skipped elsewhere."""

from __future__ import annotations

from collections import deque

import pytest
import torch

from disagmoe_ds.comm import channel
from disagmoe_ds.comm.channel import CommStream, Link, MessageSpec, Receiver, TensorSpec

CUDA = torch.device("cuda")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
SPEC = MessageSpec((TensorSpec(torch.float32, (4,)), TensorSpec(torch.int64, (2,))), name="test")
BUSY_CYCLES = 1_500_000_000  # about a second of one SM spinning: compute queued ahead of the receive


class _DeviceWork:
    """A finished transfer as NCCL reports it: ``wait`` makes the *current* stream wait for it."""

    def __init__(self) -> None:
        self.done = torch.cuda.Event()
        self.done.record()

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self.done)


class _Wire:
    """Stands in for ``dist.irecv``: each receive takes the next tensor sent on its group, on the current stream."""

    def __init__(self, messages: list[tuple[torch.Tensor, ...]]) -> None:
        self.queues = {"header": deque(), "payload": deque()}
        for i, tensors in enumerate(messages):
            rows = tensors[0].shape[0]
            self.queues["header"].append(torch.tensor([rows, SPEC.fingerprint, i, 7 * i]))
            self.queues["payload"].extend(tensors)
        self.streams: list[torch.cuda.Stream] = []

    def irecv(self, tensor: torch.Tensor, src: int, group: str) -> _DeviceWork:
        del src
        self.streams.append(torch.cuda.current_stream())
        tensor.copy_(self.queues[group].popleft().to(tensor.device), non_blocking=True)
        return _DeviceWork()


def _receiver(monkeypatch, messages, comm: CommStream) -> tuple[Receiver, _Wire]:
    wire = _Wire(messages)
    monkeypatch.setattr(channel.dist, "irecv", wire.irecv)
    return Receiver(Link(0, 1, "header", "payload"), SPEC, CUDA, comm), wire


def _message(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 4, generator=g), torch.randint(0, 100, (rows, 2), generator=g)


def test_disabled_or_cpu_is_the_current_stream():
    for comm in (CommStream(torch.device("cpu")), CommStream(CUDA, enabled=False)):
        assert comm.stream is None
        with comm.scope():
            pass  # a null context


@needs_cuda
def test_header_read_does_not_wait_for_queued_compute(monkeypatch):
    messages = [_message(5, 0), _message(3, 1)]
    receiver, wire = _receiver(monkeypatch, messages, CommStream(CUDA))
    receiver.post()
    torch.cuda.synchronize()  # the header has "arrived"
    torch.cuda._sleep(BUSY_CYCLES)  # compute queued on the current stream
    busy = torch.cuda.Event()
    busy.record()
    rows, meta = receiver.wait_header(tag=0)
    assert (rows, meta) == (5, 0)
    assert not busy.query(), "the host waited for the compute stream to read a header"
    with receiver.comm.scope():
        tensors = SPEC.empty(rows, CUDA)
    receiver.comm.hand_over(receiver.irecv_payload(tensors), tensors)
    assert all(s == receiver.comm.stream for s in wire.streams), "receives must be posted on the side stream"
    for got, sent in zip(tensors, messages[0], strict=True):
        assert torch.equal(got.cpu(), sent)  # read on the compute stream, after hand_over
    second = receiver.wait(tag=1)
    assert [t.cpu().tolist() for t in second] == [t.tolist() for t in messages[1]]


@needs_cuda
def test_compute_stream_sees_payloads_written_late_on_the_side_stream():
    comm = CommStream(CUDA)
    with comm.scope():
        buffer = torch.zeros(1 << 20, device=CUDA)
        torch.cuda._sleep(BUSY_CYCLES)  # a slow transfer
        buffer.fill_(3.0)
        work = _DeviceWork()
    comm.hand_over([work], [buffer])
    assert buffer.sum().item() == 3.0 * (1 << 20)  # the compute stream waited for the "transfer" on the device


@needs_cuda
def test_without_the_side_stream_the_header_read_waits(monkeypatch):
    """The contrast: receiving on the compute stream drains it (why ``CommStream`` exists)."""
    receiver, _ = _receiver(monkeypatch, [_message(2, 0)], CommStream(CUDA, enabled=False))
    receiver.post()
    torch.cuda._sleep(BUSY_CYCLES)
    busy = torch.cuda.Event()
    busy.record()
    receiver.wait(tag=0)
    assert busy.query()
