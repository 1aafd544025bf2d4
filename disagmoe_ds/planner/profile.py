"""``disagmoe-plan profile``: measure one MoE layer's attention part and expert part, forward and backward, on
this machine, and write a profile JSON the planner uses instead of peak x efficiency.

torch and transformers are imported lazily, inside the measuring functions only; the profile's format, reading
it and fitting it (``profile_fit.py``) are pure Python, so the planner stays torch-free.

What is measured is pluggable: ``--parts module:function`` names a factory
``function(config, *, layer_index, seq_len, micro_batch_size, device, dtype) -> (attention_fn, experts_fn)``
whose two callables each run one forward and return the output tensors to back-propagate from. The default,
``disagmoe_ds.models.one_layer:disagmoe_parts``, times the project's own attention part and expert shard (what
the runtime runs). ``hf_decoder_parts`` builds the model's own HF decoder layer from config.json (one MoE layer,
random weights) instead: the attention part is input norm + self-attention + residual + post-attention norm +
router (+ shared experts), the expert part is ``mlp.experts(x, top_k_index, top_k_weights)`` on uniformly
routed tokens. Timing: warm-up runs, device synchronisation around each run, median of the repeats;
backward = median(forward + backward) - median(forward). Measure at several sequence lengths
(``--seq-len 2048,4096,8192,16384``): three or more let the attention fit tell per-call overhead from the s^2
core (``profile_fit.fit_part``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from disagmoe_ds.errors import ConfigError
from disagmoe_ds.models.attention_kernel import ATTENTION_KERNELS, attention_for
from disagmoe_ds.planner.inputs import check_at_least_one
from disagmoe_ds.planner.model import ModelSpec, load_model_spec
from disagmoe_ds.planner.profile_fit import FORMAT, fit_profile, load_profile, part_flops, predicted_times

PartsFactory = Callable[..., tuple[Callable[[], Any], Callable[[], Any]]]


def hf_decoder_parts(
    config: Any, *, layer_index: int, seq_len: int, micro_batch_size: int, device: str, dtype: Any
) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """The model's HF decoder layer ``layer_index`` split into its attention part and its expert part."""
    import torch

    module = importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")
    layer_cls = next(getattr(module, n) for n in dir(module) if n.endswith("DecoderLayer"))
    rope_cls = next(getattr(module, n) for n in dir(module) if n.endswith("RotaryEmbedding"))
    with torch.device(device):
        layer = layer_cls(config, layer_index).to(dtype)
        rope = rope_cls(config)
    with torch.no_grad():
        for p in layer.parameters():  # HF leaves fused expert tensors uninitialised; NaNs would skew routing
            p.normal_(0.0, 0.02)
    mlp, hidden = layer.mlp, config.hidden_size
    h_bsh = torch.randn(micro_batch_size, seq_len, hidden, device=device, dtype=dtype, requires_grad=True)
    positions = torch.arange(seq_len, device=device).unsqueeze(0).expand(micro_batch_size, -1)
    rotary = rope(h_bsh, positions)
    router = mlp.router if hasattr(mlp, "router") else mlp.gate
    shared = getattr(mlp, "shared_expert", None) or getattr(mlp, "shared_experts", None)

    def attention() -> tuple[Any, ...]:
        x_bsh = layer.input_layernorm(h_bsh)
        attn_bsh = layer.self_attn(hidden_states=x_bsh, position_embeddings=rotary, attention_mask=None)[0]
        resid_bsh = h_bsh + attn_bsh
        y_th = layer.post_attention_layernorm(resid_bsh).reshape(-1, hidden)
        _, weights_tk, _ = router(y_th)
        outs: tuple[Any, ...] = (resid_bsh, y_th, weights_tk)
        if shared is not None:
            outs += (shared(y_th),)
        return outs

    num_tokens, num_experts, top_k = micro_batch_size * seq_len, mlp.experts.num_experts, config.num_experts_per_tok
    x_th = torch.randn(num_tokens, hidden, device=device, dtype=dtype, requires_grad=True)
    index_tk = torch.rand(num_tokens, num_experts, device=device).topk(top_k, dim=-1).indices
    weights_tk = torch.softmax(torch.randn(num_tokens, top_k, device=device), dim=-1).to(dtype)

    def experts() -> tuple[Any, ...]:
        return (mlp.experts(x_th, index_tk, weights_tk),)

    return attention, experts


def _load_factory(spec: str) -> PartsFactory:
    module_name, _, attr = spec.partition(":")
    if not attr:
        raise ConfigError(f"--parts {spec!r}: expected module:function")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"--parts {spec!r}: cannot load it ({err})") from err


def _median_s(run: Callable[[], object], sync: Callable[[], object], warmup: int, repeats: int) -> float:
    times = []
    for i in range(warmup + repeats):
        sync()
        start = time.perf_counter()
        run()
        sync()  # the device finishes the queued kernels before the clock stops
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_part(fn: Callable[[], Any], *, device: str, warmup: int, repeats: int) -> tuple[float, float]:
    """(forward seconds, backward seconds) of one part; gradients w.r.t. random output cotangents."""
    import torch

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    cotangents = [torch.randn_like(t) for t in fn()]

    def forward() -> None:
        fn()

    def forward_backward() -> None:
        torch.autograd.backward(fn(), cotangents)

    fwd = _median_s(forward, sync, warmup, repeats)
    both = _median_s(forward_backward, sync, warmup, repeats)
    return fwd, max(both - fwd, 1e-12)


def _nvlink_bytes_per_s() -> float | None:
    """Device-to-device copy bandwidth between GPU 0 and GPU 1, if two GPUs exist."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return None
    src = torch.empty(256 << 20, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty_like(src, device="cuda:1")
    sync = torch.cuda.synchronize
    seconds = _median_s(lambda: dst.copy_(src), lambda: (sync(0), sync(1)), 2, 5)
    return src.numel() / seconds


def run_profile(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import transformers

    spec = load_model_spec(args.model)
    config = transformers.AutoConfig.from_pretrained(args.model)
    config._attn_implementation = attention_for(config, args.attn_implementation, args.device.split(":")[0])
    # what a full HF model picks by default on GPU (grouped GEMM); the per-expert loop elsewhere
    config._experts_implementation = args.experts_implementation or (
        "grouped_mm" if args.device.startswith("cuda") else "eager"
    )
    layer = spec.moe_layers.index(True)
    factory = _load_factory(args.parts)
    points = []
    for seq_len in args.seq_lens:
        attention, experts = factory(
            config,
            layer_index=layer,
            seq_len=seq_len,
            micro_batch_size=args.micro_batch_size,
            device=args.device,
            dtype=getattr(torch, args.dtype),
        )
        tokens = seq_len * args.micro_batch_size
        point: dict[str, Any] = {"seq_len": seq_len, "micro_batch_size": args.micro_batch_size, "tokens": tokens}
        flops = part_flops(spec, seq_len=seq_len, tokens=tokens)
        for name, fn in (("attention", attention), ("experts", experts)):
            fwd, bwd = measure_part(fn, device=args.device, warmup=args.warmup, repeats=args.repeats)
            point[name] = {"fwd_s": fwd, "bwd_s": bwd, "linear_flops": flops[name][0], "core_flops": flops[name][1]}
        points.append(point)
        del attention, experts  # free this sequence length's layer before building the next
    return {
        "format": FORMAT,
        "device": _device_name(args.device),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "model": spec.name,
        "model_type": spec.model_type,
        "dtype": args.dtype,
        "parts": args.parts,
        "attn_implementation": config._attn_implementation,
        "experts_implementation": config._experts_implementation,
        "layer_index": layer,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "points": points,
        "fit": fit_profile(points),
        "nvlink_bytes_per_s": _nvlink_bytes_per_s() if args.device.startswith("cuda") else None,
        "nic_bytes_per_s": None,
    }


def _device_name(device: str) -> str:
    import platform

    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"cpu ({platform.processor() or platform.machine()})"


def check_against(spec: ModelSpec, measured: dict[str, Any], reference: dict[str, Any]) -> list[str]:
    """Lines comparing this run's measured times with those predicted by another profile's fitted models."""
    lines = [
        f"predicted from the profile of {reference.get('model')} at seq "
        f"{[pt['seq_len'] for pt in reference['points']]} vs measured:"
    ]
    for point in measured["points"]:
        predicted = predicted_times(spec, reference, seq_len=point["seq_len"], tokens=point["tokens"])
        for part in ("attention", "experts"):
            for phase in ("fwd", "bwd"):
                p, m = predicted[f"{part}_{phase}_s"], point[part][f"{phase}_s"]
                lines.append(
                    f"  seq {point['seq_len']:>6} {part:<9} {phase}: predicted {p * 1e3:9.3f} ms, "
                    f"measured {m * 1e3:9.3f} ms, error {(p - m) / m:+.1%}"
                )
    return lines


def _fit_summary(result: dict[str, Any]) -> str:
    fit = result["fit"]
    parts = []
    for key in ("attention_fwd", "experts_fwd"):
        f = fit[key]
        parts.append(
            f"{key} {1 / f['per_flop'] / 1e12:.0f} TFLOP/s"
            + (f" (core {1 / f['per_core_flop'] / 1e12:.0f})" if key.startswith("attention") else "")
            + f" + {f['per_call'] * 1e6:.0f} us/call"
        )
    return "; ".join(parts)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="disagmoe-plan profile",
        description="Measure one MoE layer's attention part and expert part (forward and backward) on this machine "
        "and write a profile JSON for `disagmoe-plan --profile`.",
    )
    parser.add_argument("--model", required=True, help="HF model directory (or its config.json)")
    parser.add_argument(
        "--seq-len",
        required=True,
        help="sequence length(s) to measure at, comma separated (3 or more fit the full time model)",
    )
    parser.add_argument("--micro-batch-size", type=int, default=1, help="sequences per lane (default 1)")
    parser.add_argument("--out", required=True, help="where to write the profile JSON")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="parameter dtype")
    parser.add_argument("--warmup", type=int, default=3, help="untimed runs before measuring (default 3)")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs; the median is kept (default 10)")
    parser.add_argument(
        "--parts",
        default="disagmoe_ds.models.one_layer:disagmoe_parts",
        help="module:function building the two measured callables (see module docstring)",
    )
    parser.add_argument(
        "--attn-implementation",
        default="auto",
        choices=ATTENTION_KERNELS,
        help='HF attention implementation, as a job\'s "disagmoe.attention" (auto: what the job runs)',
    )
    parser.add_argument(
        "--experts-implementation",
        default=None,
        help="HF experts implementation (default grouped_mm on GPU as HF models pick, eager on CPU)",
    )
    parser.add_argument(
        "--predict-from",
        default=None,
        help="a profile JSON: also print the times its rates predict for this run, with the error",
    )
    return parser


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.seq_lens = [int(x) for x in args.seq_len.split(",")]
    except ValueError as err:
        raise ConfigError(f"--seq-len {args.seq_len!r}: expected integers separated by commas") from err
    check_at_least_one(
        {"--seq-len": min(args.seq_lens), "--micro-batch-size": args.micro_batch_size, "--repeats": args.repeats}
    )
    reference = load_profile(args.predict_from) if args.predict_from else None
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    result = run_profile(args)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out} ({result['device']}): {_fit_summary(result)}")
    if reference is not None:
        print("\n".join(check_against(load_model_spec(args.model), result, reference)))
    return 0
