"""CUDA-graphed parts (``models.graphs``) against the same parts run as they are: bit-identical forward results,
input gradients and accumulated parameter gradients, with two micro-batches in flight (two slots), eager and
compiled, for families with different routers and positional embeddings. GPU only; the slot counts they need come
from ``schedule.layer_in_flight``, tested on CPU."""

from __future__ import annotations

import pytest
import torch

from disagmoe_ds.schedule import PipeShape, generate, layer_in_flight

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device (0 available)")


def test_layer_in_flight_counts_micro_batches_between_forward_and_backward():
    schedule = generate(PipeShape(depth=1, num_layers=2, moe_layers=(True, True)), num_micro_batches=4)
    for worker, stream in schedule.streams.items():
        most = layer_in_flight(stream)
        layers = {i.layer for i in stream if hasattr(i, "layer")}
        assert set(most) == layers
        assert all(1 <= n <= schedule.max_in_flight for n in most.values()), (worker, most)
    one = generate(PipeShape(depth=1, num_layers=1, moe_layers=(True,)), num_micro_batches=1)
    assert all(set(layer_in_flight(s).values()) == {1} for s in one.streams.values())


def test_structure_keys_round_trip_and_tell_shapes_apart():
    from disagmoe_ds.models.graphed_part import _flatten, _unflatten

    a, b, c = torch.zeros(2, 3), torch.ones(4, dtype=torch.long), torch.zeros(1)
    args = (a, None, (b, c), {"full_attention": None, "sliding_attention": c}, 7)
    tensors: list[torch.Tensor] = []
    key = _flatten(args, tensors)
    assert [t is x for t, x in zip(tensors, (a, b, c, c), strict=True)] == [True] * 4
    rebuilt = _unflatten(key, iter(tensors))
    assert rebuilt[1] is None and rebuilt[4] == 7 and rebuilt[2][0] is b and rebuilt[3]["sliding_attention"] is c
    hash(key)
    assert _flatten((torch.zeros(2, 4), None, (b, c), args[3], 7), []) != key  # another shape
    assert _flatten((a, None, (b, c), args[3], 8), []) != key  # another value
    assert (
        _flatten((a.clone(), None, (b.clone(), c.clone()), {"full_attention": None, "sliding_attention": c}, 7), [])
        == key
    )


def test_a_capture_copies_in_only_what_changed_and_zeroes_an_unused_gradient_once():
    from disagmoe_ds.models.graphed_part import _Capture

    static = (torch.zeros(3), torch.zeros(3))
    grads = (torch.zeros(3), None, torch.zeros(3))
    capture = _Capture(static, (), None, grads, (None, None), (), forward=None, backward=None)
    h, rope = torch.ones(3), torch.full((3,), 2.0)
    capture.copy_in([h, rope])
    assert static[0].tolist() == [1.0] * 3 and static[1].tolist() == [2.0] * 3
    static[1].fill_(-1.0)  # a replay never writes its inputs: a skipped copy is visible here
    capture.copy_in([torch.full((3,), 5.0), rope])
    assert static[0].tolist() == [5.0] * 3 and static[1].tolist() == [-1.0] * 3  # the same tensor: not copied
    rope.add_(1.0)
    capture.copy_in([h, rope])
    assert static[1].tolist() == [3.0] * 3  # modified in place since: copied again

    grads[2].fill_(9.0)
    capture.copy_grads_in([torch.ones(3), None, None])
    assert grads[0].tolist() == [1.0] * 3 and grads[2].tolist() == [0.0] * 3
    grads[2].fill_(9.0)
    capture.copy_grads_in([torch.ones(3), None, None])
    assert grads[2].tolist() == [9.0] * 3  # known zero: not written again (9 is the test's marker)
    capture.copy_grads_in([None, None, torch.full((3,), 4.0)])
    capture.copy_grads_in([None, None, None])
    assert grads[2].tolist() == [0.0] * 3 and grads[0].tolist() == [0.0] * 3


def _parts(family: str, compiled: bool):
    from transformers import AutoConfig, AutoModelForCausalLM

    from disagmoe_ds.models.attention_kernel import use_attention
    from disagmoe_ds.models.model_facts import num_experts_of, routing_facts
    from disagmoe_ds.models.parts import AttentionStage, ExpertStage, compile_stage
    from tests.conftest import ROOT

    config = AutoConfig.from_pretrained(ROOT / "hf_models" / f"tiny-{family}")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).train()
    use_attention(model, "auto", torch.device("cuda"))  # GPT-OSS: flex_attention, as its jobs run on CUDA
    layers = tuple(range(config.num_hidden_layers))
    attention = AttentionStage(model, layers, with_embedding=False, with_head=True)
    experts = ExpertStage(model, layers, 0, num_experts_of(config))
    if compiled:
        compile_stage(attention)
        compile_stage(experts)
    return config, attention, experts, routing_facts(model).weight_dtype


def _run(config, attention, experts, graphs, inputs, *, one_by_one: bool = False):
    """Two micro-batches, their gradients accumulated in ``.grad``: forward of both through every layer, then
    backward of the second, then the first (two in flight); ``one_by_one``: each backward right after its forward
    (one slot is enough, and the second forward replays over memory the first backward's gradients came from)."""
    from disagmoe_ds.comm.routing import combine, pack, plan_dispatch

    results, losses, recorded = [], [], []
    for h_BSH, labels_BS in inputs:
        h_BSH = h_BSH.detach().requires_grad_()
        ctx = attention.context(h_BSH, None)
        x, outs = h_BSH, []
        for layer in range(config.num_hidden_layers):
            out = graphs.part(attention, layer)(x, ctx, config)
            outs += [out.residual_BSH, out.topk_w_TK]
            if out.x_TH is None:
                x = out.residual_BSH
                continue
            plan = plan_dispatch(out.topk_idx_TK, 1, experts.num_local)
            ((x_RH, w_RK),) = pack(out.x_TH, out.topk_w_TK, plan)
            y_RH = graphs.shard(experts, layer)(x_RH, plan.local_idx_RK[0], w_RK, plan.pairs[0])
            x = out.residual_BSH + combine([y_RH], plan).view_as(out.residual_BSH)
        _, loss = graphs.head_of(attention)(x, labels_BS)
        losses.append(loss)
        recorded.append(loss.detach().clone())  # a graph's outputs hold until its slot runs again
        results.append([h_BSH, [o.detach().clone() for o in outs if o is not None]])
        if one_by_one:
            loss.backward()
    for loss in [] if one_by_one else reversed(losses):
        loss.backward()
    params = [*attention.parameters(), *experts.parameters()]
    grads = [p.grad.clone() if p.grad is not None else None for p in params]
    for p in params:
        p.grad = None
    return [torch.stack(recorded)], [(outs, h.grad) for h, outs in results], grads


@pytest.mark.parametrize(("family", "dtype", "graphed"), [("qwen3-moe", torch.bfloat16, True),
                         ("qwen3-moe", torch.float32, False), ("gpt-oss", torch.bfloat16, False)])  # fmt: skip
def test_only_shards_that_run_on_the_device_alone_are_graphed(family, dtype, graphed):
    """HF's experts module (GPT-OSS's; fp32 on CUDA) finds its pairs on the host: it runs as it is, beside graphs
    (the GPU test below runs GPT-OSS so)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from disagmoe_ds.models.model_facts import num_experts_of
    from disagmoe_ds.models.parts import ExpertStage
    from tests.conftest import ROOT

    config = AutoConfig.from_pretrained(ROOT / "hf_models" / f"tiny-{family}")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    experts = ExpertStage(model, tuple(range(config.num_hidden_layers)), 0, num_experts_of(config))
    shard = experts.shard(int(next(iter(experts.layers))))
    assert shard.capturable(dtype, torch.device("cuda")) is graphed  # graph_stages leaves it out where False


@cuda
@pytest.mark.parametrize("family", ["qwen3-moe", "deepseek-v3", "mixtral", "gpt-oss"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("one_by_one", [False, True], ids=["two-in-flight", "one-by-one"])
def test_graphed_parts_are_bit_identical(family, compiled, one_by_one):
    from disagmoe_ds.models.graphs import StageGraphs, graph_stages

    config, attention, experts, weight_dtype = _parts(family, compiled)
    batch, seq_len, top_k = 2, 16, config.num_experts_per_tok
    gen = torch.Generator(device="cuda").manual_seed(1)
    inputs = [
        (
            torch.randn(batch, seq_len, config.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen),
            torch.randint(0, config.vocab_size, (batch, seq_len), device="cuda", generator=gen),
        )
        for _ in range(2)
    ]
    reference = _run(config, attention, experts, StageGraphs(), inputs, one_by_one=one_by_one)
    slots = 1 if one_by_one else 2
    graphs = graph_stages(lambda layer: slots, attention=attention, experts=experts)
    graphs.capture_attention(attention, batch=batch, seq_len=seq_len, positions=[None])
    graphs.capture_shards(experts, rows=batch * seq_len, top_k=top_k, weight_dtype=weight_dtype)
    for _ in range(2):  # the second time through, every slot replays after its first backward
        graphed = _run(config, attention, experts, graphs, inputs, one_by_one=one_by_one)
        assert graphs.misses == 0
        for want, got in zip(_flat(reference), _flat(graphed), strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def _flat(run) -> list[torch.Tensor]:
    losses, per_micro_batch, grads = run
    out = list(losses) + [g for g in grads if g is not None]
    for outs, h_grad in per_micro_batch:
        out += [*outs, h_grad]
    return out


@cuda
def test_a_graphed_shard_at_a_capacity_is_bit_identical_and_captured_again_when_grown():
    """Messages padded to a capacity (rows of sentinel ids and zero weights after the routed ones, a pair bound):
    the graphed shard gives what the shard gives, also for a message of padding only, and after the capacity
    grew (``capture_shards`` again, as ``ExpertRunner`` does) at the new size."""
    from disagmoe_ds.models.graphs import graph_stages

    config, _, experts, weight_dtype = _parts("qwen3-moe", compiled=False)
    layer = int(next(iter(experts.layers)))
    shard, top_k, sentinel = experts.shard(layer), config.num_experts_per_tok, experts.num_local
    graphs = graph_stages(lambda layer: 1, experts=experts)
    gen = torch.Generator(device="cuda").manual_seed(2)

    def message(rows: int, routed: int):
        x = torch.randn(rows, config.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
        idx = torch.full((rows, top_k), sentinel, device="cuda")
        idx[:routed] = torch.randint(0, sentinel + 1, (routed, top_k), device="cuda", generator=gen)
        w = torch.zeros(rows, top_k, device="cuda", dtype=weight_dtype)
        w[:routed] = torch.rand(routed, top_k, device="cuda", dtype=weight_dtype, generator=gen)
        return x, idx, w

    def run(call, x, idx, w, bound):
        x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = call(x, idx, w, bound, True)
        inputs = [x, w, *shard.parameters()]
        grads = torch.autograd.grad(y, inputs, torch.ones_like(y), allow_unused=True)
        return [y.detach().clone(), *(torch.zeros_like(t) if g is None else g.clone() for t, g in zip(inputs, grads))]

    for rows in (12, 20):  # captured at 12 rows, then at a grown capacity of 20
        bound = rows * top_k
        graphs.capture_shards(experts, rows=rows, top_k=top_k, weight_dtype=weight_dtype, pair_bound=bound)
        for routed in (rows - 3, 0):
            x, idx, w = message(rows, routed)
            want = run(shard, x, idx, w, bound)
            got = run(graphs.shard(experts, layer), x, idx, w, bound)
            for a, b in zip(want, got, strict=True):
                assert torch.isfinite(b).all()
                torch.testing.assert_close(b, a, rtol=0, atol=0)
        assert graphs.misses == 0


def test_an_expert_runner_captures_its_shards_again_at_a_grown_capacity():
    """The executor grows the capacity between a discarded step and its rerun; the graphed shards follow (on CPU
    the captures are recorded, not made)."""
    from types import SimpleNamespace

    from disagmoe_ds.afpipe.chunk_settings import ChunkSettings
    from disagmoe_ds.afpipe.expert_runner import ExpertRunner
    from disagmoe_ds.comm.routing import Capacity
    from disagmoe_ds.models.graphs import StageGraphs

    class Recorded(StageGraphs):
        def capture_shards(self, stage, **sizes):
            captured.append(sizes)

    captured: list[dict] = []
    capacity = Capacity.initial(tokens=64, top_k=2, ep_size=2, experts_per_rank=4, factor=1.25)
    graphs = Recorded(shards={0: object()})
    settings = ChunkSettings(top_k=2, graphs=graphs, capacity=capacity)
    runner = ExpertRunner(SimpleNamespace(device=torch.device("cpu")), SimpleNamespace(), settings, lanes=2)
    runner.capacity = capacity  # unchanged: nothing to capture again
    grown = capacity.grown(60, 100)
    runner.capacity = grown
    assert captured == [
        {"rows": grown.rows * 2, "top_k": 2, "weight_dtype": torch.float32, "pair_bound": grown.pairs * 2}
    ]
