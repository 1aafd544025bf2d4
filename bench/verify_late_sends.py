"""``disagmoe-verify`` with the dispatch sizes landing late: the mailbox's late-send path on real transports.

With several ep ranks the m2n (and, at depth > 1, resid) sizes come from the device, and the mailbox holds those
sends until the sizes land, keeping later sends behind them. On 2 GPUs (one ep rank) the sizes are known at once,
so this patches ``PendingDispatch.ready`` in every rank (``comm.routing.sizes_landing_late``) to make the sizes land
on the second poll, or never (then only the calls that block the host send them), as the CI test does on CPU:

    NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_SOCKET_IFNAME=lo torchrun --nproc_per_node 2 \\
        bench/verify_late_sends.py never --attention-gpus 1 --ffn-gpus 1 --micro-batches 3 --json

The first argument is the landing (``second-poll`` or ``never``); the rest are ``disagmoe-verify``'s.
"""

from __future__ import annotations

import sys

from disagmoe_ds.afpipe import verify
from disagmoe_ds.comm.routing import PendingDispatch, sizes_landing_late

if __name__ == "__main__":
    PendingDispatch.ready = sizes_landing_late(sys.argv[1])
    sys.exit(verify.main(sys.argv[2:]))
