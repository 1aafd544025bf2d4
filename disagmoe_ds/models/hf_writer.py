"""Write a model's tensors as a Hugging Face ``save_pretrained`` directory, atomically, tokenizer included."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from disagmoe_ds.errors import CheckpointError
from disagmoe_ds.models.loading import load_config

# Files of an HF model directory that are not weights and that save_pretrained does not write.
CARRIED_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
TOKENIZER_FILES = CARRIED_FILES[:8]  # the tokenizer's files among them


def write_hf(
    model_dir: str | Path,
    tensors: dict[str, torch.Tensor],
    out: Path,
    *,
    dtype: torch.dtype,
    tokenizer_dir: Path | None = None,
    tokenizer: Any = None,
) -> Path:
    """``save_pretrained`` of the model in ``model_dir`` holding ``tensors``, into ``out`` (temp dir, then rename;
    an existing ``out`` is replaced only once the new one is complete).

    ``save_pretrained`` reverts HF's load-time weight conversion, so the files have the original per-expert keys.
    The tokenizer is the training run's where known (``tokenizer_dir`` of a checkpoint, or a ``data.Tokenizer``),
    else ``model_dir``'s files.
    """
    config = load_config(model_dir)
    if getattr(config, "quantization_config", None) is not None:  # the tensors are high precision (FP8 dequantized)
        del config.quantization_config
    with torch.device("meta"):  # no random init: every persistent tensor is assigned below
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    _load_into(model, tensors, model_dir)
    partial = out.with_name(f".partial-{out.name}")
    shutil.rmtree(partial, ignore_errors=True)
    with _bars_only_on_a_terminal():
        model.save_pretrained(partial)
    copy_into(present_files(model_dir, CARRIED_FILES), partial)
    add_tokenizer(partial, tokenizer_dir=tokenizer_dir, tokenizer=tokenizer)
    replace_dir(partial, out)
    return out


@contextmanager
def _bars_only_on_a_terminal() -> Iterator[None]:
    """transformers draws a progress bar per save; in a log file (stderr not a terminal) it is only noise."""
    from transformers.utils import logging as hf_logging

    if sys.stderr.isatty() or not hf_logging.is_progress_bar_enabled():
        yield
        return
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.enable_progress_bar()


def add_tokenizer(dest: Path, *, tokenizer_dir: Path | None, tokenizer: Any) -> None:
    """The run's tokenizer files into ``dest``: a checkpoint's ``tokenizer_dir``, or a ``data.Tokenizer``'s."""
    if tokenizer_dir is not None:
        shutil.copytree(tokenizer_dir, dest, dirs_exist_ok=True)
    if tokenizer is not None:
        tokenizer.save_hf(dest)


def present_files(model_dir: str | Path, names: Iterable[str]) -> list[Path]:
    """Those of ``names`` that ``model_dir`` holds (``TOKENIZER_FILES``: none when it has no tokenizer)."""
    return [Path(model_dir) / name for name in names if (Path(model_dir) / name).is_file()]


def copy_into(files: Iterable[Path], dest: Path) -> None:
    """Copy ``files`` into the directory ``dest``, made if missing."""
    dest.mkdir(parents=True, exist_ok=True)
    for file in files:
        shutil.copy2(file, dest / file.name)


def replace_dir(new: Path, out: Path) -> None:
    """Move ``new`` to ``out``; an existing ``out`` is moved aside first and removed after."""
    old = out.with_name(f".old-{out.name}")
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        os.replace(out, old)
    os.replace(new, out)
    shutil.rmtree(old, ignore_errors=True)


def _load_into(model: PreTrainedModel, tensors: dict[str, torch.Tensor], model_dir: str | Path) -> None:
    """Assign ``tensors`` to the (meta) model: same key set and shapes, HF's dtypes, ties kept.

    Tensors are cast to the dtype HF gives each one (``_keep_in_fp32_modules`` keeps some in fp32 in a bf16
    model). ``assign`` replaces tied parameters by separate tensors, so the ties are restored afterwards; a tie
    whose two names hold different values in the checkpoint cannot be written as a tied model.
    """
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    wrong = sorted(n for n in set(expected) & set(tensors) if tensors[n].shape != expected[n].shape)
    if missing or unexpected or wrong:
        raise CheckpointError(
            f"the checkpoint does not match the model in {model_dir}: missing {missing[:3]}, unexpected "
            f"{unexpected[:3]}, wrong shape {wrong[:3]}; pass --model the directory it was trained from"
        )
    diverged = sorted(t for t, s in model.all_tied_weights_keys.items() if not torch.equal(tensors[t], tensors[s]))
    if diverged:
        raise CheckpointError(
            f"{diverged} should be tied to {[model.all_tied_weights_keys[t] for t in diverged]} but differ in the "
            "checkpoint (the head and the embedding were trained on different A-groups); set tie_word_embeddings "
            "false in the config passed as --model to export them untied"
        )
    model.load_state_dict({n: t.to(expected[n].dtype) for n, t in tensors.items()}, strict=True, assign=True)
    model.tie_weights()
