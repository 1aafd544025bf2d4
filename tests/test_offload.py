"""Activation offload (``afpipe.offload``, ``"disagmoe": {"offload": {...}}``): saved tensors of the chosen chunks
leave the device between forward and backward and come back for the backward; the job still equals HF exactly."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from disagmoe_ds.afpipe.offload import ActivationOffloader, offloaded_layers
from disagmoe_ds.afpipe.verify import parse_args
from disagmoe_ds.afpipe.verify_run import run_verify
from disagmoe_ds.config import DisagMoEConfig
from disagmoe_ds.errors import ConfigError
from disagmoe_ds.parity.reference import VerifyArgs

CPU = torch.device("cpu")


class _Saves(torch.autograd.Function):
    """Saves exactly the tensors it is given (through the hooks in force); its backward checks their values and
    notes their strides in ``strides``."""

    strides: list[tuple[int, ...]] = []

    @staticmethod
    def forward(ctx, x, *saved):
        ctx.save_for_backward(*saved)
        ctx.expected = [t.clone() for t in saved]
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        for got, want in zip(ctx.saved_tensors, ctx.expected, strict=True):
            assert torch.equal(got, want)
        _Saves.strides = [t.stride() for t in ctx.saved_tensors]
        return (grad * 2, *[None] * len(ctx.expected))


def _model() -> tuple[torch.nn.Linear, torch.Tensor]:
    torch.manual_seed(0)
    return torch.nn.Linear(64, 128), torch.randn(32, 64, requires_grad=True)


def _gated(lin: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    h = lin(x)
    a, b = h[:, :64], h[:, 64:]  # two views of one storage
    return (torch.nn.functional.silu(a) * b).sigmoid().sum()


def _grads(fn, lin: torch.nn.Linear, x: torch.Tensor, offloader: ActivationOffloader | None, key=(0, 0)):
    """Gradients of x and the weights through ``fn``, run under ``offloader``'s forward and backward of ``key``."""
    x.grad, lin.weight.grad, lin.bias.grad = None, None, None
    if offloader is None:
        fn(lin, x).backward()
    else:
        with offloader.forward(key):
            loss = fn(lin, x)
        held = offloader.host_bytes
        with offloader.backward(key):
            loss.backward()
        assert held > 0 and offloader.host_bytes == 0 and not offloader.chunks
    return [x.grad.clone(), lin.weight.grad.clone(), lin.bias.grad.clone()]


def test_saved_tensors_move_to_host_once_per_storage_and_come_back():
    big = torch.randn(64, 32)
    small = torch.randn(4)
    param = torch.nn.Parameter(torch.randn(64, 64))
    x = torch.randn(8, 8, requires_grad=True)
    saved = (big, big[32:], big.t(), param.t(), small, big.expand(3, 64, 32), big[1:5, :4])
    off = ActivationOffloader([0], device=CPU, params=[param], min_bytes=64)
    with off.forward((0, 0)):
        y = _Saves.apply(x, *saved)
    # big, its views and its expansion once, as a storage; the 4x4 corner of it alone; the parameter's view and the
    # 16-byte tensor stay
    assert off.tensors_out == 5
    assert off.host_bytes == off.bytes_out == big.nbytes + 4 * 4 * 4
    with off.forward((1, 0)):  # a layer not chosen: nothing moves
        _Saves.apply(x, big)
    assert off.tensors_out == 5 and (1, 0) not in off.chunks
    with off.backward((0, 0)):
        y.sum().backward()  # _Saves.backward checks the values
    assert off.host_bytes == 0 and not off.chunks
    assert _Saves.strides[:6] == [t.stride() for t in saved[:6]]  # views of a storage come back as views
    assert torch.equal(x.grad, torch.full_like(x, 2.0))


def test_offloaded_activations_leave_the_device_and_grads_are_exact():
    lin, x = _model()
    reference = _grads(_gated, lin, x, None)
    off = ActivationOffloader([0], device=CPU, params=lin.parameters())
    assert all(torch.equal(a, b) for a, b in zip(_grads(_gated, lin, x, off), reference, strict=True))
    assert off.tensors_out >= 4  # x, the views of h, silu's and sigmoid's tensors; the weight stays

    def kept(offloader: ActivationOffloader | None) -> bool:
        """Whether autograd still holds the original of a saved intermediate after the forward."""
        with offloader.forward((0, 1)) if offloader else torch.enable_grad():
            h = lin(x)
            out = h.sin()
        alive = weakref.ref(h)
        del h
        gc.collect()
        assert out.grad_fn is not None  # the graph, and what it saved, is still there
        return alive() is not None

    assert kept(None) and not kept(off)


def test_an_inplace_change_of_an_offloaded_tensor_is_still_refused():
    """Autograd refuses a backward through a saved tensor changed in place since; the host copy keeps that check
    (on a GPU the change could race the copy out)."""
    x = torch.randn(32, 64, requires_grad=True)
    off = ActivationOffloader([0], device=CPU)
    with off.forward((0, 0)):
        h = x * 2
        y = h.sin()
    h.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"), off.backward((0, 0)):
        y.sum().backward()


def test_checkpointed_chunks_offload_only_their_inputs():
    lin, x = _model()
    reference = _grads(_gated, lin, x, None)
    off = ActivationOffloader([0], device=CPU, params=lin.parameters())

    def checkpointed(lin, x):
        return checkpoint(_gated, lin, x, use_reentrant=False)

    assert all(torch.equal(a, b) for a, b in zip(_grads(checkpointed, lin, x, off), reference, strict=True))
    assert off.tensors_out == 1 and off.bytes_out == x.nbytes


def test_compiled_parts_save_through_the_hooks():
    """AOTAutograd's compiled autograd function saves its activations with ``save_for_backward``, so they move too
    (``aot_eager``: the same saving path as inductor, without its compile time)."""
    lin, x = _model()
    reference = _grads(_gated, lin, x, None)
    compiled = torch.compile(_gated, backend="aot_eager", fullgraph=True)
    off = ActivationOffloader([0], device=CPU, params=lin.parameters())
    got = _grads(compiled, lin, x, off)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, reference, strict=True))
    assert off.tensors_out >= 2


def test_prefetch_loads_the_next_offloaded_backward_chunk():
    x = torch.randn(8, 8, requires_grad=True)
    order = [(3, 0), (2, 0), (1, 0), (0, 0)]  # layer 2 is not offloaded: 1 follows 3
    off = ActivationOffloader([0, 1, 3], device=CPU, backward_order=order, min_bytes=1)
    outs = {}
    for layer in (0, 1, 2, 3):
        with off.forward((layer, 0)):
            outs[layer] = _Saves.apply(x, torch.randn(4, 4))
    assert not any(chunk.loaded for chunk in off.chunks.values())
    with off.backward((3, 0)):
        assert off.chunks[(1, 0)].loaded and not off.chunks[(0, 0)].loaded
        outs[3].sum().backward()
    for layer in (2, 1, 0):
        with off.backward((layer, 0)):
            outs[layer].sum().backward()
    assert not off.chunks


def test_offloaded_layers_are_the_first_share_of_a_workers_layers():
    assert offloaded_layers([0, 1, 2, 3], 0.0) == frozenset()
    assert offloaded_layers([3, 1, 0, 2], 0.5) == {0, 1}
    assert offloaded_layers([1, 3, 5], 0.05) == {1}  # at least the share asked for
    assert offloaded_layers([1, 3, 5], 1.0) == {1, 3, 5}
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        offloaded_layers([0], 1.5)


@pytest.mark.parametrize(
    ("offload", "message"),
    [
        ({"attention": 1.5}, "offload.attention.*in \\[0, 1\\].*1.5"),
        ({"ffn": -0.1}, "offload.ffn.*in \\[0, 1\\]"),
        ({"ffn": float("nan")}, "offload.ffn.*in \\[0, 1\\]"),
        ({"attention": True}, "offload.attention.*in \\[0, 1\\]"),
        ({"attention": "half"}, "offload.attention.*in \\[0, 1\\]"),
        ({"experts": 0.5}, "unknown key.*offload.*experts.*known: attention, ffn"),
        (0.5, "offload.*must be an object"),
    ],
)
def test_bad_offload_config_is_refused(offload, message):
    with pytest.raises(ConfigError, match=message):
        DisagMoEConfig.from_ds_config({"disagmoe": {"offload": offload}})


def test_offload_config_and_verify_flag():
    cfg = DisagMoEConfig.from_ds_config({"disagmoe": {"offload": {"attention": 1, "ffn": 0.25}}})
    assert (cfg.offload_share("attention"), cfg.offload_share("ffn")) == (1.0, 0.25)
    assert DisagMoEConfig().offload_share("ffn") == 0.0
    args = parse_args(["--offload", "0.5", "1"])
    assert args.cfg.offload == {"attention": 0.5, "ffn": 1.0}
    assert args.ds_config()["disagmoe"]["offload"] == {"attention": 0.5, "ffn": 1.0}


def _checking_offload(monkeypatch, shares: tuple[float, float]) -> None:
    """Make every rank check, after each step, that its chunks' saved tensors went to host memory and all came back,
    and that the layers offloaded are the configured share of its own."""
    from disagmoe_ds.afpipe import build

    original = build.build_rank

    def build_and_check(*args, **kwargs):
        runtime = original(*args, **kwargs)
        executor, role = runtime.executor, runtime.role
        off = executor.offloader
        share = shares[0] if role.is_attention else shares[1]
        layers = [int(layer) for layer in runtime.module.layers]
        assert off is not None and off.layers == offloaded_layers(layers, share), (layers, off)
        train_batch = executor.train_batch

        def checked(*a, **kw):
            before = off.tensors_out
            result = train_batch(*a, **kw)
            assert off.tensors_out > before, "no saved tensor went to host memory"
            assert not off.chunks and off.host_bytes == 0, "the step left offloaded chunks behind"
            return result

        executor.train_batch = checked
        return runtime

    monkeypatch.setattr(build, "build_rank", build_and_check)


@pytest.mark.parametrize(
    ("family", "M", "N", "p", "shares", "checkpointing"),
    [
        ("qwen3-moe", 1, 2, 1, (1.0, 1.0), False),  # everything, with prefetch across micro-batches
        ("qwen2-moe", 2, 2, 2, (0.5, 0.5), True),  # a share, depth 2, with activation checkpointing
    ],
)
def test_offload_equals_hf(tiny_checkpoint, monkeypatch, family, M, N, p, shares, checkpointing):
    _checking_offload(monkeypatch, shares)
    cfg = DisagMoEConfig(
        attention_gpus=M,
        ffn_gpus=N,
        depth=p,
        micro_batches=3,
        transport="rendezvous",
        activation_checkpointing=checkpointing,
        offload={"attention": shares[0], "ffn": shares[1]},
    )
    args = VerifyArgs(str(tiny_checkpoint(family)), cfg, zero=1, seq_len=8, clip=0.05)
    summary = run_verify(args, timeout_s=240)
    assert summary["pass"], summary


def test_colocated_mode_warns_that_it_ignores_afpipes_levers_and_runs_the_recompute():
    import warnings
    from pathlib import Path

    from disagmoe_ds.train.flags import read_command_line
    from disagmoe_ds.train.settings import mode_config

    ns = read_command_line(["--mode", "colocated"], root=Path("."), description="")
    with pytest.warns(UserWarning, match='"disagmoe.offload" is ignored in co-located mode'):
        mode_config(ns, "colocated", {"disagmoe": {"offload": {"attention": 0.5}}}, None)
    levers = {"resend": True, "split_backward": True}
    with pytest.warns(UserWarning, match='"disagmoe.resend", "disagmoe.split_backward" are ignored'):
        mode_config(ns, "colocated", {"disagmoe": levers}, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # what co-located uses: no warning
        cfg = mode_config(ns, "colocated", {"disagmoe": {"compile": True, "selective_recompute": True}}, None)
    assert cfg.recompute_of("attention") == cfg.recompute_of("ffn") == "selective"
