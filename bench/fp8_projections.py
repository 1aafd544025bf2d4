"""Each attention-side projection of a model's MoE layer in FP8 against bf16, one by one, on one GPU: which of them the
FP8 lever's shape rule (``fp8.shapes.fp8_pays``) should put in FP8.

    python bench/fp8_projections.py --model hf_models/DeepSeek-V3 hf_models/Qwen3-30B-A3B --tokens 4096

For every distinct projection shape of the layer's attention part (attention, dense and shared-expert MLPs; not the
router, nor gates) it times one compiled forward and backward (input and weight gradients) of ``F.linear`` and of the
lever's ``fp8.projections.fp8_linear`` (both operands quantized in every call, as the runtime does for a projection),
on random bf16 inputs of ``--tokens`` rows. Each compiled alone, so a quantization fuses with nothing around it: an
upper bound on what FP8 costs inside the compiled attention part. Prints a table with each shape's harmonic width
``K N / (K + N)`` (FP8's saving grows with M K N, the quantizations around it with M (K + N)) and what the rule does
today; ``--json`` writes the rows.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fp8_grouped_gemms import timed_ms  # noqa: E402

from disagmoe_ds.fp8.modules import fp8_eligible  # noqa: E402
from disagmoe_ds.fp8.projections import fp8_linear  # noqa: E402
from disagmoe_ds.fp8.shapes import fp8_pays, harmonic_width  # noqa: E402
from disagmoe_ds.models.one_layer import one_layer_model  # noqa: E402
from disagmoe_ds.models.parts import AttentionStage  # noqa: E402


def projections(model_dir: str) -> dict[tuple[int, int], list[str]]:
    """``{(in_features, out_features): names}`` of the layer's attention-part projections the lever may convert."""
    config = AutoConfig.from_pretrained(model_dir)
    model = one_layer_model(config, device="meta", dtype=torch.bfloat16)
    part = AttentionStage(model, (0,), with_embedding=False, with_head=False).part(0)
    skipped = {id(m) for m in part.router.modules()} if part.is_moe else set()
    shapes: dict[tuple[int, int], list[str]] = {}
    for name, sub in part.named_modules():
        if isinstance(sub, torch.nn.Linear) and id(sub) not in skipped and fp8_eligible(name, sub, bf16_width=0):
            shapes.setdefault((sub.in_features, sub.out_features), []).append(name.rsplit(".", 1)[-1])
    return shapes


def fwd_bwd_ms(fn, tokens: int, in_features: int, out_features: int, iters: int) -> float:
    """Milliseconds of one compiled forward and backward of ``fn(x, weight)`` (both gradients)."""
    x = torch.randn(tokens, in_features, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(out_features, in_features, device="cuda") / in_features**0.5).to(torch.bfloat16)
    weight.requires_grad_()
    dy = torch.randn(tokens, out_features, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(fn, dynamic=False)

    def step() -> None:
        x.grad = weight.grad = None
        compiled(x, weight).backward(dy)

    return timed_ms(step, iters)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", nargs="+", required=True, help="model directories (config.json; no weights read)")
    parser.add_argument("--tokens", type=int, default=4096, help="rows of each GEMM (tokens of a micro-batch)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args(argv)
    rows = []
    header = ("model", "projection", "K -> N", "harmonic", "bf16 ms", "FP8 ms", "FP8 x", "rule")
    print("{:<18} {:<28} {:>14} {:>9} {:>8} {:>8} {:>6} {}".format(*header))
    for model_dir in args.model:
        for (k, n), names in sorted(projections(model_dir).items(), key=lambda kv: harmonic_width(*kv[0])):
            bf16 = fwd_bwd_ms(F.linear, args.tokens, k, n, args.iters)
            fp8 = fwd_bwd_ms(fp8_linear, args.tokens, k, n, args.iters)
            torch._dynamo.reset()
            row = {
                "model": Path(model_dir).name, "projections": names, "in": k, "out": n, "tokens": args.tokens,
                "harmonic": round(harmonic_width(k, n)), "bf16_ms": bf16, "fp8_ms": fp8, "fp8_today": fp8_pays(k, n),
            }  # fmt: skip
            rows.append(row)
            print(
                f"{row['model']:<18} {','.join(names):<28} {f'{k} -> {n}':>14} {row['harmonic']:>9} {bf16:>8.3f} "
                f"{fp8:>8.3f} {bf16 / fp8:>5.2f}x {'FP8' if row['fp8_today'] else 'bf16'}",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
