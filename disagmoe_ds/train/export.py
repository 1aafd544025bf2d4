"""``--export-hf DIR``: the job's current weights as a ``save_pretrained`` directory, written from inside the job.

Every rank hands its share of the module weights (HF names; one copy of each tensor, ``ds_state.module_pieces``)
to rank 0, which assembles the model and writes it with ``hf_writer.write_hf``: the original per-expert keys, the
model directory's config and generation files, and the run's tokenizer, so ``AutoModelForCausalLM`` and
``AutoTokenizer.from_pretrained(DIR)`` load it. DIR is replaced atomically; rank 0 holds the whole model in host
memory while it writes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from disagmoe_ds.data import Tokenizer
from disagmoe_ds.engine.ds_state import join_module_pieces, module_pieces
from disagmoe_ds.models.hf_writer import write_hf
from disagmoe_ds.train.modes import Runtime


def _to_cpu(pieces: dict[str, Any]) -> dict[str, Any]:
    return {kind: {n: (first, t.cpu()) for n, (first, t) in named.items()} for kind, named in pieces.items()}


def export_hf(
    runtime: Runtime, model_dir: Path, out: Path, *, dtype: torch.dtype, tokenizer: Tokenizer | None
) -> Path | None:
    """Write the model to ``out`` (collective); returns ``out`` on rank 0, None elsewhere."""
    mine = _to_cpu(module_pieces(runtime))
    gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    written = None
    if gathered is not None:
        written = write_hf(model_dir, join_module_pieces(gathered), out, dtype=dtype, tokenizer=tokenizer)
    dist.barrier()  # nobody moves on (or exits) while rank 0 writes
    return written
