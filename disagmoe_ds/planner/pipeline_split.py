"""Which decoder layers each virtual pipeline stage of the co-located baseline holds (pure Python).

Megatron-Core splits L layers over pp x vpp virtual stages evenly when they divide, and otherwise gives the first
and the last virtual stage fewer layers (``--decoder-first/last-pipeline-num-layers``, or the same split that
``--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split`` gives: the embedding and the
loss take a layer's place). So PP need not divide the layer count: Qwen3-235B-A22B's 94 layers run at PP 8 x VPP 4
as 2 + 30 x 3 + 2, DeepSeek-V3's 61 at PP 16 as 3 + 14 x 4 + 2. An end stage may hold no decoder layer (only the
embedding, or the LM head and loss): Qwen3-235B-A22B at PP 32 x VPP 3 is 0 + 94 x 1 + 0, as Megatron runs it.

>>> [len(c) for c in chunk_layers(94, 8, 4)][:3], [len(c) for c in chunk_layers(94, 8, 4)][-2:]
([2, 3, 3], [3, 2])
>>> [len(c) for c in chunk_layers(61, 16, 1)][:2], [len(c) for c in chunk_layers(61, 16, 1)][-1]
([3, 4], 2)
>>> chunk_layers(8, 4, 1)
(range(0, 2), range(2, 4), range(4, 6), range(6, 8))
>>> chunk_sizes(94, 32, 3)[:2], chunk_sizes(94, 32, 3)[-1]
((0, 1), 0)
>>> chunk_layers(1, 4, 1) is None  # the ends cannot absorb an excess of 3
True
"""

from __future__ import annotations


def chunk_sizes(num_layers: int, pp: int, vpp: int) -> tuple[int, ...] | None:
    """Layers per virtual stage in execution order (chunk k of stage r is index k * pp + r), or None when no split
    with even middle stages and smaller first and last stages exists (an end may be empty)."""
    n = pp * vpp
    if n == 1:
        return (num_layers,)
    if num_layers % n == 0:
        return (num_layers // n,) * n
    middle = -(-num_layers // n)  # the middle stages hold ceil(L / n); the ends give back the excess
    excess = middle * n - num_layers
    first, last = middle - excess // 2, middle - (excess + 1) // 2  # the last also holds the LM head
    if first < 0 or last < 0:
        return None
    return (first,) + (middle,) * (n - 2) + (last,)


def chunk_layers(num_layers: int, pp: int, vpp: int) -> tuple[range, ...] | None:
    """The layer range of each virtual stage in order, or None (``chunk_sizes``)."""
    sizes = chunk_sizes(num_layers, pp, vpp)
    if sizes is None:
        return None
    out, start = [], 0
    for size in sizes:
        out.append(range(start, start + size))
        start += size
    return tuple(out)


def stage_layers(num_layers: int, pp: int, vpp: int, stage: int) -> list[int]:
    """Every layer pipeline stage ``stage`` holds (its vpp chunks, interleaved)."""
    chunks = chunk_layers(num_layers, pp, vpp)
    assert chunks is not None, f"{num_layers} layers do not split over PP {pp} x VPP {vpp}"
    return [i for k, chunk in enumerate(chunks) if k % pp == stage for i in chunk]
