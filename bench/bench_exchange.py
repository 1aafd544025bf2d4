"""M2N / N2M achieved bandwidth of the DisagMoE exchange versus ``all_to_all_single`` of the same bytes.

    # 8 GPUs of one host: 4 attention + 4 FFN ranks, Qwen3-30B-A3B routing (H 2048, top-8 of 128), 8K tokens/lane
    PYTHONPATH=$PWD python bench/bench_exchange.py --attention-gpus 4 --ffn-gpus 4 --json exchange.json
    # the same under a launcher
    torchrun --nproc_per_node 8 bench/bench_exchange.py --attention-gpus 4 --ffn-gpus 4
    # CPU, gloo, tiny sizes (what the tests run)
    PYTHONPATH=$PWD python bench/bench_exchange.py --device cpu --attention-gpus 2 --ffn-gpus 2 --tokens 64 --hidden 32

Every attention lane routes ``--tokens`` random tokens with a random router (uniform top-k of ``--experts``),
packs them exactly as the runtime does (``routing.plan_dispatch`` + ``pack``) and then, per direction:

    exchange    the runtime's own ends (``comm.exchange``), on its transport (``--transport``):
                m2n: ``FanOut.send`` on the lanes (a host-to-host header per message, then one grouped operation),
                ``FanIn`` on the FFN ranks (read the headers, post, complete) of x, local ids and weights; with one
                ep rank per F-group the sizes are known at both ends and m2n goes without headers, as in the runtime;
                n2m: ``FanOut.send`` of the received rows back, ``FanIn`` on the lanes with sizes they know
    all-to-all  one ``all_to_all_single`` over all M + N ranks of a byte buffer whose splits are exactly the payload
                bytes of every (src, dst) message of that direction (zero between ranks that do not talk)

Each direction is timed for one micro-batch and for ``--in-flight`` back to back (headers of later ones ride
ahead of earlier payloads, as in the runtime; the all-to-all runs as many times).

Time = the slowest rank's time from a common barrier until its side is complete (device synchronised), median
over ``--iters``. Bytes = payload bytes of all messages of the direction (m2n also sends a small host-to-host
header per message, not counted); GB/s = bytes / time (aggregate over all links); ratio = exchange GB/s over
all-to-all GB/s. ``--json`` writes the rows and the setup.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from disagmoe_ds.comm import (
    CommStream,
    Kind,
    build_exchange_comms,
    exchange_specs,
    make_transport,
    pack,
    plan_dispatch,
)
from disagmoe_ds.comm.exchange import static_sizes
from disagmoe_ds.comm.messages import Dims, Tokens
from disagmoe_ds.comm.routing import Capacity
from disagmoe_ds.layout import Layout

WEIGHT_DTYPE = torch.float32  # router weights travel in fp32 (Mixtral/DeepSeek keep them fp32 in bf16 models)


@dataclass(frozen=True)
class BenchArgs:
    attention_gpus: int
    ffn_gpus: int
    tokens: int  # T per lane per micro-batch
    hidden: int
    top_k: int
    experts: int
    dtype: torch.dtype
    warmup: int
    iters: int
    seed: int
    transport: str = "auto"
    in_flight: int = 4
    fp8: bool = False  # m2n rows in e4m3 with a scale each, as the FP8 lever sends them


def random_messages(args: BenchArgs, layout: Layout, lane: int, device: torch.device):
    """One lane's M2N messages for a micro-batch routed by a random router, and its dispatch plan."""
    gen = torch.Generator().manual_seed(args.seed * 1009 + lane)
    topk_idx_TK = torch.rand(args.tokens, args.experts, generator=gen).topk(args.top_k).indices.to(device)
    w_TK = torch.rand(args.tokens, args.top_k, generator=gen).softmax(-1).to(device, WEIGHT_DTYPE)
    x_TH = torch.randn(args.tokens, args.hidden, generator=gen).to(device, args.dtype)
    plan = plan_dispatch(topk_idx_TK, layout.ep_size, layout.experts_per_rank)
    pieces = pack(x_TH, w_TK, plan)
    per_rank = zip(pieces, plan.local_idx_RK, strict=True)
    messages = [Tokens.of(x_RH, idx_RK, w_RK, None, fp8=args.fp8).tensors() for (x_RH, w_RK), idx_RK in per_rank]
    return messages, plan


def message_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class ExchangeSide:
    """This rank's end of both directions, and the byte matrix of every message (for the all-to-all baseline)."""

    def __init__(self, args: BenchArgs, device: torch.device):
        rank, world = dist.get_rank(), dist.get_world_size()
        self.layout = Layout(
            attention_gpus=args.attention_gpus, ffn_gpus=args.ffn_gpus, num_layers=1, num_experts=args.experts
        )
        self.role = self.layout.role_of(rank)
        self.device = device
        transport = make_transport(args.transport)
        one_ep_rank = self.layout.ep_size == 1  # fixed sizes: no headers (as ``afpipe.mailbox`` runs it)
        comms = build_exchange_comms(self.layout, transport, device=device, headerless=one_ep_rank)
        exact = Capacity.initial(tokens=args.tokens, top_k=args.top_k, ep_size=1, experts_per_rank=1, factor=1.0)
        self.capacity = exact if one_ep_rank else None
        dims = Dims(args.hidden, args.top_k, args.experts, self.layout.ep_size, args.dtype, WEIGHT_DTYPE, fp8=args.fp8)
        self.dtype = args.dtype
        specs = exchange_specs(dims)
        stream = CommStream(device)  # receives on a side stream, as the runtime does on GPUs
        self.tag = 0
        m2n_send = torch.zeros(world, dtype=torch.int64)  # payload bytes this rank sends to each rank
        if self.role.is_attention:
            self.messages, self.plan = random_messages(args, self.layout, self.role.index, device)
            self.m2n = comms.fan_out(Kind.M2N, specs[Kind.M2N])
            self.n2m = comms.fan_in(Kind.N2M, specs[Kind.N2M], device, stream)
            for peer, message in zip(self.m2n.peers, self.messages, strict=True):
                m2n_send[peer] = message_bytes(message)
        else:
            self.m2n = comms.fan_in(Kind.M2N, specs[Kind.M2N], device, stream)
            self.n2m = comms.fan_out(Kind.N2M, specs[Kind.N2M])
        self.m2n_bytes = _all_gather_rows(m2n_send)  # [src, dst]
        self.received = self.run_m2n()  # the rows an FFN rank sends back in n2m (its "expert outputs")
        n2m_send = torch.zeros(world, dtype=torch.int64)
        if not self.role.is_attention:
            x_SH, counts = self.received
            for peer, count in zip(self.n2m.peers, counts, strict=True):
                n2m_send[peer] = count * x_SH.shape[1] * x_SH.element_size()
        self.n2m_bytes = _all_gather_rows(n2m_send)
        self.run_n2m()

    def run_m2n(self, in_flight: int = 1):
        """``in_flight`` micro-batches' m2n back to back (the runtime keeps several in flight)."""
        tags = range(self.tag + 1, self.tag + 1 + in_flight)
        self.tag += in_flight
        if self.role.is_attention:
            for tag in tags:
                self.m2n.send(self.messages, tag=tag, metas=[(p,) for p in self.plan.pairs])
            self.m2n.wait_all()
            return None
        arrivals = [self.m2n.expect(tag) for tag in tags]
        for arrival in arrivals:
            if self.capacity is None:
                self.m2n.read_headers(arrival)
            else:  # one ep rank: no header, every lane sends its whole micro-batch (as ``afpipe.mailbox`` does)
                peers = len(self.m2n.peers)
                arrival.sizes, arrival.metas = static_sizes(
                    Kind.M2N, self.capacity, peers=peers, ep_size=1, moe_layer=True
                )
            self.m2n.post(arrival)
        whole = [self.m2n.complete(arrival)[0] for arrival in arrivals][-1]
        return Tokens.from_wire(whole).rows(self.dtype), tuple(size[0] for size in arrivals[-1].sizes)

    def run_n2m(self, in_flight: int = 1) -> None:
        tags = range(self.tag + 1, self.tag + 1 + in_flight)
        self.tag += in_flight
        if self.role.is_attention:
            arrivals = [self.n2m.expect(tag) for tag in tags]
            for arrival in arrivals:
                arrival.sizes = [(rows,) for rows in self.plan.counts]  # the lane knows what it sent
                self.n2m.post(arrival)
            for arrival in arrivals:
                self.n2m.complete(arrival)
        else:
            x_SH, counts = self.received
            for tag in tags:
                self.n2m.send([(x,) for x in x_SH.split(counts)], tag=tag)
            self.n2m.wait_all()


def _all_gather_rows(row: torch.Tensor) -> torch.Tensor:
    """[world, world] from every rank's row (gathered on the CPU through a gloo-or-device tensor)."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else row.device
    rows = [torch.empty_like(row, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, row.to(device))
    return torch.stack(rows).cpu()


class AllToAllBytes:
    """``all_to_all_single`` of a byte buffer with the same (src, dst) payload sizes as one exchange direction."""

    def __init__(self, bytes_SD: torch.Tensor, device: torch.device):
        rank = dist.get_rank()
        self.send_splits = bytes_SD[rank].tolist()
        self.recv_splits = bytes_SD[:, rank].tolist()
        self.send = torch.randint(0, 255, (sum(self.send_splits),), dtype=torch.uint8).to(device)
        self.recv = torch.empty(sum(self.recv_splits), dtype=torch.uint8, device=device)

    def run(self, in_flight: int = 1) -> None:
        for _ in range(in_flight):
            dist.all_to_all_single(self.recv, self.send, self.recv_splits, self.send_splits)


def time_op(op: Callable[[], Any], *, warmup: int, iters: int, device: torch.device) -> float:
    """Median over iterations of the slowest rank's seconds from a common barrier to its completion."""
    for _ in range(warmup):
        op()
    times = []
    for _ in range(iters):
        _sync(device)
        dist.barrier()
        t0 = time.perf_counter()
        op()
        _sync(device)
        seconds = time.perf_counter() - t0
        times.append(_max_over_ranks(seconds, device))
    return statistics.median(times)


def _max_over_ranks(seconds: float, device: torch.device) -> float:
    value = torch.tensor([seconds], dtype=torch.float64, device=_collective_device(device))
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()


def _collective_device(device: torch.device) -> torch.device:
    return device if dist.get_backend() == "nccl" else torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_rank(rank: int, args: BenchArgs, device_type: str) -> list[dict[str, Any]] | None:
    """One rank of the benchmark; the rows on rank 0, None elsewhere."""
    del rank
    device = _rank_device(device_type)
    side = ExchangeSide(args, device)
    rows = []
    for direction, exchange_op, bytes_SD in (
        ("m2n", side.run_m2n, side.m2n_bytes),
        ("n2m", side.run_n2m, side.n2m_bytes),
    ):
        baseline = AllToAllBytes(bytes_SD, device)
        total = int(bytes_SD.sum())
        for in_flight in sorted({1, args.in_flight}):
            times = {
                "exchange": time_op(
                    functools.partial(exchange_op, in_flight), warmup=args.warmup, iters=args.iters, device=device
                ),
                "all_to_all": time_op(
                    functools.partial(baseline.run, in_flight), warmup=args.warmup, iters=args.iters, device=device
                ),
            }
            for method, seconds in times.items():
                rows.append(_row(direction, method, in_flight, total * in_flight, seconds, times["all_to_all"]))
    return rows if dist.get_rank() == 0 else None


def _row(direction: str, method: str, in_flight: int, total: int, seconds: float, baseline_s: float) -> dict[str, Any]:
    return {
        "direction": direction,
        "method": method,
        "in_flight": in_flight,
        "bytes": total,
        "ms": seconds * 1e3,
        "gbps": total / seconds / 1e9,
        "ratio": baseline_s / seconds,  # GB/s over the all-to-all's GB/s (same bytes)
    }


def _rank_device(device_type: str) -> torch.device:
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'direction':<10}{'method':<12}{'in flight':>10}{'bytes':>14}{'ms':>10}{'GB/s':>10}{'ratio':>8}")
    for r in rows:
        print(
            f"{r['direction']:<10}{r['method']:<12}{r['in_flight']:>10}{r['bytes']:>14,}{r['ms']:>10.3f}{r['gbps']:>10.2f}"
            f"{r['ratio']:>7.2f}x"
        )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # probe GPUs without initialising CUDA (fork)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--attention-gpus", type=int, default=1, help="M: attention lanes (senders of m2n)")
    p.add_argument("--ffn-gpus", type=int, default=1, help="N: FFN ranks (one expert-parallel group)")
    p.add_argument("--tokens", type=int, default=8192, help="tokens per lane (micro-batch x sequence)")
    p.add_argument("--hidden", type=int, default=2048, help="H (Qwen3-30B-A3B: 2048)")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="activations (default bf16 on GPU)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--transport", choices=("auto", "rendezvous"), default="auto", help="exchange transport")
    p.add_argument(
        "--in-flight",
        type=int,
        default=4,
        help="also time this many micro-batches' exchanges back to back, as the "
        "runtime keeps several in flight (the all-to-all runs as many times)",
    )
    p.add_argument("--fp8", action="store_true", help='m2n rows in FP8 with a scale each, as "disagmoe.fp8" sends them')
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before a local job is killed")
    p.add_argument("--json", metavar="PATH", help="also write the rows and the setup as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from disagmoe_ds.launch import detect_launcher, init_from_env, spawn_local

    a = parse_args(argv)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype or ("bf16" if a.device == "cuda" else "fp32")]
    args = BenchArgs(
        a.attention_gpus,
        a.ffn_gpus,
        a.tokens,
        a.hidden,
        a.top_k,
        a.experts,
        dtype,
        a.warmup,
        a.iters,
        a.seed,
        a.transport,
        a.in_flight,
        a.fp8,
    )
    world = a.attention_gpus + a.ffn_gpus
    backend = "nccl" if a.device == "cuda" else "gloo"
    if detect_launcher():
        init_from_env(backend)
        rows = bench_rank(dist.get_rank(), args, a.device)
        if dist.get_rank() != 0:
            return 0
    else:
        rows = spawn_local(bench_rank, world, args=(args, a.device), backend=backend, timeout_s=a.timeout)[0]
    print_table(rows)
    if a.json:
        setup = {**vars(args), "dtype": str(dtype).removeprefix("torch.")}
        report = {"setup": {**setup, "device": a.device, "backend": backend, "world_size": world}, "rows": rows}
        Path(a.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
