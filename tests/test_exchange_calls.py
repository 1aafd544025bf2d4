"""What the exchanges cost a rank's host inside a step: communicator calls per message and waits for sizes.

Real AF-Pipe jobs (``disagmoe-verify``'s build, DeepSpeed engines, the rendezvous transport) train two steps and
each rank reports its mailbox's ``ExchangeStats``. With one ep rank per F-group every size is known from the
micro-batch size, so no message has a header: each send and each receive is one grouped operation, and the host
never stops for a size, at depth 1 and 2, with lanes and with resend. With several ep ranks the m2n and resid sizes
come from the router: at a fixed capacity (``capacity_factor``) they are the capacity's, so the same holds, even in
a step that outgrows the capacity and runs again; without one each of those messages carries a host header per peer
(one more call each).
"""

from __future__ import annotations

import pytest

from disagmoe_ds.afpipe.build import build_rank
from disagmoe_ds.afpipe.verify_run import verify_costs
from disagmoe_ds.config import DisagMoEConfig
from disagmoe_ds.launch.testing import run_ranks
from disagmoe_ds.parity.harness import build_for_verify, train_steps
from disagmoe_ds.parity.reference import VerifyArgs, make_batches


def _stats(rank: int, args: VerifyArgs):
    runtime = build_for_verify(build_rank, args, schedule_costs=verify_costs(args))
    role = runtime.role
    feeds = role.is_attention and role.group == 0
    vocab = runtime.module.config.vocab_size
    train_steps(runtime, args, lambda step: make_batches(args, vocab, step, role.index) if feeds else None)
    return runtime.layout.ep_size, runtime.executor.mailbox.stats(), runtime.executor.reruns


@pytest.mark.parametrize(
    ("M", "N", "p", "resend"),
    [(1, 1, 1, False), (2, 1, 1, True), (2, 2, 2, False), (2, 2, 2, True)],
    ids=["1A1F", "2-lanes-resend", "depth-2", "depth-2-resend"],
)
def test_one_ep_rank_one_call_per_message_and_no_size_wait(tiny_checkpoint, M, N, p, resend):
    cfg = DisagMoEConfig(attention_gpus=M, ffn_gpus=N, depth=p, micro_batches=3, transport="rendezvous", resend=resend)
    args = VerifyArgs(str(tiny_checkpoint("qwen2-moe")), cfg, seq_len=8, clip=0.0)  # qwen2: a dense layer too
    for ep_size, stats, _ in run_ranks(_stats, M + N, args=(args,), timeout_s=240):
        assert ep_size == 1
        assert stats.sends > 0 and stats.receives > 0, stats
        assert stats.send_calls <= stats.sends and stats.receive_calls <= stats.receives, stats
        assert stats.size_waits == 0, stats


@pytest.mark.parametrize(
    ("M", "N", "p", "resend", "factor"),
    [(1, 2, 1, False, 1.5), (2, 4, 2, False, 0.5), (2, 4, 2, True, 1.25)],
    ids=["1A2F", "depth-2-outgrown", "depth-2-resend"],
)
def test_several_ep_ranks_at_a_capacity_one_call_per_message_and_no_size_wait(tiny_checkpoint, M, N, p, resend, factor):
    cfg = DisagMoEConfig(
        attention_gpus=M,
        ffn_gpus=N,
        depth=p,
        micro_batches=3,
        transport="rendezvous",
        resend=resend,
        capacity_factor=factor,
    )
    args = VerifyArgs(str(tiny_checkpoint("qwen3-moe")), cfg, seq_len=8, clip=0.0, skew=True)
    results = run_ranks(_stats, M + N, args=(args,), timeout_s=240)
    for ep_size, stats, _ in results:
        assert ep_size == 2
        assert stats.sends > 0 and stats.receives > 0, stats
        assert stats.send_calls <= stats.sends and stats.receive_calls <= stats.receives, stats
        assert stats.size_waits == 0, stats
    assert len({reruns for *_, reruns in results}) == 1  # every rank runs a step again, or none does
    if factor < 1:  # a capacity below balanced routing's: the skewed router outgrows it
        assert results[0][2] > 0


def test_several_ep_ranks_pay_a_header_per_peer(tiny_checkpoint):
    cfg = DisagMoEConfig(attention_gpus=2, ffn_gpus=4, depth=2, micro_batches=3, transport="rendezvous")
    args = VerifyArgs(str(tiny_checkpoint("qwen3-moe")), cfg, seq_len=8, clip=0.0)
    results = run_ranks(_stats, 6, args=(args,), timeout_s=240)
    for ep_size, stats, _ in results:
        assert ep_size == 2
        assert stats.calls_per_send <= 1 + ep_size and stats.calls_per_receive <= 1 + ep_size, stats
    assert any(stats.calls_per_send > 1 for _, stats, _ in results[:2])  # the lanes' m2n and resid headers
