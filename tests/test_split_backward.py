"""Split backward (``"disagmoe": {"split_backward": true}``): each backward sends its input gradients first (B) and
runs its weight gradients later (W) where the worker would idle.

Schedule: streams with W tasks keep the send/receive contract, W costs of zero change nothing, and the order the
runtime generates is the one the planner simulates. Runtime: B and W of one chunk equal one backward (hooks
included) and W frees the chunk; whole jobs equal the single-process HF model under the rendezvous transport.
"""

from __future__ import annotations

import gc
import json
import weakref

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from disagmoe_ds.afpipe.split_backward import backward_input, backward_weight, retained_graph_compiles
from disagmoe_ds.afpipe.verify_run import run_verify
from disagmoe_ds.layout import Layout
from disagmoe_ds.parity.reference import VerifyArgs
from disagmoe_ds.planner.model import ModelSpec
from disagmoe_ds.planner.runtime_costs import runtime_costs, runtime_task_costs
from disagmoe_ds.planner.simulate import simulate_af
from disagmoe_ds.schedule import (
    BackwardAttn,
    BackwardExperts,
    Costs,
    PipeShape,
    WeightGradAttn,
    WeightGradExperts,
    check_streams,
    generate,
)
from tests.parity_cases import Job

SPLIT = Costs(a_bwd=1.0, f_bwd=1.0, head_bwd=1.0, a_wgt=1.0, f_wgt=1.0, head_wgt=1.0)  # backward halved, same work
CLIP = 0.05  # below the tiny models' gradient norms, so global-norm clipping is active (as in test_runtime.py)
MIXTRAL = {
    "model_type": "mixtral",
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "vocab_size": 256,
}


# ----- schedule -----
SHAPES = [
    (1, 1, (True,), 1, None),
    (1, 2, (True, True), 4, None),
    (1, 3, (False, True, True), 3, 2),  # a dense first layer
    (2, 4, (True,) * 4, 1, None),
    (2, 4, (True,) * 4, 5, 3),
    (2, 6, (False,) + (True,) * 5, 8, None),
    (3, 6, (True,) * 6, 7, None),
]


@pytest.mark.parametrize(("depth", "layers", "moe", "K", "cap"), SHAPES)
def test_streams_with_weight_grads_keep_the_contract(depth, layers, moe, K, cap):
    schedule = generate(PipeShape(depth, layers, moe), K, costs=SPLIT, max_in_flight=cap)
    check_streams(schedule.streams)
    for stream in schedule.streams.values():
        backwards = [(i.layer, i.micro_batch) for i in stream if isinstance(i, BackwardAttn | BackwardExperts)]
        weights = [(i.layer, i.micro_batch) for i in stream if isinstance(i, WeightGradAttn | WeightGradExperts)]
        assert sorted(weights) == sorted(backwards)  # one W per backward, on its worker
        where = {(type(i).__name__, i.layer, i.micro_batch): n for n, i in enumerate(stream) if hasattr(i, "layer")}
        for layer, mb in weights:  # after its B
            b = where.get(("BackwardAttn", layer, mb), where.get(("BackwardExperts", layer, mb)))
            assert b < where.get(("WeightGradAttn", layer, mb), where.get(("WeightGradExperts", layer, mb)))


def test_weight_grads_of_zero_cost_leave_the_plain_schedule():
    for depth, layers, moe, K, cap in SHAPES:
        shape = PipeShape(depth, layers, moe)
        plain = generate(shape, K, max_in_flight=cap)
        zero = generate(shape, K, costs=Costs(a_wgt=0.0, f_wgt=0.0, head_wgt=0.0), max_in_flight=cap)
        assert zero.streams == plain.streams and zero.compute == plain.compute


def test_split_shortens_the_predicted_step():
    shape = PipeShape(2, 8, (True,) * 8)
    assert generate(shape, 8, costs=SPLIT).step_time_s < generate(shape, 8).step_time_s


@pytest.mark.parametrize(("M", "N", "depth", "K"), [(1, 1, 1, 4), (2, 2, 2, 6), (4, 4, 2, 3)])
def test_runtime_order_is_the_planner_simulation_order(M, N, depth, K):
    layout = Layout(attention_gpus=M, ffn_gpus=N, num_layers=4, num_experts=4, depth=depth)
    kw = {"seq_len": 256, "micro_batch_size": 1, "split_backward": True}
    cap = 2 * depth + 1
    runtime = generate(
        PipeShape(depth, 4, (True,) * 4), K, costs=runtime_costs(MIXTRAL, layout, **kw), max_in_flight=cap
    )
    spec = ModelSpec.from_config(MIXTRAL)
    simulated = simulate_af(spec, layout, runtime_task_costs(MIXTRAL, layout, **kw), micro_batches=K, max_in_flight=cap)
    planner: dict[str, list[tuple[float, str]]] = {}
    for event in simulated.events:
        if event.category == "compute":
            planner.setdefault(event.worker, []).append((event.start_s, event.name))
    ours = {line.split(":")[0]: line.split()[1:] for line in runtime.render().splitlines()}
    assert ours == {track: [name for _, name in sorted(events)] for track, events in planner.items()}
    assert any(name.startswith("W") for names in ours.values() for name in names)


def test_compiled_attention_side_gets_no_weight_grad_task():
    layout = Layout(attention_gpus=1, ffn_gpus=1, num_layers=4, num_experts=4)
    costs = runtime_costs(MIXTRAL, layout, seq_len=256, micro_batch_size=1, split_backward=True, compiled=True)
    streams = generate(PipeShape(1, 4, (True,) * 4), 3, costs=costs).streams
    assert not any(isinstance(i, WeightGradAttn) for stream in streams.values() for i in stream)
    assert any(isinstance(i, WeightGradExperts) for stream in streams.values() for i in stream)


# ----- one chunk: B then W equals one backward -----
class _Engine:
    """What ``backward_weight`` needs of a DeepSpeed engine: ``backward(loss, scale_wrt_gas)``, counted."""

    def __init__(self):
        self.calls = 0

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool) -> None:
        assert not scale_wrt_gas
        self.calls += 1
        loss.backward()


def _chunk(mode: str):
    """A small chunk (its input, pseudo-loss, parameters and the LayerNorm output the last GEMM saves for its W)."""
    torch.manual_seed(0)
    first, norm, last = torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 8)
    params = [*first.parameters(), *norm.parameters(), *last.parameters()]
    for p in params:
        p.register_hook(lambda g: g * 0.5)  # as deepspeed_role.scale_gradients does
    middle = torch.nn.functional.gelu
    if mode == "compiled":  # a compiled region on the input path, without parameters (the experts' elementwise)
        with retained_graph_compiles():
            middle = torch.compile(torch.nn.functional.gelu, backend="aot_eager")
    saved = []

    def body(x):
        h = norm(middle(first(x)))
        saved.append(weakref.ref(h))
        return last(h)

    x = torch.randn(4, 8, requires_grad=mode != "no input")
    with retained_graph_compiles():
        y = checkpoint(body, x, use_reentrant=False) if mode == "checkpoint" else body(x)
    loss = (y * torch.randn(4, 8, generator=torch.Generator().manual_seed(1))).sum()
    return x, loss, params, saved


@pytest.mark.parametrize("mode", ["eager", "checkpoint", "compiled", "no input"])
def test_input_then_weight_pass_equals_one_backward(mode):
    x, loss, params, _ = _chunk(mode)
    loss.backward()
    want_x, want = x.grad, [p.grad.clone() for p in params]
    x, loss, params, saved = _chunk(mode)
    engine = _Engine()
    with retained_graph_compiles():  # as ExpertRunner runs forward and B when its layers split
        deferred = backward_input(loss, [x, None], params)
    assert all(p.grad is None for p in params) and engine.calls == 0
    if want_x is not None:
        assert torch.equal(x.grad, want_x)
    del loss
    gc.collect()
    if mode == "eager":
        assert saved[0]() is not None  # B keeps what W needs
    backward_weight(engine, deferred)
    del deferred
    gc.collect()
    assert engine.calls == 1  # one engine.backward per chunk, as without the split
    for p, g in zip(params, want, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=1e-7)
    assert all(ref() is None for ref in saved)  # the chunk's activations are gone once W has run


# ----- whole jobs against HF -----
# 2 lanes and ep 2 (expert gradients scaled by 1/2 in their hooks) with activation checkpointing under ZeRO-2
# (reduced in W's hooks); depth 2; expert replicas under ZeRO-2 where a replica gets no token (its zero row must
# reach every parameter in W); a dense layer, shared experts and one micro-batch with resend and activation offload
# on both sides.
CASES = [
    Job(M=2, N=2, K=3, zero=2, extra={"activation_checkpointing": True}),
    Job(family="mixtral", M=2, N=2, p=2, K=4, zero=1, skew=True),
    Job(family="deepseek-v3", M=1, N=4, edp=2, K=2, zero=2, skew=True),
    Job(
        family="qwen2-moe", K=1, zero=0, resend=True, extra={"offload": {"attention": 1.0, "ffn": 1.0}}, label="offload"
    ),
    # F at ZeRO-3 over 2 replicas: whole there
    Job(M=1, N=2, edp=2, K=3, zero=1, skew=True, extra={"zero_stage": {"ffn": 3}}, label="ffn_zero3"),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_split_backward_equals_hf(tiny_checkpoint, tmp_path, case: Job):
    cfg = case.config(transport="rendezvous", split_backward=True)
    trace = tmp_path / "trace.json"
    model = str(tiny_checkpoint(case.family))
    args = VerifyArgs(model, cfg, zero=case.zero, seq_len=8, clip=CLIP, skew=case.skew, timeline=str(trace))
    summary = run_verify(args, timeout_s=240)
    assert all(n > CLIP for n in summary["reference_grad_norms"]), "clipping must be active in this test"
    assert summary["pass"], summary
    names = {e["name"].split("(")[0] for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"}
    ffn_zero3 = case.extra.get("zero_stage", {}).get("ffn") == 3  # its backward stays whole (afpipe.split_backward)
    assert "WeightGradAttn" in names and ("WeightGradExperts" in names) != ffn_zero3
