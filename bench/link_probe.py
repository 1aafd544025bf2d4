"""The link between the GPUs as NCCL drives it now: ``all_to_all_single`` bandwidth per GPU, one way.

    torchrun --nproc_per_node 2 bench/link_probe.py [--mib 256] [--iters 10] [--json PATH]

Every rank sends ``--mib`` MiB in all to the others (equal splits) and receives as much; the figure is the bytes
a rank sends to other ranks over the median time of one call, so for two GPUs it is the one-way bandwidth of the
link between them. ``bench/gpu_multi.sh`` runs it under each link regime (NVLink, NCCL's shared-memory transport as
the cross-node-like regime, sockets) and writes it beside every table, so each figure says which link it had.
On CPUs (gloo) it runs the same way, for tests.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist


def probe(mib: int, iters: int) -> dict[str, Any]:
    """Median seconds of one ``all_to_all_single`` of ``mib`` MiB per rank, and the GB/s a rank sends to the others."""
    world, cuda = dist.get_world_size(), torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    numel = mib * 2**20 // world * world
    send = torch.ones(numel, dtype=torch.uint8, device=device)
    recv = torch.empty_like(send)
    times = []
    for i in range(iters + 2):  # two untimed: NCCL connects its channels on the first calls
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        dist.all_to_all_single(recv, send)
        if cuda:
            torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    to_others = numel * (world - 1) / world
    return {"world_size": world, "mib": mib, "seconds": seconds, "gb_per_s": to_others / seconds / 1e9}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=256, help="MiB each rank sends in all (default 256)")
    p.add_argument("--iters", type=int, default=10, help="timed calls (median; default 10)")
    p.add_argument("--json", metavar="PATH", help="also write the result as JSON (rank 0)")
    a = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        result = probe(a.mib, a.iters)
    finally:
        dist.destroy_process_group()
    if int(os.environ.get("RANK", 0)) == 0:
        nccl = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
        result["nccl_env"] = nccl
        regime = nccl or "NCCL defaults"
        print(f"link: {result['gb_per_s']:.1f} GB/s per GPU one way ({a.mib} MiB all_to_all_single, {regime})")
        if a.json:
            with open(a.json, "w") as f:
                json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
