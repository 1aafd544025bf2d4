"""The schedule's task costs for a job the runtime builds: the same per-task seconds the planner simulates.

They come from the job's inputs alone (model config, layout, sequence length, cluster, profile): the job's preflight
computes them (``job_costs``) before any rank starts and every rank generates its schedule from them, so all workers
run the same schedule without communicating, and a resumed job gets the same order again.

>>> from disagmoe_ds.layout import Layout
>>> config = {"model_type": "mixtral", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
...           "num_key_value_heads": 2, "intermediate_size": 128, "num_local_experts": 4,
...           "num_experts_per_tok": 2, "vocab_size": 256}
>>> layout = Layout(attention_gpus=1, ffn_gpus=1, num_layers=2, num_experts=4)
>>> costs = runtime_costs(config, layout, seq_len=128, micro_batch_size=1)
>>> costs.a_bwd > costs.a_fwd > 0 and costs.f_bwd > costs.f_fwd > 0 and costs.m2n > 0
True
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Protocol

from disagmoe_ds.errors import ConfigError
from disagmoe_ds.fp8.shapes import BF16_WIDTH, EXPERT_BF16_WIDTH
from disagmoe_ds.layout import Layout
from disagmoe_ds.models.lora_settings import GROUPS, LoraSettings
from disagmoe_ds.planner.cluster import PRESETS, Cluster, Efficiency, Fleet, Rates, load_cluster
from disagmoe_ds.planner.lora import FULL, LoRA
from disagmoe_ds.planner.model import ModelSpec
from disagmoe_ds.planner.placement import Placement
from disagmoe_ds.planner.profile_fit import load_profile, rates_from_profile
from disagmoe_ds.planner.simulate import schedule_costs
from disagmoe_ds.planner.task_costs import AfTaskCosts, af_task_costs
from disagmoe_ds.planner.workload import Workload
from disagmoe_ds.schedule import Costs, unit_costs

GPUS_PER_PRESET_NODE = 8


class CostedSettings(Protocol):
    """What of a job's settings its schedule's task costs depend on (``config.DisagMoEConfig`` has them all)."""

    @property
    def cluster(self) -> str: ...
    @property
    def ffn_cluster(self) -> str | None: ...
    @property
    def profile(self) -> str | None: ...
    @property
    def resend(self) -> bool: ...
    @property
    def split_backward(self) -> bool: ...
    @property
    def compile(self) -> bool: ...
    @property
    def experts_sharded(self) -> bool: ...
    @property
    def lora(self) -> LoraSettings | None: ...
    @property
    def fp8(self) -> bool: ...
    @property
    def fp8_cast_per_call(self) -> bool: ...
    @property
    def fp8_bf16_width(self) -> int: ...
    @property
    def fp8_expert_bf16_width(self) -> int: ...


def job_costs(
    config: dict[str, Any], layout: Layout, settings: CostedSettings, *, seq_len: int | None, micro_batch_size: int
) -> Costs:
    """The task costs a disaggregated job's AF-Pipe schedule is generated from: the planner's per-task seconds for
    this model, layout, sequence length and ``settings`` (``DisagMoEConfig``), computed before the ranks start (the
    job plan's) and handed to them as data; unit costs when the sequence length is not known. With
    ``split_backward`` the weight-gradient halves are W tasks, except on a compiled attention side (one autograd node
    per part: nothing to split)."""
    if seq_len is None:
        return unit_costs(
            split_backward=settings.split_backward, compiled=settings.compile, ffn_zero3=settings.experts_sharded
        )
    return runtime_costs(
        config,
        layout,
        seq_len=seq_len,
        micro_batch_size=micro_batch_size,
        cluster=settings.cluster,
        ffn_cluster=settings.ffn_cluster,
        profile=settings.profile,
        resend=settings.resend,
        split_backward=settings.split_backward,
        compiled=settings.compile,
        ffn_zero_stage=3 if settings.experts_sharded else None,
        lora=_costed_lora(settings.lora),
        fp8=settings.fp8,
        fp8_cast_per_call=settings.fp8_cast_per_call,
        fp8_bf16_width=settings.fp8_bf16_width,
        fp8_expert_bf16_width=settings.fp8_expert_bf16_width,
    )


def _costed_lora(lora: LoraSettings | None) -> LoRA:
    """The planner's view of the run's LoRA: it costs target groups, so projection names (``q_proj``) count as the
    attention group they sit in (a slight over-estimate, for the schedule's task costs only)."""
    if lora is None:
        return FULL
    groups = {t if t in GROUPS else "attention" for t in lora.targets}
    return LoRA(lora.rank, tuple(groups), lora.train_router)


def runtime_costs(config: dict[str, Any], layout: Layout, **kwargs: Any) -> Costs:
    """``schedule.Costs`` of ``runtime_task_costs`` (same arguments): what the runtime's schedule generator reads."""
    return schedule_costs(ModelSpec.from_config(config), runtime_task_costs(config, layout, **kwargs))


def runtime_task_costs(
    config: dict[str, Any],
    layout: Layout,
    *,
    seq_len: int,
    micro_batch_size: int,
    cluster: str = "h200",
    ffn_cluster: str | None = None,
    profile: str | None = None,
    resend: bool = False,
    split_backward: bool = False,
    compiled: bool = False,
    ffn_zero_stage: int | None = None,
    lora: LoRA = FULL,
    fp8: bool = False,
    fp8_cast_per_call: bool = False,
    fp8_bf16_width: int = BF16_WIDTH,
    fp8_expert_bf16_width: int = EXPERT_BF16_WIDTH,
) -> AfTaskCosts:
    """Seconds per task and transfer of one micro-batch for ``layout``, ranks placed contiguously (attention first).

    Args:
        config: the model's Hugging Face config as a dict (the layers the job trains).
        cluster: a planner preset (``h800``, ``h100``, ``h200``, ``a100``; nodes from the world size) or a cluster JSON.
        ffn_cluster: the expert side's, on a fleet of two GPU types (``cluster.Fleet``: each side's nodes from its
            GPUs, the attention side's first); None: ``cluster``.
        profile: a ``disagmoe-plan profile`` JSON: measured part times instead of peak x efficiency.
        resend: the backward's n2m_grad also carries the m2n payload (``DisagMoEConfig.resend``).
        split_backward: each backward's weight-gradient half becomes a task of its own (``Costs.a_wgt`` ...), as the
            planner's "split backward" variant costs it (``DisagMoEConfig.split_backward``).
        compiled: the attention parts and the head are ``torch.compile``d: their backward is one autograd node, so
            their weight gradients stay in the backward (no A-side W task); the experts' GEMMs still split.
        ffn_zero_stage: the expert side's ZeRO stage where the job sets one; at 3 its backward stays whole.
        lora: the job's LoRA adapters: frozen base weights skip their weight gradients (``lora.GemmFlops``).
        fp8, fp8_cast_per_call, fp8_bf16_width, fp8_expert_bf16_width: the FP8 lever (``DisagMoEConfig.fp8``): its
            GEMMs at the FP8 rates, its quantize passes and the m2n rows in e4m3 (``fp8_costs.py``); the expert
            weights cast in every call with the second; the attention side's projections up to the third's width and
            the experts up to the fourth's in bf16.
    """
    spec = ModelSpec.from_config(config)
    eff = Efficiency()
    if ffn_cluster not in (None, cluster):
        fleet = Fleet(_machines(cluster, layout.attention_gpus), _machines(ffn_cluster, layout.ffn_gpus))
        per_node = fleet.attention.gpus_per_node
        if layout.attention_gpus % per_node:
            raise ConfigError(
                f"a fleet of two GPU types gives each side whole nodes: attention_gpus ({layout.attention_gpus}) must "
                f"be a multiple of a node's {per_node} GPUs (its ranks come first, then the experts')"
            )
        machines = fleet.whole()
        rates = replace(Rates.from_cluster(fleet.attention, eff), ffn=Rates.from_cluster(fleet.ffn, eff))
    elif profile:  # a profile's measured links replace a preset's nominal ones, never a cluster JSON's
        machines = _machines(cluster, layout.world_size)
        rates = rates_from_profile(load_profile(profile), machines, eff, measured_links=cluster in PRESETS)
    else:
        machines = _machines(cluster, layout.world_size)
        rates = Rates.from_cluster(machines, eff)
    placement = Placement.contiguous(machines.nodes, machines.gpus_per_node)
    nics = placement.nic_splits(machines, layout.attention_gpus)[0]
    work = Workload(
        seq_len,
        micro_batch_size,
        resend=resend,
        split_backward=split_backward,
        ffn_zero_stage=ffn_zero_stage,
        fp8=fp8,
        fp8_cast_per_call=fp8_cast_per_call,
        fp8_bf16_width=fp8_bf16_width,
        fp8_expert_bf16_width=fp8_expert_bf16_width,
    ).with_lora(lora)
    task_costs = af_task_costs(spec, layout, work, placement=placement, rates=rates, nics=nics)
    return attention_wgrad_folded(task_costs) if compiled else task_costs


def _machines(cluster: str, gpus: int) -> Cluster:
    """A preset's nodes for ``gpus`` GPUs, or a cluster JSON as written."""
    return load_cluster(cluster, None if cluster.endswith(".json") else math.ceil(gpus / GPUS_PER_PRESET_NODE))


def attention_wgrad_folded(task_costs: AfTaskCosts) -> AfTaskCosts:
    """The attention side's W tasks (and the head's) folded back into its backward tasks.

    >>> costs = AfTaskCosts({"A_bwd": (1.0,), "F_bwd": (2.0,)}, 1.0, 3.0, {"A": (0.5,), "F": (1.0,)}, 2.0)
    >>> folded = attention_wgrad_folded(costs)
    >>> folded.per_layer["A_bwd"], folded.wgrad, folded.head_bwd, folded.head_wgrad
    ((1.5,), {'A': (0.0,), 'F': (1.0,)}, 5.0, 0.0)
    """
    if not task_costs.wgrad:
        return task_costs
    a_w = task_costs.wgrad["A"]
    a_bwd = tuple(b + w for b, w in zip(task_costs.per_layer["A_bwd"], a_w, strict=True))
    return replace(
        task_costs,
        per_layer={**task_costs.per_layer, "A_bwd": a_bwd},
        wgrad={**task_costs.wgrad, "A": (0.0,) * len(a_w)},
        head_bwd=task_costs.head_bwd + task_costs.head_wgrad,
        head_wgrad=0.0,
    )
