"""Deterministic, resumable sample order, split across the data-parallel lanes of an attention group.

Epoch e visits the samples in the order ``randperm(N, seed + e)``; lane j of d takes every d-th entry of it,
starting at j, so lanes are disjoint and each gets ``N // d`` samples (the last ``N % d`` of the permutation,
different samples every epoch, are skipped so that every lane runs the same number of steps). The sampler is
an endless iterator over epochs; its state is (epoch, position in the lane's share), so a run resumed from
``state_dict()`` draws exactly the indices an uninterrupted run would have drawn.

After p steps of every lane, the d lanes have read exactly the first p * d entries of the epoch's permutation.
``regroup`` turns a state of d lanes into one for another lane count: the new lanes split the rest of that epoch
(``skip`` entries are passed over, in that epoch only), so a re-laid-out job still reads each sample once per epoch.

>>> lanes = [ShardedSampler(10, num_lanes=2, lane=j, seed=0) for j in range(2)]
>>> a, b = ([next(s) for _ in range(5)] for s in lanes)
>>> sorted(a + b) == list(range(10))
True
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from disagmoe_ds.data.errors import DataError

_STATE_KEYS = ("num_samples", "num_lanes", "seed", "shuffle", "epoch", "position", "skip")


class ShardedSampler:
    """An endless iterator of sample indices for one lane.

    Args:
        num_samples: N, the dataset size.
        num_lanes: d, data-parallel lanes reading the dataset.
        lane: this lane's index in [0, d).
        seed: fixes every epoch's permutation; all lanes must use the same seed.
        shuffle: False visits samples in index order every epoch (still split across lanes).
    """

    def __init__(self, num_samples: int, *, num_lanes: int = 1, lane: int = 0, seed: int = 0, shuffle: bool = True):
        if num_lanes < 1 or not 0 <= lane < num_lanes:
            raise DataError(f"lane ({lane}) must be in [0, num_lanes) with num_lanes ({num_lanes}) >= 1")
        if num_samples < num_lanes:
            raise DataError(
                f"the dataset has {num_samples} samples, fewer than num_lanes ({num_lanes}); every lane needs one: "
                f"use more data or a shorter seq_len"
            )
        self.num_samples, self.num_lanes, self.lane = num_samples, num_lanes, lane
        self.seed, self.shuffle = seed, shuffle
        self.epoch, self.position, self.skip = 0, 0, 0  # skip: entries of this epoch read before a regroup
        self._indices: list[int] | None = None  # this lane's share of self.epoch, built on first use

    @property
    def samples_per_lane(self) -> int:
        """Samples each lane reads per epoch."""
        return self.num_samples // self.num_lanes

    def epoch_indices(self, epoch: int, skip: int = 0) -> list[int]:
        """This lane's indices for ``epoch``, in visiting order, after the first ``skip`` entries of the epoch."""
        if self.shuffle:
            order = torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(self.seed + epoch))
        else:
            order = torch.arange(self.num_samples)
        return order[skip:][self.lane :: self.num_lanes][: (self.num_samples - skip) // self.num_lanes].tolist()

    def __iter__(self) -> ShardedSampler:
        return self

    def __next__(self) -> int:
        if self._indices is None:
            self._indices = self.epoch_indices(self.epoch, self.skip)
        while self.position == len(self._indices):
            self.epoch, self.position, self.skip = self.epoch + 1, 0, 0
            self._indices = self.epoch_indices(self.epoch)
        index = self._indices[self.position]
        self.position += 1
        return index

    def state_dict(self) -> dict[str, Any]:
        """Where the iteration stands, plus the settings a resume must match."""
        return {key: getattr(self, key) for key in _STATE_KEYS}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continues from ``state``; the dataset size, lanes, seed and shuffle must match the saved run."""
        for key in ("num_samples", "num_lanes", "seed", "shuffle"):
            if state[key] != getattr(self, key):
                raise DataError(
                    f"sampler state has {key}={state[key]} but this run has {key}={getattr(self, key)}; "
                    f"resume with the same data, seq_len, lanes and seed"
                )
        self.epoch, self.position, self._indices = int(state["epoch"]), int(state["position"]), None
        self.skip = int(state.get("skip", 0))  # states saved before regrouping existed have none


def regroup(state: Mapping[str, Any], num_lanes: int) -> dict[str, Any]:
    """A saved state of ``state["num_lanes"]`` lanes as the state of every lane of ``num_lanes`` lanes: the first
    ``skip + position * lanes`` entries of the epoch were read; the new lanes split the rest.

    >>> old = [ShardedSampler(12, num_lanes=2, lane=j) for j in range(2)]
    >>> read = [next(s) for _ in range(2) for s in old]
    >>> new = [ShardedSampler(12, num_lanes=4, lane=j) for j in range(4)]
    >>> for s in new:
    ...     s.load_state_dict(regroup(old[0].state_dict(), 4))
    >>> rest = [next(s) for _ in range(2) for s in new]
    >>> sorted(read + rest) == list(range(12))
    True
    """
    if state["num_lanes"] == num_lanes:
        return dict(state)
    read = int(state.get("skip", 0)) + int(state["position"]) * int(state["num_lanes"])
    return {**state, "num_lanes": num_lanes, "position": 0, "skip": read}
