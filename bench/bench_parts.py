"""Is a part host-bound? Host time per call against GPU time per call, for each part a rank runs.

    PYTHONPATH=$PWD python bench/bench_parts.py --model hf_models/Qwen3-30B-A3B --seq-len 4096 --batch 1

For one decoder layer at real size (bf16 on CUDA; weights random, only the config is read) it times forward +
backward of the attention part, the head (final norm, LM head, loss) and the expert shard (every expert on one
rank, as with one ep rank) in each of ``--modes``:

    eager     the part as it is
    compiled  under ``compile_stage``, as a ``"compile": true`` job runs it
    graphed   compiled and replayed as CUDA graphs (``models.graphs``), as a ``"cuda_graphs": true`` job runs it

``gpu_ms``: calls back to back, the device synchronised only at the ends (what the GPU needs per call when the host
keeps up). ``host_ms``: the median time the host spends issuing one call while the GPU is kept busy ahead of it by
large matrix products, so launches never wait for the device (what the host needs per call). A part whose
``host/gpu`` exceeds 1 leaves its GPU idle however the schedule orders it; the device-driven runtime's target is
at most 0.5. On CPU (fp32, tests) the two times are both host time and only the table's shape means anything.
``--json`` writes the rows.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig

from disagmoe_ds.models.graphs import graph_stages
from disagmoe_ds.models.model_facts import num_experts_of
from disagmoe_ds.models.one_layer import one_layer_model
from disagmoe_ds.models.parts import AttentionStage, ExpertStage, compile_stage

MODES = ("eager", "compiled", "graphed")
PARTS = ("attention", "head", "experts")


def build_calls(
    model_dir: str, seq_len: int, batch: int, mode: str, device: str, capacity_factor: float | None = None
) -> dict:
    """``{part: call}``: each call runs the part's forward and backward once on fixed inputs; ``capacity_factor``:
    the expert shard gets its rows as a message padded to that capacity (sentinel rows after the routed ones,
    a pair bound), as with several ep ranks and ``"capacity_factor"``."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = one_layer_model(AutoConfig.from_pretrained(model_dir), device=device, dtype=dtype)
    config = model.config
    attention = AttentionStage(model, (0,), with_embedding=False, with_head=True)
    experts = ExpertStage(model, (0,), 0, num_experts_of(config))
    if mode != "eager":
        torch._dynamo.reset()
        compile_stage(attention)
        compile_stage(experts)
    h_BSH = torch.randn(batch, seq_len, config.hidden_size, device=device, dtype=dtype, requires_grad=True)
    labels_BS = torch.randint(0, config.vocab_size, (batch, seq_len), device=device)
    ctx = attention.context(h_BSH, None)
    with torch.no_grad():
        routed = attention.part(0)(h_BSH, ctx, config)
    x_RH = routed.x_TH.detach().requires_grad_()
    w_RK = routed.topk_w_TK.detach().requires_grad_()
    idx_RK, pairs, bounded = routed.topk_idx_TK.long(), routed.topk_idx_TK.numel(), False
    if capacity_factor:
        x_RH, idx_RK, w_RK, pairs = _padded(x_RH, idx_RK, w_RK, experts.num_local, capacity_factor)
        bounded = True
    part, head, shard = attention.part(0), attention.head, experts.shard(0)
    if mode == "graphed":
        graphs = graph_stages(lambda layer: 1, attention=attention, experts=experts)
        graphs.capture_attention(attention, batch=batch, seq_len=seq_len, positions=[None])
        graphs.capture_shards(
            experts, rows=x_RH.shape[0], top_k=idx_RK.shape[1], weight_dtype=w_RK.dtype,
            pair_bound=pairs if bounded else None,
        )  # fmt: skip
        part, head, shard = graphs.part(attention, 0), graphs.head_of(attention), graphs.shard(experts, 0)

    params = [*attention.parameters(), *experts.parameters()]

    def fresh_grads():  # as DeepSpeed's ZeRO-1/2 hooks leave them after each backward: taken, none left
        for t in (*params, h_BSH, x_RH, w_RK):
            t.grad = None

    def attention_call():
        fresh_grads()
        out = part(h_BSH, ctx, config)
        torch.autograd.backward([out.residual_BSH, out.x_TH], [out.residual_BSH, out.x_TH])

    def head_call():
        fresh_grads()
        head(h_BSH, labels_BS)[1].backward()

    def experts_call():
        fresh_grads()
        y_RH = shard(x_RH, idx_RK, w_RK, pairs, bounded)
        y_RH.backward(y_RH)

    return {"attention": attention_call, "head": head_call, "experts": experts_call}


def _padded(x_RH, idx_RK, w_RK, sentinel: int, factor: float):
    """The rows as a message at ``factor`` times their size: padding rows of sentinel ids and zero weights."""
    rows = math.ceil(x_RH.shape[0] * factor)
    pad = rows - x_RH.shape[0]
    x_RH = torch.cat([x_RH.detach(), x_RH.detach()[:1].expand(pad, -1)]).requires_grad_()
    idx_RK = torch.cat([idx_RK, idx_RK.new_full((pad, idx_RK.shape[1]), sentinel)])
    w_RK = torch.cat([w_RK.detach(), w_RK.new_zeros(pad, w_RK.shape[1])]).requires_grad_()
    return x_RH, idx_RK, w_RK, rows * idx_RK.shape[1]


def gpu_ms(call, *, iters: int, device: str) -> float:
    """Milliseconds per call, back to back (the device synchronised at the ends only)."""
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        call()
    _sync(device)
    return (time.perf_counter() - start) / iters * 1e3


def host_profile(call, *, device: str, top: int = 15) -> None:
    """The host-side ops of one call by self CPU time, the GPU busy ahead as in ``host_ms`` (what to cut when a
    part is host-bound)."""
    from torch.profiler import ProfilerActivity, profile

    _busy_ahead(device)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        call()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top), flush=True)


def host_ms(call, *, iters: int, device: str) -> float:
    """Median milliseconds the host spends issuing one call, with the GPU kept busy ahead of it."""
    times = []
    for _ in range(iters):
        _busy_ahead(device)
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e3)
        _sync(device)
    return statistics.median(times)


def _busy_ahead(device: str) -> None:
    """About 10 ms of queued GPU work: the launches that follow never wait for the device."""
    if device == "cuda":
        busy = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        for _ in range(8):
            busy @ busy


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def bench(
    model_dir: str,
    seq_len: int,
    batch: int,
    *,
    modes,
    device: str,
    warmup: int,
    iters: int,
    profile: bool = False,
    capacity_factor: float | None = None,
) -> list[dict]:
    rows = []
    for mode in modes:
        calls = build_calls(model_dir, seq_len, batch, mode, device, capacity_factor)
        for part, call in calls.items():
            for _ in range(warmup):
                call()
            gpu, host = gpu_ms(call, iters=iters, device=device), host_ms(call, iters=iters, device=device)
            row = {"model": Path(model_dir).name, "seq_len": seq_len, "batch": batch, "part": part, "mode": mode}
            row["capacity_factor"] = capacity_factor
            rows.append({**row, "gpu_ms": gpu, "host_ms": host, "host_over_gpu": host / gpu})
            print(f"{row['model']} {part} {mode}: gpu {gpu:.3f} ms, host {host:.3f} ms", flush=True)
            if profile:
                host_profile(call, device=device)
        del calls
        torch._dynamo.reset()
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'model':<24}{'part':>10}{'mode':>10}{'gpu ms':>10}{'host ms':>10}{'host/gpu':>10}")
    for r in rows:
        print(
            f"{r['model']:<24}{r['part']:>10}{r['mode']:>10}{r['gpu_ms']:>10.3f}{r['host_ms']:>10.3f}"
            f"{r['host_over_gpu']:>10.2f}"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", nargs="+", default=["hf_models/Qwen3-30B-A3B"], help="model config directories")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1, help="sequences per micro-batch")
    p.add_argument("--modes", nargs="+", choices=MODES, default=None, help="default: all on CUDA, eager on CPU")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls first (compilation happens in them)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument(
        "--capacity-factor", type=float, default=None,
        help="the expert shard's rows as a message padded to this capacity (as with several ep ranks)",
    )  # fmt: skip
    p.add_argument("--profile", action="store_true", help="print each call's host-side ops by self CPU time")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    a = p.parse_args(argv)
    modes = a.modes or (list(MODES) if a.device == "cuda" else ["eager"])
    rows = []
    for model_dir in a.model:
        rows += bench(
            model_dir,
            a.seq_len,
            a.batch,
            modes=modes,
            device=a.device,
            warmup=a.warmup,
            iters=a.iters,
            profile=a.profile,
            capacity_factor=a.capacity_factor,
        )
    print_table(rows)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
