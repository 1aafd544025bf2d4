"""The node-deduplicated exchange (``node_dedup``): a lane sends a token once per node of an expert-parallel group,
the node's ranks share it by an all-to-all; the job still equals the single-process HF model, under rendezvous."""

from __future__ import annotations

import pytest

from disagmoe_ds.afpipe.verify_run import run_verify
from disagmoe_ds.parity.reference import VerifyArgs
from disagmoe_ds.schedule import Kind
from tests.parity_cases import Job

F_ZERO3 = {"zero_stage": {"attention": 2, "ffn": 3}}
OFFLOAD = {"offload": {"attention": 0.5, "ffn": 0.5}}
RECOMPUTE_FFN = {"attention": "none", "ffn": "full"}
CLIP = 0.05  # active on the tiny models (their gradient norms are about 0.1-1)

CASES = [
    Job(M=2, N=4, node=2, K=3, zero=1, skew=True),  # 2 nodes of 2: each lane's gateways differ per node
    Job(family="deepseek-v3", M=2, N=4, p=2, node=2, K=3, zero=2),  # depth 2, a dense first layer, ZeRO-2
    Job(family="olmoe", M=2, N=4, edp=2, node=2, K=3, zero=1, skew=True),  # one node per replica: no headers
    # the experts at ZeRO-3 (gathered over the replicas between the node's all-to-alls); half the layers' activations
    # offloaded on both sides
    Job(M=2, N=4, edp=2, node=2, K=3, zero=2, extra=F_ZERO3, label="F_zero3"),
    Job(M=2, N=4, node=2, K=3, zero=2, extra=OFFLOAD, label="offload"),
    Job(M=2, N=4, node=2, K=3, zero=1, resend=True, extra={"split_backward": True}, label="split"),
    Job(M=1, N=4, node=2, K=3, zero=0, skew=True, factor=0.5),  # a capacity outgrown: the step runs again
    # one node of 4 ranks, the experts' activations recomputed in backward (the all-to-alls are not)
    Job(M=4, N=4, node=4, K=2, zero=1, extra={"recompute": RECOMPUTE_FFN}, label="ffn_full_recompute"),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_node_deduplicated_exchange_equals_hf(tiny_checkpoint, case: Job) -> None:
    cfg = case.config(transport="rendezvous")
    model = str(tiny_checkpoint(case.family, **case.overrides))
    args = VerifyArgs(model, cfg, zero=case.zero, seq_len=8, clip=CLIP, skew=case.skew)
    summary = run_verify(args, timeout_s=240)
    assert all(n > CLIP for n in summary["reference_grad_norms"]), "clipping must be active in this test"
    assert summary["pass"], summary


def _m2n_rows(rank: int, args: VerifyArgs) -> tuple[int, int]:
    """(peers of this rank's m2n fan-out, rows it sent on it in two steps); (0, 0) on an F rank."""
    from disagmoe_ds.afpipe.build import build_rank
    from disagmoe_ds.afpipe.verify_run import verify_costs
    from disagmoe_ds.comm.channel import FanOut
    from disagmoe_ds.parity.harness import build_for_verify, train_steps
    from disagmoe_ds.parity.reference import make_batches

    sent = [0]
    send = FanOut.send

    def counted(self: FanOut, messages, **kwargs):
        sizes = send(self, messages, **kwargs)
        if self.spec.name == "Tokens":
            sent[0] += sum(size[0] for size in sizes)
        return sizes

    FanOut.send = counted  # type: ignore[method-assign]  (this rank's process only)
    runtime = build_for_verify(build_rank, args, schedule_costs=verify_costs(args))
    role, vocab = runtime.role, runtime.module.config.vocab_size
    feeds = role.is_attention and role.group == 0
    train_steps(runtime, args, lambda step: make_batches(args, vocab, step, role.index) if feeds else None)
    if not role.is_attention:
        return 0, 0
    fan_out = runtime.executor.mailbox._out[Kind.M2N]  # noqa: SLF001 (the count of its peers is the point)
    return len(fan_out.peers), sent[0]


def test_a_token_crosses_once_per_node(tiny_checkpoint) -> None:
    """On the same batches (top-2 of 8 experts over 4 expert ranks), lanes send a message per node of 2 ranks
    instead of one per rank, and fewer rows in all: a token with two experts on one node goes there once."""
    from disagmoe_ds.config import DisagMoEConfig
    from disagmoe_ds.launch.testing import run_ranks

    model = str(tiny_checkpoint("qwen3-moe"))
    peers_rows = {}
    for node in (1, 2):
        cfg = DisagMoEConfig(attention_gpus=2, ffn_gpus=4, node_dedup=node, micro_batches=3, transport="rendezvous")
        results = run_ranks(_m2n_rows, 6, args=(VerifyArgs(model, cfg, seq_len=8, clip=0.0),), timeout_s=240)
        peers_rows[node] = results[:2]
    assert [peers for peers, _ in peers_rows[1]] == [4, 4]
    assert [peers for peers, _ in peers_rows[2]] == [2, 2]
    rows = {node: sum(r for _, r in lanes) for node, lanes in peers_rows.items()}
    assert rows[2] < rows[1], rows
