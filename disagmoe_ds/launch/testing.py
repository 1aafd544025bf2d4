"""pytest helpers for multi-rank tests: a rank's failure fails the test with that rank's own traceback."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from disagmoe_ds.launch.local import RankFailedError, spawn_local

# Hard limit for one multi-rank test; a hang must fail loudly, not stall CI.
DEFAULT_TIMEOUT_S = 60.0


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    timeout_s: float = DEFAULT_TIMEOUT_S,
    backend: str = "gloo",
) -> list[Any]:
    """``spawn_local`` for tests: skip when devices are short, turn rank failures and hangs into test failures.

    The failure report is the rank's traceback (or the hung ranks' stacks), not the parent's watch loop.
    """
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs for backend nccl, found {torch.cuda.device_count()}")
    try:
        return spawn_local(fn, world_size, args=args, timeout_s=timeout_s, backend=backend)
    except (RankFailedError, TimeoutError) as err:
        pytest.fail(f"{type(err).__name__}: {err}", pytrace=False)
