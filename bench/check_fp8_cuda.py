"""torch's FP8 kernels against the exact CPU emulation, on the shapes and layouts the FP8 lever gives them.

On CUDA ``disagmoe_ds.fp8`` multiplies with ``torch._scaled_mm`` / ``torch._scaled_grouped_mm`` on operands quantized
by compiled kernels (a transposed weight's copy written row-major by the quantization, the step's kept copies of
``fp8.weight_cache``); on a CPU the same FP8 values are dequantized and multiplied in float32. Both must agree up to
the order of the sums and the bf16 output's rounding: this runs a linear and a grouped expert projection forward and
backward on both devices, from the same bf16 inputs, per call and inside ``cast_once_per_step``, and prints each
result's relative error (norm of the difference over the norm of the CPU result). Exit status 1 past ``--tol``.

Then the FP8 experts' fused middle (``triton_swiglu.swiglu_fp8_forward`` / ``_backward``, ``models.fp8_experts``),
compiled for the GPU (the CPU tests run it in Triton's interpreter, whose FP8 cast rounds otherwise): its e4m3 rows
and scales must be what ``fp8.quantize`` makes of the same rows bit for bit, on CUDA (its compiled kernels) and on the
CPU (eager), on random rows and on rows built to probe ties, scales on a power of two, e4m3 subnormals and signed
zeros; and the experts through it (``grouped_gated_experts`` with the compiled middle) must equal the unfused FP8
path on CUDA bit for bit, forward and every gradient, and the CPU emulation within ``--tol``. Last the experts'
weight-gradient operands (``fp8.group_columns``): the Triton kernel's bytes and scales must be torch's. Exit status 1
otherwise.

    python bench/check_fp8_cuda.py [--tol 0.01]
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import torch
import torch.nn.functional as F

from disagmoe_ds.fp8 import group_columns
from disagmoe_ds.fp8.projections import fp8_grouped_mm, fp8_linear
from disagmoe_ds.fp8.quantize import E4M3_MAX, Quantized, quantize, round_trip
from disagmoe_ds.fp8.weight_cache import cast_once_per_step
from disagmoe_ds.models import grouped_experts, triton_swiglu

# Expert rows per group: an empty expert and ragged groups; 8 groups of 64 rows on average (torch's small tile as
# they are), then 4 of 256 (each shown to torch as 3 groups, ``fp8.gemm.tile_split``).
COUNTS = {"8 experts": [0, 90, 3, 77, 128, 64, 100, 50], "4 experts, split": [300, 0, 500, 224]}


def results(device: str, cached: bool, counts: list[int]) -> dict[str, torch.Tensor]:
    """Outputs and gradients of one FP8 linear and one FP8 grouped projection on ``device``."""
    torch.manual_seed(0)
    rows = sum(counts)
    x = torch.randn(rows, 256, dtype=torch.bfloat16)
    w = torch.randn(384, 256, dtype=torch.bfloat16) / 16
    w_e = torch.randn(len(counts), 192, 384, dtype=torch.bfloat16) / 16  # [e, N, K]: HF's fused expert layout
    dy = torch.randn(rows, 192, dtype=torch.bfloat16)
    x = x.to(device).requires_grad_()
    w, w_e = (torch.nn.Parameter(t.to(device)) for t in (w, w_e))  # the weight cache keeps parameters only
    offsets = torch.tensor(counts).cumsum(0).to(device=device, dtype=torch.int32)
    with cast_once_per_step() if cached else contextlib.nullcontext():
        for _ in range(2):  # the second pass reads the kept copies
            h = round_trip(fp8_linear(x, w))  # the routed rows, as the lever sends them
            y = fp8_grouped_mm(h, w_e, offsets, fp8_rows=True)
            dx, dw, dw_e = torch.autograd.grad(y, [x, w, w_e], dy.to(device))
    return {"y": y, "dx": dx, "dw": dw, "dw_e": dw_e}


def probe_rows(inter: int) -> torch.Tensor:
    """[16, inter] float32 rows of edge cases for a quantization (each exact in bf16), the rest random."""
    torch.manual_seed(1)
    x = torch.randn(16, inter) * torch.logspace(-30, 30, 16)[:, None]
    x[0, :8] = torch.tensor([448.0, 1.0625, 17.0, 19.0, -0.0, 3 * 2**-10, 2**-10, -(2**-10)])  # ties, at scale 1
    x[1, 0] = E4M3_MAX * (1 + 2**-7)  # just past a power of two
    x[2, 0], x[3, 0] = E4M3_MAX * 2.0**-20, E4M3_MAX * 2.0**7  # on one
    x[4], x[5, :2] = 0.0, torch.tensor([2.0**-133, -(2.0**-130)])  # all zero; bf16 denormals only
    return x.bfloat16().float()


def same_bits(got: Quantized, want: Quantized) -> bool:
    """The same e4m3 bytes (-0.0 is not 0.0) and scales, NaN where the other has NaN (its bits are the platform's)."""
    nan = got.data.cpu().float().isnan()
    if not torch.equal(nan, want.data.cpu().float().isnan()):
        return False
    data = (got.data.cpu().view(torch.uint8)[~nan], want.data.cpu().view(torch.uint8)[~nan])
    return torch.equal(*data) and torch.equal(got.scale.cpu(), want.scale.cpu())


def middle_bits(device: str = "cuda", sizes: tuple[tuple[int, int], ...] = ((3000, 768), (257, 2048))) -> list[str]:
    """Where the fused middle's FP8 rows differ from ``quantize``'s of its own rows (on ``device``, compiled there,
    and on the CPU, eager); ``sizes``: (pairs, I), by default both tile shapes of ``triton_swiglu._tiles``."""
    failed = []
    for pairs, inter in sizes:
        torch.manual_seed(0)
        gate_up = torch.randn(pairs, 2 * inter) * torch.logspace(-3, 3, pairs)[:, None]
        probes = probe_rows(inter)  # silu(64) * (x / 64) = x: the hidden rows are the probes, exactly
        gate_up[:16, :inter], gate_up[:16, inter:] = 64.0, probes / 64
        gate_up = gate_up.bfloat16().to(device)
        d_hidden = torch.randn(pairs, inter).bfloat16().to(device)
        d_hidden[:16] = probes.bfloat16().to(device)  # with gate 64 and up 1: d_gate_up = [x, 64 x]
        gate_up[16:32, :inter], gate_up[16:32, inter:] = 64.0, 1.0
        d_hidden[16:32] = probes.bfloat16().to(device)
        ones = torch.ones(pairs, dtype=torch.bfloat16, device=device)
        hidden, hidden_q = triton_swiglu.swiglu_fp8_forward(gate_up)
        d_gate_up, d_q = triton_swiglu.swiglu_fp8_backward(gate_up, d_hidden)
        assert d_q is not None
        checks = {
            "hidden rows": torch.equal(hidden, triton_swiglu.swiglu_forward(gate_up, ones)),
            "d_gate_up rows": torch.equal(d_gate_up, triton_swiglu.swiglu_backward(gate_up, ones, d_hidden)[0]),
            f"hidden e4m3 ({device})": same_bits(hidden_q, quantize(hidden, -1)),
            "hidden e4m3 (cpu)": same_bits(hidden_q, quantize(hidden.cpu(), -1)),
            f"d_gate_up e4m3 ({device})": same_bits(d_q, quantize(d_gate_up, -1)),
            "d_gate_up e4m3 (cpu)": same_bits(d_q, quantize(d_gate_up.cpu(), -1)),
        }
        for name, ok in checks.items():
            print(f"{pairs:>6} x {inter:<5} {name:>24}: {'identical' if ok else 'DIFFERENT'}")
            failed += [] if ok else [f"{pairs}x{inter} {name}"]
    return failed


def _gated_fp32(gate_up_PF: torch.Tensor, w_P: torch.Tensor, act_fn: torch.nn.Module) -> torch.Tensor:
    """The Triton middle's math on the CPU: fp32 from the bf16 inputs, one rounding (eager's rounds in bf16)."""
    gate, up = gate_up_PF.float().chunk(2, dim=-1)
    return (act_fn(gate) * up * w_P.float().unsqueeze(1)).to(gate_up_PF.dtype)


def experts(device: str, fused: bool = True, rows: int = 2048, inter: int = 768) -> dict[str, torch.Tensor]:
    """Output and gradients of the FP8 experts (the compiled middle where the Triton kernels run, else the CPU
    emulation's; ``fused``: through ``fp8_experts`` where the kernels run)."""
    torch.manual_seed(0)
    hidden, num_experts = 512, 8
    x = round_trip(torch.randn(rows, hidden).bfloat16()).to(device).requires_grad_()  # the routed rows, FP8 values
    idx = torch.randint(0, num_experts + 1, (rows, 2)).to(device)  # id 8: another rank's expert
    w = torch.rand(rows, 2).bfloat16().to(device).requires_grad_()
    gate_up = torch.nn.Parameter((torch.randn(num_experts, 2 * inter, hidden) / 16).bfloat16().to(device))
    down = torch.nn.Parameter((torch.randn(num_experts, hidden, inter) / 16).bfloat16().to(device))
    emulated = grouped_experts.Elementwise(_gated_fp32, grouped_experts._sum_slots_eager)
    middle = grouped_experts.compiled_elementwise() if triton_swiglu.runs_on(x) else emulated
    fuses, grouped_experts.fused_fp8_middle = (
        grouped_experts.fused_fp8_middle,
        (grouped_experts.fused_fp8_middle if fused else lambda *args: False),
    )
    try:
        y = grouped_experts.grouped_gated_experts(x, idx, w, gate_up, down, F.silu, elementwise=middle, fp8=True)
        dy = torch.randn(y.shape).bfloat16().to(device)
        dx, dw, d_gate_up, d_down = torch.autograd.grad(y, [x, w, gate_up, down], dy)
    finally:
        grouped_experts.fused_fp8_middle = fuses
    return {"y": y, "dx": dx, "dw": dw, "d_gate_up": d_gate_up, "d_down": d_down}


def experts_match(tol: float) -> list[str]:
    """Where the fused experts differ from the unfused path (CUDA, bit for bit) or the CPU emulation (past ``tol``)."""
    failed = []
    fused, unfused, again, cpu = experts("cuda"), experts("cuda", False), experts("cuda", False), experts("cpu")
    for name, got in fused.items():
        deterministic = torch.equal(unfused[name], again[name])
        identical = torch.equal(got, unfused[name])
        want = cpu[name].float()
        error = ((got.float().cpu() - want).norm() / want.norm()).item()
        print(f"experts {name:>9}: {'identical' if identical else 'DIFFERENT'} to the unfused path"
              f"{'' if deterministic else ' (which is not deterministic)'}, {error:.2e} from the CPU")  # fmt: skip
        failed += [] if identical or not deterministic else [f"experts {name} (bits)"]
        failed += [] if error <= tol else [f"experts {name} ({error:.2e} from the CPU)"]
    return failed


def group_column_bits() -> list[str]:
    """The experts' weight-gradient operands (``fp8.group_columns``): the Triton kernel's bytes and scales against
    torch's on the same CUDA rows (the kernel's padding, an empty expert, rows after the last one)."""
    torch.manual_seed(2)
    failed = []
    for counts in COUNTS.values():
        x = torch.cat([probe_rows(384).cuda(), torch.randn(sum(counts) - 11, 384, device="cuda")]).bfloat16()
        offsets = torch.tensor(counts).cumsum(0).to(device="cuda", dtype=torch.int32)
        got = group_columns.quantize_group_columns(x, offsets)
        runs_on, group_columns.runs_on = group_columns.runs_on, lambda t: False
        try:
            want = group_columns.quantize_group_columns(x, offsets)
        finally:
            group_columns.runs_on = runs_on
        end = int(want.offsets[-1])
        same = torch.equal(got.data[:, :end].view(torch.uint8), want.data[:, :end].view(torch.uint8))
        if not (same and torch.equal(got.scale, want.scale) and torch.equal(got.offsets, want.offsets)):
            failed.append(f"group columns {counts}")
    return failed


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tol", type=float, default=0.01, help="largest relative error accepted (default 0.01)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to compare", file=sys.stderr)
        return 2
    worst = 0.0
    print(f"{'groups':>16} {'weights':>10} {'tensor':>6} {'rel. error':>10}")
    for groups, counts in COUNTS.items():
        for cached in (False, True):
            cpu, cuda = results("cpu", cached, counts), results("cuda", cached, counts)
            for name, want in cpu.items():
                got = cuda[name].float().cpu()
                error = ((got - want.float()).norm() / want.float().norm()).item()
                worst = max(worst, error)
                print(f"{groups:>16} {'kept' if cached else 'per call':>10} {name:>6} {error:10.2e}")
    print(f"worst {worst:.2e} (tolerance {args.tol:g}): {'ok' if worst <= args.tol else 'FAILED'}")
    failed = middle_bits() + experts_match(args.tol) + group_column_bits()
    print(f"fused FP8 middle: {'ok' if not failed else 'FAILED: ' + ', '.join(failed)}")
    return 0 if worst <= args.tol and not failed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
