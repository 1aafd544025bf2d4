"""``--export-hf DIR``: the job's current weights as a ``save_pretrained`` directory, written from inside the job.

Every rank hands its share of the module weights (HF names; one copy of each tensor, ``ds_state.module_pieces``)
to rank 0, which assembles the model and writes it with ``hf_writer.write_hf``: the original per-expert keys, the
model directory's config and generation files, and the run's tokenizer, so ``AutoModelForCausalLM`` and
``AutoTokenizer.from_pretrained(DIR)`` load it. DIR is replaced atomically; rank 0 holds the whole model in host
memory while it writes.

A LoRA run (``models.lora``) writes a PEFT adapter directory instead (``peft_format.write_adapter``; the tokenizer
beside it), and with ``merged`` the model with its adapters merged into the weights, as above.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from disagmoe_ds.checkpoint.ds_state import join_module_pieces, module_pieces
from disagmoe_ds.data import Tokenizer
from disagmoe_ds.models import peft_format
from disagmoe_ds.models.hf_writer import write_hf
from disagmoe_ds.models.loading import load_config
from disagmoe_ds.models.lora_settings import LoraSettings
from disagmoe_ds.runtime.rank import RankRuntime


def _to_cpu(pieces: dict[str, Any]) -> dict[str, Any]:
    return {
        kind: {n: (first, t.cpu(), *dim) for n, (first, t, *dim) in named.items()} for kind, named in pieces.items()
    }


def write_model(
    tensors: dict[str, torch.Tensor],
    model_dir: Path,
    out: Path,
    *,
    dtype: torch.dtype,
    lora: LoraSettings | None,
    merged: bool,
    tokenizer: Tokenizer | None = None,
    tokenizer_dir: Path | None = None,
) -> Path:
    """The model in ``tensors`` (HF names) as an HF directory, or a LoRA run's as its PEFT adapter directory (base:
    ``model_dir``) or, ``merged``, with the adapters merged into the weights; atomically, with the tokenizer."""
    if lora is None or merged:
        if lora is not None:
            tensors = peft_format.merged(tensors, lora, transposed=peft_format.experts_transposed(model_dir))
        return write_hf(model_dir, tensors, out, dtype=dtype, tokenizer=tokenizer, tokenizer_dir=tokenizer_dir)
    return peft_format.write_adapter(
        tensors,
        lora,
        out,
        config=load_config(model_dir),
        base_model=str(model_dir),
        dtype=dtype,
        tokenizer=tokenizer,
        tokenizer_dir=tokenizer_dir,
    )


def export_hf(
    runtime: RankRuntime,
    model_dir: Path,
    out: Path,
    *,
    dtype: torch.dtype,
    tokenizer: Tokenizer | None,
    lora: LoraSettings | None = None,
    merged: bool = False,
) -> Path | None:
    """Write the model to ``out`` (collective); returns ``out`` on rank 0, None elsewhere. With ``lora``: the PEFT
    adapter directory (base: ``model_dir``), or with ``merged`` the model with the adapters merged."""
    mine = _to_cpu(module_pieces(runtime))
    gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    written = None
    if gathered is not None:
        tensors = join_module_pieces(gathered)
        written = write_model(tensors, model_dir, out, dtype=dtype, lora=lora, merged=merged, tokenizer=tokenizer)
    dist.barrier()  # nobody moves on (or exits) while rank 0 writes
    return written
