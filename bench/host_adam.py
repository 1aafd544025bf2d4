"""The host side of an optimizer step in host memory (ZeRO-Offload's CPU Adam) against the host's memory bandwidth.

The planner prices a rank's offloaded step as ``HOST_STEP_BYTES`` (36) per parameter over its share of the node's
host memory bandwidth at ``Efficiency.host`` (0.5, an assumption): ``planner/optimizer_step.host_optimizer_step_s``.
This measures both numbers on the machine it runs on: DeepSpeed's ``DeepSpeedCPUAdam`` stepping a flat fp32 shard
with its bf16 copy written back (what ZeRO-Offload runs per rank), and a streaming copy (the bandwidth the state
could move at), each at the given thread counts. The ratio of the step's bytes/s to the copy's is the measured
``Efficiency.host``.

    python bench/host_adam.py --params 1e9 --threads 16 8 2
"""

from __future__ import annotations

import argparse
import time

import torch

from disagmoe_ds.planner.optimizer_step import HOST_STEP_BYTES


def best_seconds(fn, repeats: int) -> float:
    fn()  # warm up (page faults, the op's first call)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def copy_bandwidth(numel: int, repeats: int) -> float:
    """Bytes/s of ``dst.copy_(src)`` over two fp32 buffers of ``numel`` elements (read one, write the other)."""
    src, dst = torch.ones(numel), torch.empty(numel)
    return 2 * 4 * numel / best_seconds(lambda: dst.copy_(src), repeats)


def adam_step_seconds(numel: int, repeats: int) -> float:
    """One ``DeepSpeedCPUAdam`` step over ``numel`` fp32 parameters with their bf16 copy written (ZeRO-Offload)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    param = torch.nn.Parameter(torch.randn(numel))
    param.grad = torch.randn(numel) * 1e-3
    bf16_copy = torch.empty(numel, dtype=torch.bfloat16)
    opt = DeepSpeedCPUAdam([param], lr=1e-4, weight_decay=0.1, adamw_mode=True)

    def step() -> None:
        opt.step()
        bf16_copy.copy_(param.data)

    return best_seconds(step, repeats)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=float, default=1e9, help="parameters of the shard (default 1e9: 16 GB of state)")
    p.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads()], help="torch/OpenMP threads")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    numel = int(args.params)
    print(f"host Adam step, {numel / 1e9:.2f}B fp32 parameters, {HOST_STEP_BYTES} B per parameter priced")
    print("| threads | step s | params/s | step GB/s (priced bytes) | copy GB/s | step / copy (Efficiency.host) |")
    print("|---|---|---|---|---|---|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        step_s = adam_step_seconds(numel, args.repeats)
        copy = copy_bandwidth(numel, args.repeats)
        step_bw = numel * HOST_STEP_BYTES / step_s
        print(
            f"| {threads} | {step_s:.3f} | {numel / step_s / 1e9:.2f}B | {step_bw / 1e9:.1f} | {copy / 1e9:.1f} | "
            f"{step_bw / copy:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
