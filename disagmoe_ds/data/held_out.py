"""Held-out samples for an evaluation loss, and the fixed batches every evaluation runs over them.

``hold_out`` splits a packed dataset's samples in two by a seeded permutation: the held-out ones are never trained
on (the training samples are the others). ``HeldOutBatches`` lays the held-out samples out as evaluation batches of
one training step's shape, so they run through the step's schedule: batch i holds samples ``[i n, (i + 1) n)`` of
``n = lanes x micro-batches x micro-batch size``, lane j the j-th ``micro-batches x micro-batch size`` of them. The
last batch is filled up with copies of sample 0 whose labels are all ``IGNORE_INDEX``: they have the shape the
exchanges expect and add no token to the loss.

>>> data = PackedDataset.from_rows([([i, i], [i, i], [0, 1]) for i in range(10)])
>>> train, held = hold_out(data, 0.3, seed=0)
>>> len(train), len(held), sorted(train.input_ids[:, 0].tolist() + held.input_ids[:, 0].tolist()) == list(range(10))
(7, 3, True)
>>> batches = HeldOutBatches(held, lanes=2, lane=1, micro_batches=1, micro_batch_size=1)
>>> len(batches), [micro_batch["labels"].tolist() for micro_batch in batches[1]]
(2, [[[-100, -100]]])
"""

from __future__ import annotations

import torch

from disagmoe_ds.data.errors import DataError
from disagmoe_ds.data.loader import Batch, collate
from disagmoe_ds.data.packing import IGNORE_INDEX, PackedDataset, labelled_tokens

# Offsets the split's seed from the samplers' epoch seeds (``seed + epoch``), so the held-out draw is not theirs.
_SPLIT_SEED = 1_000_003


def hold_out(dataset: PackedDataset, fraction: float, *, seed: int) -> tuple[PackedDataset, PackedDataset]:
    """(training samples, held-out samples): ``fraction`` of the samples (at least one) chosen by ``seed``, both in
    the dataset's order."""
    held = max(1, round(fraction * len(dataset)))
    if held >= len(dataset):
        raise DataError(
            f"--eval-split {fraction} holds out {held} of the {len(dataset)} samples, leaving none to train on; "
            f"use a smaller fraction or more data"
        )
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed + _SPLIT_SEED))
    return dataset.select(order[held:].sort().values), dataset.select(order[:held].sort().values)


class HeldOutBatches:
    """One lane's micro-batches of each evaluation batch over ``dataset`` (see the module docstring).

    Args:
        lanes: lanes that read distinct data; ``lane`` is this one.
        micro_batches, micro_batch_size: a training step's, so an evaluation batch runs through its schedule.
        limit: at most this many evaluation batches (None: as many as the samples fill).
    """

    def __init__(
        self,
        dataset: PackedDataset,
        *,
        lanes: int,
        lane: int,
        micro_batches: int,
        micro_batch_size: int,
        limit: int | None = None,
    ) -> None:
        self.dataset, self.lane = dataset, lane
        self.micro_batches, self.micro_batch_size = micro_batches, micro_batch_size
        self.per_batch = lanes * micro_batches * micro_batch_size
        whole = -(-len(dataset) // self.per_batch)
        self.count = whole if limit is None else min(limit, whole)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> list[Batch]:
        if not 0 <= index < self.count:
            raise IndexError(f"evaluation batch {index} of {self.count}")
        rows = self.micro_batches * self.micro_batch_size
        first = index * self.per_batch + self.lane * rows
        samples = [self._sample(first + r) for r in range(rows)]
        B = self.micro_batch_size
        return [collate(samples[m * B : (m + 1) * B]) for m in range(self.micro_batches)]

    def _sample(self, index: int) -> dict[str, torch.Tensor]:
        if index < len(self.dataset):
            return self.dataset[index]
        filler = self.dataset[0]
        return {**filler, "labels": torch.full_like(filler["labels"], IGNORE_INDEX)}

    def tokens(self) -> int:
        """The labelled tokens of the evaluation batches, every lane's (what the loss averages over)."""
        samples = min(self.count * self.per_batch, len(self.dataset))
        return int(labelled_tokens(self.dataset.labels[:samples]))
