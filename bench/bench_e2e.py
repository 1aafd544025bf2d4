"""End-to-end training throughput: AF-Pipe versus the co-located EP baseline versus DeepSpeed-MoE.

    # 8 GPUs of one host, 4 layers of Qwen3-30B-A3B, 32 sequences of 4K per step (AF-Pipe: 4 attention + 4 FFN)
    PYTHONPATH=$PWD python bench/bench_e2e.py --model hf_models/Qwen3-30B-A3B --layers 4 --world-size 8 \\
        --seq-len 4096 --global-batch 32 --json e2e.json
    # one GPU: the co-located mode beside DeepSpeed's AutoEP, real-size layers (torchrun: a forked NCCL rank of a
    # one-GPU local job could not initialise CUDA on that machine)
    PYTHONPATH=$PWD torchrun --nproc_per_node 1 bench/bench_e2e.py --model hf_models/Qwen3-30B-A3B --layers 4 \
        --world-size 1 --methods colocated autoep autoep-fused --compile
    # CPU, gloo, a tiny model (what the tests run)
    PYTHONPATH=$PWD python bench/bench_e2e.py --device cpu --model hf_models/tiny-qwen3-moe --world-size 2 \\
        --seq-len 16 --global-batch 4 --warmup 1 --steps 2

Every method trains the same model config (random weights, seed ``--seed``) on the same ranks and the same number
of tokens per optimizer step (``--global-batch`` sequences of ``--seq-len``), with the same ds_config (ZeRO stage,
bf16 on GPU, AdamW, clipping). Each method's micro-batches per rank follow from its number of data-parallel lanes:

    afpipe         ``afpipe.build.build_rank`` + ``AFPipeExecutor.train_batch``: M attention + N FFN ranks, depth p
    colocated      ``colocated.build_colocated_rank``: every rank attention + 1/ep of the experts, all-to-all, 1F1B
    pipeline       the same in ``--pp-size`` stages of ``--virtual-stages`` chunks (1F1B or interleaved), EP inside
                   a stage (the ``--ep-size`` values that divide a stage's ranks, else all of them)
    autoep         the HF model under DeepSpeed's own AutoEP (``"expert_parallel": {"enabled": true,
                   "autoep_size": EP, "preset_model": <model_type>}``: ``deepspeed.initialize`` swaps every MoE block
                   for its grouped-GEMM layer with HF's routing), each decoder layer compiled with ``--compile``: what
                   a DeepSpeed user would run instead of us. Its loss is the LM loss alone (AutoEP has no aux loss)
    autoep-fused   autoep with its opt-in kernels (CUDA only): ``"gate_up_impl": "fused"`` (the gate and up
                   projections as one grouped GEMM) and ``"combine_impl": "fused_weighted_sum"`` (Triton's weighted
                   restore of the routed rows); slower than the defaults on an H100 (performance-log section 32)
    deepspeed-moe  the HF model with every MoE block's router and experts replaced by ``deepspeed.moe.layer.MoE``
                   (DeepSpeed's ``TopKGate`` + ``Experts`` of HF-sized gated MLPs), the shared experts kept, trained
                   by the co-located executor (same step, same clipping)

DeepSpeed-MoE routes differently from HF: softmax over all experts, top-k, always renormalised over the kept
experts, its own GShard aux loss (coefficient ``router_aux_loss_coef``), and a capacity: ``--ds-capacity-factor 0``
(default) drops no token (capacity = the largest expert load in the EP group, padded dispatch buffers);
a positive factor drops tokens beyond ``factor * k * tokens / experts``. Its experts are a Python loop over
``nn.Linear`` MLPs. The FLOPs per token are the same as HF's unless tokens are dropped.

Step time = the slowest rank's wall time of one ``train_batch`` (device synchronised), median over ``--steps``
after ``--warmup``; tokens/s = tokens per step / step time; MFU = tokens/s x model FLOPs per token (Megatron's
convention: active experts, causal attention, 3x forward; ``planner.model``) / (ranks x 989 TFLOP/s). Each method
runs as its own local job (fresh processes, NCCL on GPUs, gloo on CPU); under ``torchrun``/``deepspeed`` the
methods run one after another in the launched processes. Prints a table and writes ``--json``; for AF-Pipe also
what its exchanges cost the hosts in the last step (communicator calls per send and per receive, waits for sizes
inside the step: ``Mailbox.stats``).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import gc
import json
import os
import statistics
import sys
import time
import traceback
import warnings
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from disagmoe_ds.afpipe.build import build_rank
from disagmoe_ds.colocated import ColocatedConfig, build_colocated_rank
from disagmoe_ds.colocated.executor import ColocatedExecutor, ColocatedGradNorm
from disagmoe_ds.colocated.model import ColocatedOutput
from disagmoe_ds.config import LEVER_KEYS, SECTION, DisagMoEConfig, add_section_flags, section_values
from disagmoe_ds.models.attention_kernel import use_attention
from disagmoe_ds.models.families import Family, family_of, is_moe_layer
from disagmoe_ds.models.grouped_experts import GATED_FUSED_FAMILIES
from disagmoe_ds.models.loading import load_config
from disagmoe_ds.models.lora_settings import add_lora_args, lora_of
from disagmoe_ds.planner.model import ModelSpec
from disagmoe_ds.planner.runtime_costs import job_costs
from disagmoe_ds.runtime.deepspeed_role import RoleMPU, role_ds_config
from disagmoe_ds.runtime.timeline import start_clock, write_job_timeline

METHODS = ("afpipe", "colocated", "pipeline", "autoep", "autoep-fused", "deepspeed-moe")
# The section keys bench_e2e.py takes as flags (config.SECTION_FLAGS): AF-Pipe's layout, compile and memory levers.
BENCH_KEYS = (
    "attention_gpus",
    "ffn_gpus",
    "depth",
    "node_dedup",
    "sequence_parallel",
    "tensor_parallel",
    "compile",
    "attention",
    *LEVER_KEYS,
)
EP_METHODS = ("colocated", "pipeline", "autoep", "autoep-fused", "deepspeed-moe")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
PEAK_FLOPS = 989e12  # dense bf16 of an H100/H200-class GPU (MFU's denominator, also on CPU runs)


# ----------------------------------------------------------------------------------------------------------------
# The DeepSpeed-MoE baseline model
# ----------------------------------------------------------------------------------------------------------------


class GatedMLP(nn.Module):
    """One expert for ``deepspeed.moe``: HF's gated MLP math, ``down(act(gate(x)) * up(x))``."""

    def __init__(self, hidden: int, intermediate: int, act_fn: nn.Module):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act_fn = act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DeepSpeedMoEBlock(nn.Module):
    """An HF MoE block whose router and routed experts are one ``deepspeed.moe.layer.MoE``; shared experts kept."""

    def __init__(self, block: nn.Module, family: Family, *, ep_size: int, capacity_factor: float):
        from deepspeed.moe.layer import MoE

        super().__init__()
        experts, router = block.experts, getattr(block, family.router_attr)
        _, hidden, intermediate = experts.down_proj.shape  # HF's fused [E, H, I]
        expert = GatedMLP(hidden, intermediate, experts.act_fn).to(experts.down_proj.device, experts.down_proj.dtype)
        self.moe = MoE(
            hidden,
            expert,
            num_experts=router.num_experts,
            ep_size=ep_size,
            k=router.top_k,
            capacity_factor=capacity_factor or 1.0,
            eval_capacity_factor=capacity_factor or 1.0,
            drop_tokens=capacity_factor > 0,
            use_rts=False,
        )
        self.shared_fn = family.shared
        self.shared = _shared_part(block, family) if family.shared is not None else None
        self.l_aux: torch.Tensor | None = None

    def forward(self, h_BSH: torch.Tensor) -> torch.Tensor:
        out_BSH, self.l_aux, _ = self.moe(h_BSH)
        if self.shared is not None:
            out_BSH = out_BSH + self.shared_fn(self.shared, h_BSH.reshape(-1, h_BSH.shape[-1])).view_as(h_BSH)
        return out_BSH


def _shared_part(block: nn.Module, family: Family) -> nn.Module:
    """A shallow copy of the block without its router and routed experts (what the shared-expert function reads)."""
    shared = copy.copy(block)
    drop = ("experts", family.router_attr)
    shared._modules = OrderedDict((n, m) for n, m in block._modules.items() if n not in drop)
    return shared


class DeepSpeedMoEModel(nn.Module):
    """The HF causal LM with DeepSpeed-MoE blocks; forward returns the co-located executor's ``ColocatedOutput``."""

    def __init__(self, model: nn.Module, *, ep_size: int, capacity_factor: float):
        super().__init__()
        family = family_of(model.config)
        if family.model_type not in GATED_FUSED_FAMILIES:
            raise ValueError(f"the DeepSpeed-MoE baseline supports {GATED_FUSED_FAMILIES}, not {family.model_type}")
        self.blocks = []  # plain list: the blocks are registered once, inside the model
        for layer in model.model.layers:
            if is_moe_layer(layer):
                layer.mlp = DeepSpeedMoEBlock(layer.mlp, family, ep_size=ep_size, capacity_factor=capacity_factor)
                self.blocks.append(layer.mlp)
        model.config.output_router_logits = False  # HF's aux loss reads its routers' logits; DeepSpeed's replaces it
        self.aux_coef = getattr(model.config, "router_aux_loss_coef", 0.0)
        self.model = model

    def forward(self, input_ids, labels, position_ids=None) -> ColocatedOutput:
        lm_loss = self.model(input_ids=input_ids, labels=labels, position_ids=position_ids, use_cache=False).loss
        aux = torch.stack([block.l_aux for block in self.blocks]).sum()
        return ColocatedOutput(lm_loss + self.aux_coef * aux, lm_loss, aux)


class HFCausalLM(nn.Module):
    """The HF causal LM as the co-located executor calls it (``ColocatedOutput``: its loss, with no aux term)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        model.config.output_router_logits = False
        self.model = model
        self.config = model.config  # what AutoEP reads (top-k, expert counts)

    def forward(self, input_ids, labels, position_ids=None) -> ColocatedOutput:
        loss = self.model(input_ids=input_ids, labels=labels, position_ids=position_ids, use_cache=False).loss
        return ColocatedOutput(loss, loss, None)


def _autoep_on_this_transformers() -> None:
    """DeepSpeed 0.19.8's AutoEP reads transformers' output-recorder registry with ``registry.get(key, default)``;
    transformers 5.2x's registry (``output_capturing._CanRecordRegistry``) takes the model alone, so AutoEP's set-up
    fails with a TypeError there. Benchmark-only shim: the same registry object also answers the two-argument call."""
    try:
        from transformers.utils import output_capturing
    except ImportError:
        return
    registry = output_capturing._CAN_RECORD_REGISTRY
    base = type(registry)
    if base.get is dict.get or getattr(base, "takes_defaults", False):
        return

    class Registry(base):
        takes_defaults = True

        def get(self, key, default=None):
            return dict.get(self, key, default) if isinstance(key, str) else base.get(self, key)

    registry.__class__ = Registry


# ----------------------------------------------------------------------------------------------------------------
# One method on one rank
# ----------------------------------------------------------------------------------------------------------------


def bench_config(a: argparse.Namespace):
    """The benchmark model's HF config: ``--model``'s, cut to ``--layers``."""
    config = load_config(a.model)
    if a.layers:
        truncate_layers(config, a.layers)
    return config


def make_model(a: argparse.Namespace, device: torch.device) -> nn.Module:
    """The benchmark model (``--layers`` of ``--model``), random weights under ``--seed``, built on the device, with
    the attention function ``--attention`` picks (every method runs the same one)."""
    from transformers import AutoModelForCausalLM

    config = bench_config(a)
    torch.manual_seed(a.seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[a.dtype])
    use_attention(model, a.attention, device)
    return model.train()


def flops_per_token(a: argparse.Namespace) -> float:
    """Model FLOPs of training one token (Megatron's convention: active experts, causal attention, 3x forward)."""
    return ModelSpec.from_config(bench_config(a).to_dict()).step_flops_per_token(a.seq_len)


def truncate_layers(config, layers: int) -> None:
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    if getattr(config, "mlp_only_layers", None):
        config.mlp_only_layers = [i for i in config.mlp_only_layers if i < layers]


def ds_config(a: argparse.Namespace) -> dict[str, Any]:
    config: dict[str, Any] = {
        "zero_optimization": {"stage": a.zero},
        "gradient_clipping": a.clip,
        # torch's AdamW, fused on GPU (one kernel per step, as fast as DeepSpeed's FusedAdam, which would JIT-compile
        # first); the same optimizer for every method
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": a.lr, "weight_decay": 0.0, "torch_adam": True, "fused": a.device == "cuda"},
        },
    }
    if a.dtype == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def micro_batches(a: argparse.Namespace, lanes: int) -> int:
    per_step = lanes * a.micro_batch_size
    if a.global_batch % per_step:
        raise ValueError(
            f"--global-batch ({a.global_batch}) must be a multiple of lanes ({lanes}) x --micro-batch-size "
            f"({a.micro_batch_size}) so that every method trains the same tokens per step"
        )
    return a.global_batch // per_step


def build_afpipe(a: argparse.Namespace, device: torch.device):
    cfg = DisagMoEConfig(
        **section_values(a, BENCH_KEYS),
        # SP or TP lanes: s (t) of them train one micro-batch in slices
        micro_batches=micro_batches(a, a.attention_gpus // a.depth // (a.sequence_parallel * a.tensor_parallel)),
        lora=lora_of(a, verify=False),
    )
    ds = {**ds_config(a), SECTION: cfg.to_dict()}
    dtype = DTYPES[a.dtype]
    model = make_model(a, device)
    # The schedule's task costs, as a training job's plan computes them before its ranks start.
    layout = build_rank.preflight(model.config, cfg, ds, dist.get_world_size())
    costs = job_costs(model.config.to_dict(), layout, cfg, seq_len=a.seq_len, micro_batch_size=a.micro_batch_size)
    runtime = build_rank(
        a.model,
        ds,
        cfg,
        micro_batch_size=a.micro_batch_size,
        dtype=dtype,
        device=device,
        model=model,
        seq_len=a.seq_len,
        layout=layout,
        schedule_costs=costs,
    )
    if a.compile or a.cuda_graphs:  # every compiled kernel loaded, every graph captured before the first exchange
        runtime.executor.warm_up(a.seq_len)
    feeds = runtime.role.is_attention and runtime.role.group == 0  # A-group 0 embeds; the head reads labels there
    return runtime.executor, cfg.micro_batches if feeds else 0, runtime.layout.describe()


def build_colocated(a: argparse.Namespace, device: torch.device, *, pp_size: int = 1, virtual_stages: int = 1):
    cfg = ColocatedConfig(
        world_size=a.world_size,
        ep_size=a.ep_size,
        pp_size=pp_size,
        virtual_stages=virtual_stages,
        sequence_parallel=a.sequence_parallel,
        tensor_parallel=a.tensor_parallel,
        micro_batches=micro_batches(a, a.world_size // pp_size // (a.sequence_parallel * a.tensor_parallel)),
        compile=a.compile,
        cuda_graphs=a.cuda_graphs,
        fp8=a.fp8,
        fp8_cast_per_call=a.fp8_cast_per_call,
        attention=a.attention,
        lora=lora_of(a, verify=False),
    )
    runtime = build_colocated_rank(
        a.model,
        ds_config(a),
        cfg,
        micro_batch_size=a.micro_batch_size,
        dtype=DTYPES[a.dtype],
        device=device,
        model=make_model(a, device),
    )
    if a.cuda_graphs:
        runtime.executor.warm_up(a.seq_len)
    return runtime.executor, cfg.micro_batches, runtime.layout.describe()


def build_deepspeed_moe(a: argparse.Namespace, device: torch.device):

    cfg = ColocatedConfig(world_size=a.world_size, ep_size=a.ep_size, micro_batches=micro_batches(a, a.world_size))
    module = DeepSpeedMoEModel(make_model(a, device), ep_size=a.ep_size, capacity_factor=a.ds_capacity_factor)
    config = role_ds_config(
        ds_config(a), micro_batches=cfg.micro_batches, micro_batch_size=a.micro_batch_size, dp_size=a.world_size
    )
    executor = _hf_executor(a, module, config, cfg.micro_batches, "deepspeed-moe")
    experts = module.blocks[0].moe.num_experts
    return executor, cfg.micro_batches, f"DeepSpeed-MoE: {a.world_size} ranks, EP {a.ep_size}, {experts} experts"


def _hf_executor(
    a: argparse.Namespace, module: nn.Module, config: dict[str, Any], micro_batches: int, name: str
) -> ColocatedExecutor:
    """A DeepSpeed engine over an HF-based baseline ``module``, trained by the co-located executor (its step, its
    clipping over replicated attention and sliced expert parameters)."""
    import deepspeed

    params = [p for p in module.parameters() if p.requires_grad]
    # An explicit mpu, so that an earlier engine's mpu left in deepspeed.utils.groups (launcher runs) is replaced.
    everyone = dist.new_group(list(range(a.world_size)))
    engine, *_ = deepspeed.initialize(model=module, model_parameters=params, config=config, mpu=RoleMPU(everyone))
    grad_norm = ColocatedGradNorm(everyone, attention_replicas=a.world_size, expert_replicas=a.world_size // a.ep_size)
    grad_norm.install(engine)
    return ColocatedExecutor(
        engine=engine,
        num_micro_batches=micro_batches,
        grad_norm=grad_norm,
        group=everyone,
        name=f"rank {dist.get_rank()} {name}",
    )


def _has_autoep_preset(model_dir: str) -> bool:
    from deepspeed.module_inject.auto_ep_config import PRESET_MODELS

    return load_config(model_dir).model_type in PRESET_MODELS


def build_autoep(a: argparse.Namespace, device: torch.device, fused: bool = False):

    _autoep_on_this_transformers()
    cfg = ColocatedConfig(world_size=a.world_size, ep_size=a.ep_size, micro_batches=micro_batches(a, a.world_size))
    module = HFCausalLM(make_model(a, device))
    config = role_ds_config(
        ds_config(a), micro_batches=cfg.micro_batches, micro_batch_size=a.micro_batch_size, dp_size=a.world_size
    )
    preset = module.model.config.model_type
    config["expert_parallel"] = {
        "enabled": True,
        "autoep_size": a.ep_size,
        "preset_model": preset,
        "moe_layer_pattern": r"model\.model\.layers\.\d+\.mlp",  # the preset's, under ``HFCausalLM.model``
    }
    if fused:  # DeepSpeed 0.19.8's faster opt-in kernels; the Triton combine refuses anything but CUDA
        config["expert_parallel"] |= {"gate_up_impl": "fused", "combine_impl": "fused_weighted_sum"}
    executor = _hf_executor(a, module, config, cfg.micro_batches, "autoep")
    if a.compile:  # every decoder layer, AutoEP's MoE layers inside them
        for layer in module.model.model.layers:
            layer.compile()
    replaced = sum(type(layer.mlp).__name__ == "AutoEPMoELayer" for layer in module.model.model.layers)
    return (
        executor,
        cfg.micro_batches,
        f"AutoEP ({preset}{', fused kernels' if fused else ''}): {a.world_size} ranks, EP {a.ep_size}, "
        f"{replaced} MoE layers",
    )


BUILDERS: dict[str, Callable[[argparse.Namespace, torch.device], tuple[Any, int, str]]] = {
    "afpipe": build_afpipe,
    "colocated": build_colocated,
    "pipeline": lambda a, device: build_colocated(a, device, pp_size=a.pp_size, virtual_stages=a.virtual_stages),
    "autoep": build_autoep,
    "autoep-fused": lambda a, device: build_autoep(a, device, fused=True),
    "deepspeed-moe": build_deepspeed_moe,
}


def run_method(rank: int, method: str, a: argparse.Namespace) -> dict[str, Any] | None:
    """Build ``method`` on this rank, train ``warmup + steps`` steps; the row on rank 0, None elsewhere."""
    del rank
    label = f"{method}-ep{a.ep_size}" if method in EP_METHODS else method
    device = torch.device("cuda", torch.cuda.current_device()) if a.device == "cuda" else torch.device("cpu")
    executor, num_micro_batches, layout = BUILDERS[method](a, device)
    batches = make_batches(a, load_config(a.model).vocab_size, num_micro_batches, device) or None
    times, result, breakdown, exchanged = [], None, {}, None
    mailbox = getattr(executor, "mailbox", None)  # AF-Pipe ranks: their exchange costs in the last step
    for step in range(a.warmup + a.steps):
        last = step == a.warmup + a.steps - 1
        executor.record_timeline(bool(a.timeline) and last)
        exchanged = mailbox.stats() if mailbox is not None and last else exchanged
        _sync(device)
        with (
            _profiled(a.torch_profile if last else None) as profiled,
            _syncs_traced(a.trace_syncs if last else None, label),
        ):
            t0 = start_clock()
            result = executor.train_batch(batches)
            _sync(device)
            wall_s = time.perf_counter() - t0
        if profiled is not None:
            _write_profile(profiled, a.torch_profile, label, wall_s)
        seconds = _max_over_ranks(wall_s, device)
        if step >= a.warmup:
            times.append(seconds)
        if a.timeline and last:
            breakdown = _host_breakdown(executor.timeline, seconds)
            write_job_timeline(executor.timeline, t0, _timeline_path(a.timeline, label))
    step_s = statistics.median(times)
    tokens = a.global_batch * a.seq_len
    memory = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    row = {
        "method": label,
        "layout": layout,
        "micro_batches": num_micro_batches,
        "tokens_per_step": tokens,
        "step_ms": step_s * 1e3,
        "tokens_per_s": tokens / step_s,
        "mfu": tokens / step_s * flops_per_token(a) / (a.world_size * PEAK_FLOPS),
        "loss": result.loss,
        "max_memory_gib": _max_over_ranks(memory, device),
    }
    if a.timeline:  # collective
        row["host_time_share"] = _gather_breakdown(executor.name, breakdown)
    if mailbox is not None:  # collective
        row["exchange"] = _gather_exchange(mailbox.stats(), exchanged)
    executor.engine.destroy()  # its ZeRO gradient hooks keep the model and optimizer alive past this method otherwise
    return row if dist.get_rank() == 0 else None


def _gather_exchange(now, before) -> dict[str, float]:
    """The last step's exchange costs over all ranks: the most communicator calls per send and per receive on any
    rank, and the messages and the waits for sizes inside the step (summed)."""
    per_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, now.since(before))
    return {
        "calls_per_send": max(s.calls_per_send for s in per_rank),
        "calls_per_receive": max(s.calls_per_receive for s in per_rank),
        "messages": sum(s.sends for s in per_rank),
        "size_waits": sum(s.size_waits for s in per_rank),
    }


@contextlib.contextmanager
def _profiled(directory: str | None):
    """``torch.profiler`` over the block (CPU and CUDA activity) when ``directory`` is set, else nothing."""
    if directory is None:
        yield None
        return
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        yield prof


@contextlib.contextmanager
def _syncs_traced(directory: str | None, label: str):
    """Count where the block makes the host wait for the device (``torch.cuda.set_sync_debug_mode``): per rank,
    DIR/METHOD-syncs-rankR.txt lists each synchronising call site (its innermost frames) with its count."""
    if directory is None or not torch.cuda.is_available():
        yield
        return
    sites: collections.Counter[str] = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" in str(message):
            frames = traceback.extract_stack()[:-2][-6:]
            sites[" <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames))] += 1

    previous = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = previous
    path = Path(directory) / f"{label}-syncs-rank{dist.get_rank()}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{count:5d}  {site}\n" for site, count in sites.most_common()))


def _write_profile(prof, directory: str, label: str, wall_s: float) -> None:
    """This rank's last step: the top operators by host time, then by device time (communication kernels spin
    while they wait for a peer, so their device time is waiting, not work)."""
    events = prof.key_averages()
    path = Path(directory) / f"{label}-rank{dist.get_rank()}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        f.write(f"step {wall_s * 1e3:.1f} ms\n\n")
        f.write(events.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=60) + "\n")
        if torch.cuda.is_available():
            f.write(events.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=60))


def _host_breakdown(events, step_s: float) -> dict[str, float]:
    """This rank's share of the step spent in each timeline category (compute, wait, send, optimizer...)."""
    share: dict[str, float] = {}
    for event in events:
        share[event.category] = share.get(event.category, 0.0) + (event.end_s - event.start_s) / step_s
    return share


def _gather_breakdown(name: str, share: dict[str, float]) -> dict[str, dict[str, float]] | None:
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object((name, share), gathered, dst=0)
    return dict(gathered) if gathered is not None else None


def _timeline_path(path: str, method: str) -> Path:
    base = Path(path)
    return base.with_name(f"{base.stem}-{method}{base.suffix or '.json'}")


def make_batches(a: argparse.Namespace, vocab: int, count: int, device: torch.device) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(a.seed * 1009 + dist.get_rank())
    batches = []
    for _ in range(count):
        ids = torch.randint(3, vocab, (a.micro_batch_size, a.seq_len), generator=gen).to(device)
        batches.append({"input_ids": ids, "labels": ids.clone()})
    return batches


def _max_over_ranks(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------------------------------------------


def print_table(rows: list[dict[str, Any]]) -> None:
    """One row per run; the ratio is against the fastest co-located run (the strongest baseline here)."""
    colocated = [r["tokens_per_s"] for r in rows if r["method"].startswith("colocated")]
    base = max(colocated, default=None)
    header = f"{'method':<18}{'micro-batches':>14}{'tokens/step':>13}{'step ms':>11}{'tokens/s':>12}{'MFU':>7}"
    print(f"{header}{'vs best colocated':>19}")
    for r in rows:
        ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
        print(
            f"{r['method']:<18}{r['micro_batches']:>14}{r['tokens_per_step']:>13}{r['step_ms']:>11.1f}"
            f"{r['tokens_per_s']:>12.0f}{r['mfu']:>7.1%}{ratio:>19}"
        )
    for r in rows:
        print(f"  {r['method']}: {r['layout']}, loss {r['loss']:.4f}, max memory {r['max_memory_gib']:.1f} GiB")
        if r.get("exchange"):
            x = r["exchange"]
            print(
                f"    exchange, last step: {x['messages']} messages, at most {x['calls_per_send']:.2f} communicator "
                f"calls per send and {x['calls_per_receive']:.2f} per receive on a rank, {x['size_waits']} waits "
                "for sizes inside the step"
            )
        for name, share in (r.get("host_time_share") or {}).items():
            parts = ", ".join(f"{category} {fraction:.0%}" for category, fraction in sorted(share.items()))
            print(f"    {name}: {parts} of the last step (host time)")


def build_parser(gpus: int) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model",
        default="hf_models/Qwen3-30B-A3B-balanced",
        help="HF model directory (config is enough); the default has Qwen3-30B-A3B's layers, 8 of them and a 16K "
        "vocabulary, so that its attention side (head included) and its expert side cost about the same",
    )
    p.add_argument("--layers", type=int, default=0, help="decoder layers to keep (0: all)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if gpus else "cpu")
    p.add_argument("--world-size", type=int, default=max(gpus, 1) if gpus else 2, help="ranks (GPUs)")
    p.add_argument("--methods", nargs="+", choices=METHODS, help="default: all; colocated alone on one rank")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--micro-batch-size", type=int, default=1, help="sequences per micro-batch")
    p.add_argument("--global-batch", type=int, default=None, help="sequences per step (default: 2 per rank)")
    p.add_argument(
        "--ep-size",
        type=int,
        nargs="+",
        default=None,
        help="co-located and DeepSpeed-MoE EP sizes, each run side by side (default: all ranks); e.g. "
        "--ep-size 2 1 runs EP-2 and EP-1 (every rank holds every expert: plain data parallel)",
    )
    add_section_flags(p, BENCH_KEYS, cli="bench")  # AF-Pipe's layout, --compile and levers (config.SECTION_FLAGS)
    p.add_argument(
        "--pp-size", type=int, default=2, help="the pipeline method's stages (co-located, EP inside a stage)"
    )
    p.add_argument("--virtual-stages", type=int, default=1, help="the pipeline method's chunks per stage")
    p.add_argument("--ds-capacity-factor", type=float, default=0.0, help="DeepSpeed-MoE capacity (0: drop none)")
    p.add_argument("--zero", type=int, default=1, choices=(0, 1, 2))
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default bf16 on GPU, fp32 on CPU")
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds before a local job is killed")
    p.add_argument("--json", metavar="PATH", help="also write the rows and the setup as JSON")
    add_lora_args(p, verify=False)  # afpipe and colocated: adapters on both sides, every base weight frozen
    p.add_argument(
        "--trace-syncs",
        metavar="DIR",
        help="GPU: list where the last step of each method makes the host wait for the device (per rank, "
        "DIR/METHOD-syncs-rankR.txt: call sites and counts)",
    )
    p.add_argument(
        "--torch-profile",
        metavar="DIR",
        help="profile the last step of each method with torch.profiler; per rank, DIR/METHOD-rankR.txt has the "
        "top operators by host and by device time",
    )
    p.add_argument(
        "--timeline",
        metavar="PATH",
        help="write the last step of each method as a Chrome/Perfetto trace (PATH with -METHOD before the suffix) "
        "and print each rank's share of the step per category (compute, wait, send, optimizer)",
    )
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # probe GPUs without initialising CUDA (fork)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    p = build_parser(gpus)
    a = p.parse_args(argv)
    a.dtype = a.dtype or ("bf16" if a.device == "cuda" else "fp32")
    a.global_batch = a.global_batch or 2 * a.world_size * a.micro_batch_size
    a.ep_sizes = a.ep_size or [a.world_size]
    a.ep_size = a.ep_sizes[0]
    a.attention_gpus = a.attention_gpus or max(a.world_size // 2, 1)
    a.ffn_gpus = a.ffn_gpus or a.world_size - a.attention_gpus
    if not a.methods and a.world_size == 1:
        a.methods = ["colocated"]
    elif not a.methods:  # all but autoep-fused (CUDA only), AutoEP where DeepSpeed has a preset for the model
        a.methods = [m for m in METHODS if m != "autoep-fused" and (m != "autoep" or _has_autoep_preset(a.model))]
    if "afpipe" in a.methods and a.attention_gpus + a.ffn_gpus != a.world_size:
        p.error(
            f"AF-Pipe needs attention + FFN ranks = world size ({a.attention_gpus} + {a.ffn_gpus} != {a.world_size})"
        )
    return a


def runs(a: argparse.Namespace) -> list[tuple[str, argparse.Namespace]]:
    """(method, its arguments) in run order: the EP methods once per ``--ep-size``."""
    out = []
    for method in a.methods:
        eps = a.ep_sizes if method in EP_METHODS else [a.ep_size]
        if method == "pipeline":  # EP inside a stage: the sizes that fit one, else the whole stage
            stage = a.world_size // a.pp_size
            eps = [ep for ep in eps if stage % ep == 0] or [stage]
        for ep in eps:
            out.append((method, argparse.Namespace(**{**vars(a), "ep_size": ep})))
    return out


def main(argv: list[str] | None = None) -> int:
    from disagmoe_ds.launch import detect_launcher, init_from_env, spawn_local

    a = parse_args(argv)
    backend = "nccl" if a.device == "cuda" else "gloo"
    rows = []
    if detect_launcher():
        init_from_env(backend)
        for method, run in runs(a):
            rows.append(run_method(dist.get_rank(), method, run))
            gc.collect()  # drop the engine before the next method builds its own
            if a.device == "cuda":
                torch.cuda.empty_cache()
        if dist.get_rank() != 0:
            return 0
    else:
        for method, run in runs(a):  # one local job per method: fresh processes, nothing left from the last one
            rows.append(
                spawn_local(run_method, a.world_size, args=(method, run), backend=backend, timeout_s=a.timeout)[0]
            )
            print(f"{rows[-1]['method']}: {rows[-1]['tokens_per_s']:.0f} tokens/s", flush=True)
    print_table(rows)
    if a.json:
        Path(a.json).write_text(json.dumps({"setup": vars(a), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
