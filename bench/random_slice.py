"""Write the first N decoder layers of a model config as a save_pretrained directory with random weights.

A checkpoint to start GPU runs from (--init-from) where the real weights are too large to bring or not needed: the
tensors are the model's own initialisation, in the config's dtype, built on the device (a 4-layer DeepSeek-V3 slice,
15B parameters, in 40 s on one H100, writing included). The config's quantization_config is dropped (the weights
written are bf16; an FP8 copy is what ``disagmoe-convert to-fp8`` makes), and the bundled corpus's tokenizer is
written beside them.

    python bench/random_slice.py --model hf_models/DeepSeek-V3 --layers 4 --out /tmp/dsv3-4 --device cuda
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from disagmoe_ds.data import bundled_corpus, train_or_load_tokenizer


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF model directory (its config.json)")
    p.add_argument("--layers", type=int, required=True, help="decoder layers to keep, from the first")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    start = time.perf_counter()
    config = AutoConfig.from_pretrained(a.model)
    config.num_hidden_layers = a.layers
    config.__dict__.pop("quantization_config", None)  # the weights written are bf16
    torch.manual_seed(a.seed)
    dtype = getattr(config, "dtype", None) or torch.bfloat16
    with torch.device(a.device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    params = sum(t.numel() for t in model.parameters())
    model.save_pretrained(a.out, max_shard_size="4GB")
    cache = Path(__file__).resolve().parents[1] / ".cache" / "tokenizers"  # run_pretrain.py's --tokenizer-cache
    tokenizer = train_or_load_tokenizer(bundled_corpus(), min(config.vocab_size, 8192), cache)
    tokenizer.save_hf(a.out)
    seconds = time.perf_counter() - start
    print(f"{a.out}: {a.layers} layers of {a.model}, {params:,} parameters ({dtype}), {seconds:.0f} s")


if __name__ == "__main__":
    main()
