"""Micro-batches for one optimizer step, prepared by a background thread so the GPU never waits for data.

Each ``next(loader)`` returns ``num_micro_batches`` dicts of int64 tensors of shape [micro_batch_size, S]
(the keys of the dataset's samples). A thread draws indices from the sampler, stacks the samples and puts
whole steps into a queue of at most ``prefetch`` steps. The thread runs ahead of the consumer, so the resume
point is not the sampler's live state: each queued step carries the sampler state right after it, and
``state_dict()`` returns the state of the last step handed out. Stopping the thread (``close()``,
``load_state_dict()``) rewinds the sampler to that point, so prefetched steps are drawn again, never lost.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from disagmoe_ds.data.errors import DataError
from disagmoe_ds.data.sampler import ShardedSampler

Batch = dict[str, torch.Tensor]
_POLL_S = 0.1  # how often a blocked producer checks whether it should stop


class SampleDataset(Protocol):
    def __len__(self) -> int: ...
    def __getitem__(self, index: int) -> Mapping[str, torch.Tensor]: ...


class _Failure:
    """An exception raised in the producer thread, re-raised in the consumer."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


def collate(samples: Sequence[Mapping[str, torch.Tensor]], pin_memory: bool = False) -> Batch:
    """Stacks [S] samples into [B, S] tensors; pinned memory lets the host-to-device copy run asynchronously."""
    batch = {key: torch.stack([sample[key] for sample in samples]) for key in samples[0]}
    return {key: value.pin_memory() for key, value in batch.items()} if pin_memory else batch


class MicroBatchLoader:
    """Steps of micro-batches from a dataset in the order of a ``ShardedSampler``.

    Args:
        dataset: indexable samples (e.g. ``PackedDataset``).
        sampler: this lane's sampler; the loader owns it from now on (the thread advances it).
        micro_batch_size: samples per micro-batch.
        num_micro_batches: micro-batches per optimizer step.
        prefetch: steps prepared ahead (bounded, so memory stays bounded).
        pin_memory: pin the tensors for asynchronous copies to a GPU (needs a CUDA build of torch).
    """

    def __init__(
        self,
        dataset: SampleDataset,
        sampler: ShardedSampler,
        *,
        micro_batch_size: int,
        num_micro_batches: int,
        prefetch: int = 2,
        pin_memory: bool = False,
    ) -> None:
        if micro_batch_size < 1 or num_micro_batches < 1 or prefetch < 1:
            raise DataError(
                f"micro_batch_size ({micro_batch_size}), num_micro_batches ({num_micro_batches}) and prefetch "
                f"({prefetch}) must all be >= 1"
            )
        if sampler.num_samples != len(dataset):
            raise DataError(f"sampler covers {sampler.num_samples} samples but the dataset has {len(dataset)}")
        self.dataset, self.sampler = dataset, sampler
        self.micro_batch_size, self.num_micro_batches = micro_batch_size, num_micro_batches
        self.prefetch, self.pin_memory = prefetch, pin_memory
        self._consumed_state = sampler.state_dict()
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=prefetch)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _make_step(self) -> list[Batch]:
        step = []
        for _ in range(self.num_micro_batches):
            samples = [self.dataset[next(self.sampler)] for _ in range(self.micro_batch_size)]
            step.append(collate(samples, self.pin_memory))
        return step

    def _put(self, item: Any) -> bool:
        """Blocks while the queue is full; gives up (False) once asked to stop."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self) -> None:
        try:
            while self._put((self._make_step(), self.sampler.state_dict())):
                pass
        except BaseException as error:  # handed to the consumer, which re-raises it
            self._put(_Failure(error))

    def _start(self) -> None:
        self._stop.clear()
        self._queue = queue.Queue(maxsize=self.prefetch)
        self._thread = threading.Thread(target=self._produce, name="MicroBatchLoader", daemon=True)
        self._thread.start()

    def __iter__(self) -> MicroBatchLoader:
        return self

    def __next__(self) -> list[Batch]:
        if self._thread is None:
            self._start()
        item = self._queue.get()
        if isinstance(item, _Failure):
            self.close()
            raise item.error
        step, self._consumed_state = item
        return step

    def close(self) -> None:
        """Stops and joins the thread, drops prefetched steps and rewinds the sampler to the last step handed out.

        Iterating again afterwards restarts the thread and continues exactly where the consumer stopped.
        """
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        self.sampler.load_state_dict(self._consumed_state)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def state_dict(self) -> dict[str, Any]:
        """The sampler state after the last step handed out (not after the prefetched ones)."""
        return {"sampler": dict(self._consumed_state)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continues from a saved ``state_dict()``: the next step is the one that followed it in the saved run."""
        self.close()
        self.sampler.load_state_dict(state["sampler"])
        self._consumed_state = self.sampler.state_dict()

    def __enter__(self) -> MicroBatchLoader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def to_device(batches: list[dict[str, torch.Tensor]], device: torch.device) -> list[dict[str, torch.Tensor]]:
    """Micro-batches moved to ``device``; pinned host tensors copy asynchronously, overlapping the previous
    micro-batch's compute."""
    return [{key: value.to(device, non_blocking=True) for key, value in mb.items()} for mb in batches]
