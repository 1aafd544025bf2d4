"""An HF checkpoint re-written in FP8 blocks (DeepSeek-V3's layout), for a LoRA run whose base stays FP8.

DeepSeek-V3 ships its weights this way: each projection of the decoder layers as e4m3 beside a float32
``..._scale_inv`` per block (128 x 128), its ``config.json`` saying so in ``quantization_config``. A LoRA run over
such a checkpoint keeps its base in FP8 on the ranks (``models.fp8_base``), about one byte per parameter instead of
two: half the GPUs' memory for the frozen base. ``to_fp8_blocks`` gives any checkpoint of a supported family that
layout. Quantized: the decoder layers' projections (attention, shared and dense MLPs, the routed experts, per expert
or fused); kept as they are: embeddings, the LM head, norms, routers and biases. Each block's absolute maximum maps to
e4m3's largest value (``fp8.blocks.quantize_blocks``, DeepSeek's recipe). One weight file (shard) is in memory at a
time, never the whole model.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from disagmoe_ds.errors import CheckpointError
from disagmoe_ds.fp8.blocks import quantize_blocks
from disagmoe_ds.fp8.frozen import SCALE_SUFFIX

INDEX = "model.safetensors.index.json"
DEEPSEEK_BLOCK = (128, 128)


def quantized_name(key: str) -> bool:
    """Whether checkpoint tensor ``key`` is one the layout stores in FP8: a decoder layer's projection weight (the
    routed experts' too, per expert ``...experts.3.gate_proj.weight`` or fused ``...experts.gate_up_proj``), not a
    router (``mlp.gate.weight``), norm or bias.

    >>> [quantized_name(k) for k in ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.mlp.gate.weight",
    ...  "model.layers.0.mlp.experts.gate_up_proj", "model.embed_tokens.weight", "lm_head.weight")]
    [True, False, True, False, False]
    """
    if ".layers." not in key:
        return False
    last = key.rsplit(".", 2)
    fused_experts = last[-2] == "experts" and last[-1].endswith("_proj")
    return key.endswith("proj.weight") or key.endswith("proj_with_mqa.weight") or fused_experts


def to_fp8_blocks(src: Path, out: Path, block: tuple[int, int] = DEEPSEEK_BLOCK, device: str = "cpu") -> int:
    """Write ``src`` (an HF directory of safetensors) to ``out`` in FP8 blocks of ``block`` (rows, columns); returns
    how many tensors were quantized. Every other file of ``src`` (tokenizer, generation config) is copied."""
    config = json.loads((src / "config.json").read_text(encoding="utf-8"))
    if config.get("quantization_config"):
        raise CheckpointError(f"{src} is quantized already ({config['quantization_config'].get('quant_method')})")
    files = _weight_files(src)
    out.mkdir(parents=True)
    quantized, index = 0, dict[str, str]()
    for name in files:
        tensors = {}
        for key, value in _tensors(src / name):
            if quantized_name(key) and value.dim() in (2, 3):
                q = quantize_blocks(value.to(device), block)
                tensors[key], tensors[key + SCALE_SUFFIX] = q.data.cpu(), q.scale_inv.cpu()
                quantized += 1
            else:
                tensors[key] = value
        save_file(tensors, out / name, metadata={"format": "pt"})
        index |= dict.fromkeys(tensors, name)
    if quantized == 0:
        shutil.rmtree(out)
        raise CheckpointError(f"{src} has no decoder-layer projection to quantize (its tensor names are not HF's)")
    if (src / INDEX).is_file():
        total = sum((out / name).stat().st_size for name in files)
        (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": index}, indent=2))
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "weight_block_size": list(block),
        "activation_scheme": "dynamic",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    for other in src.iterdir():
        if other.is_file() and other.name not in {*files, INDEX, "config.json"}:
            shutil.copy2(other, out / other.name)
    return quantized


def _weight_files(src: Path) -> list[str]:
    if (src / INDEX).is_file():
        weight_map = json.loads((src / INDEX).read_text(encoding="utf-8"))["weight_map"]
        return sorted(set(weight_map.values()))
    if (src / "model.safetensors").is_file():
        return ["model.safetensors"]
    raise CheckpointError(f"{src} holds no safetensors weights (model.safetensors or {INDEX})")


def _tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    with safe_open(path, framework="pt") as f:
        for key in f.keys():  # noqa: SIM118  # safe_open is no mapping
            yield key, f.get_tensor(key)
