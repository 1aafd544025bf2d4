"""Bad layouts fail before any rank starts; a rank that dies mid-step ends the whole job quickly."""

from __future__ import annotations

import os
import re
import time
from dataclasses import replace

import pytest

from disagmoe_ds.afpipe.build import build_rank, preflight
from disagmoe_ds.afpipe.expert_runner import ExpertRunner
from disagmoe_ds.afpipe.verify import main
from disagmoe_ds.afpipe.verify_run import verify_costs
from disagmoe_ds.comm.channel import ChannelError
from disagmoe_ds.config import DisagMoEConfig
from disagmoe_ds.errors import ConfigError, LayoutError
from disagmoe_ds.launch.local import RankFailedError, spawn_local
from disagmoe_ds.parity.reference import VerifyArgs, load_for_verify, make_batches

MODEL = "hf_models/tiny-qwen2-moe"  # 4 layers, 8 experts, layer 0 dense


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--ffn-gpus", "3"], r"num_experts \(8\) must be divisible by the expert-parallel size \(3"),
        (["--depth", "3", "--attention-gpus", "3", "--ffn-gpus", "3"], r"must be divisible by depth \(3\)"),
        (["--attention-gpus", "3", "--depth", "2", "--ffn-gpus", "2"], r"attention_gpus \(3\) must be divisible"),
    ],
)
def test_bad_layout_fails_before_launch(capsys, flags, message):
    start = time.monotonic()
    assert main(["--model", MODEL, *flags]) == 2
    assert time.monotonic() - start < 10  # no rank was started
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("disagmoe-verify: error: ")
    assert re.search(message, err[0])


def test_world_size_mismatch_is_rejected():
    cfg = DisagMoEConfig(attention_gpus=2, ffn_gpus=2)
    with pytest.raises(LayoutError, match=r"world size 3 does not match the layout: attention_gpus 2 \+ ffn_gpus 2"):
        preflight(MODEL, cfg, {}, world_size=3)


def test_unknown_config_key():
    with pytest.raises(ConfigError, match='unknown key\\(s\\) in "disagmoe": atention_gpus'):
        DisagMoEConfig.from_ds_config({"disagmoe": {"atention_gpus": 2}})


def _dies_mid_step(rank: int, args: VerifyArgs) -> None:
    rt = build_rank(args.model, args.ds_config(), args.cfg, micro_batch_size=1, model=load_for_verify(args))
    if isinstance(rt.executor.runner, ExpertRunner):
        rt.executor.runner.forward = lambda *a: os._exit(3)  # the FFN rank dies at its first expert forward
    batches = make_batches(args, rt.module.config.vocab_size, 0, 0) if rt.role.is_attention else None
    rt.executor.train_batch(batches)


def test_dead_rank_ends_the_job(tiny_checkpoint):
    cfg = DisagMoEConfig(attention_gpus=1, ffn_gpus=1, micro_batches=2)
    args = VerifyArgs(str(tiny_checkpoint("qwen3-moe")), cfg, steps=1, seq_len=8, clip=0.0)
    start = time.monotonic()
    with pytest.raises(RankFailedError, match="rank 1"):
        spawn_local(_dies_mid_step, 2, args=(args,), timeout_s=60)
    assert time.monotonic() - start < 30


def _peer_stops_responding(rank: int, args: VerifyArgs) -> None:
    rt = build_rank(args.model, args.ds_config(), args.cfg, micro_batch_size=1, model=load_for_verify(args))
    if rt.role.is_attention:  # waits for expert outputs that never come
        rt.executor.train_batch(make_batches(args, rt.module.config.vocab_size, 0, 0))
    else:
        time.sleep(60)  # alive but silent: only the communication timeout can end the wait


def test_silent_peer_times_out(tiny_checkpoint, capfd):
    cfg = DisagMoEConfig(attention_gpus=1, ffn_gpus=1, micro_batches=1, comm_timeout_s=4.0)
    args = VerifyArgs(str(tiny_checkpoint("qwen3-moe")), cfg, steps=1, seq_len=8, clip=0.0)
    start = time.monotonic()
    with pytest.raises(RankFailedError, match="rank 0"):
        spawn_local(_peer_stops_responding, 2, args=(args,), timeout_s=60)
    assert time.monotonic() - start < 30
    # Before the timeout ended it, the waiting rank printed where it waited (after half the timeout).
    err = capfd.readouterr().err
    assert "Timeout (0:00:02)" in err and "in _exec_wait_recv" in err, err[-3000:]


def _trains_a_shorter_batch(rank: int, args: VerifyArgs) -> str:
    rt = build_rank(
        args.model,
        args.ds_config(),
        args.cfg,
        micro_batch_size=1,
        model=load_for_verify(args),
        seq_len=args.seq_len,
        schedule_costs=verify_costs(args),
    )
    if not rt.role.is_attention:
        return "not trained"
    short = replace(args, seq_len=args.seq_len - 2)  # not the length the ranks were built for
    try:
        rt.executor.train_batch(make_batches(short, rt.module.config.vocab_size, 0, 0))
    except ChannelError as err:
        return str(err)
    return "trained"


def test_batch_of_another_length_than_built_fails_clearly(tiny_checkpoint):
    """One ep rank and a known length: m2n travels without headers, so a lane must send exactly its micro-batch's
    tokens; a batch of another length is refused on the attention rank with the fix, before anything is sent."""
    cfg = DisagMoEConfig(attention_gpus=1, ffn_gpus=1, micro_batches=1, transport="rendezvous")
    args = VerifyArgs(str(tiny_checkpoint("qwen3-moe")), cfg, steps=1, seq_len=8, clip=0.0)
    message, _ = spawn_local(_trains_a_shorter_batch, 2, args=(args,), timeout_s=60)
    assert "m2n rows [6], but the FFN side expects [8], the fixed sizes of the micro-batch's 8 tokens" in message


@pytest.mark.parametrize(
    ("section", "lever"),
    [
        ({"activation_checkpointing": True}, "activation_checkpointing"),
        ({"selective_recompute": True}, "selective_recompute"),
        ({"offload": {"attention": 0.5}}, "offload"),
        ({"split_backward": True}, "split_backward"),
    ],
)
def test_cuda_graphs_refuse_the_levers_that_move_saved_tensors(section, lever):
    with pytest.raises(ConfigError, match=rf'"disagmoe.cuda_graphs" does not work with "disagmoe.{lever}"'):
        DisagMoEConfig.from_ds_config({"disagmoe": {"cuda_graphs": True, **section}})


def test_cuda_graphs_on_a_cpu_rank_fail_at_build_with_the_fix():
    start = time.monotonic()
    with pytest.raises(RankFailedError, match=r'"cuda_graphs" replays parts as CUDA graphs; rank \d runs on cpu: turn'):
        main(["--model", MODEL, "--cuda-graphs", "--steps", "1"])
    assert time.monotonic() - start < 60
