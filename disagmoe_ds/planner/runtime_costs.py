"""The schedule's task costs for a job the runtime builds: the same per-task seconds the planner simulates.

Every rank derives them from the same inputs (model config, layout, sequence length, cluster, profile), so all
workers generate the same schedule without communicating, and a resumed job gets the same order again.

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
from typing import Any

from disagmoe_ds.layout import Layout
from disagmoe_ds.planner.cluster import PRESETS, Efficiency, Rates, load_cluster
from disagmoe_ds.planner.memory import Workload
from disagmoe_ds.planner.model import ModelSpec
from disagmoe_ds.planner.placement import Placement
from disagmoe_ds.planner.profile_fit import load_profile, rates_from_profile
from disagmoe_ds.planner.simulate import schedule_costs
from disagmoe_ds.planner.task_costs import af_task_costs
from disagmoe_ds.schedule import Costs

GPUS_PER_PRESET_NODE = 8


def runtime_costs(
    config: dict[str, Any],
    layout: Layout,
    *,
    seq_len: int,
    micro_batch_size: int,
    cluster: str = "h200",
    profile: str | None = None,
    resend: bool = False,
) -> Costs:
    """Seconds per task and transfer of one micro-batch for ``layout``, ranks placed contiguously (attention first).

    Args:
        config: the model's Hugging Face config as a dict (the layers the job trains).
        cluster: a planner preset (``h800``, ``h100``, ``h200``; nodes from the world size) or a cluster JSON.
        profile: a ``disagmoe-plan profile`` JSON: measured part times instead of peak x efficiency.
        resend: the backward's n2m_grad also carries the m2n payload (``DisagMoEConfig.resend``).
    """
    spec = ModelSpec.from_config(config)
    nodes = math.ceil(layout.world_size / GPUS_PER_PRESET_NODE)
    machines = load_cluster(cluster, nodes if not cluster.endswith(".json") else None)
    eff = Efficiency()
    if profile:  # a profile's measured links replace a preset's nominal ones, never a cluster JSON's
        rates = rates_from_profile(load_profile(profile), machines, eff, measured_links=cluster in PRESETS)
    else:
        rates = Rates.from_cluster(machines, eff)
    placement = Placement.contiguous(machines.nodes, machines.gpus_per_node)
    nics = placement.nic_splits(machines, layout.attention_gpus)[0]
    work = Workload(seq_len, micro_batch_size, resend=resend)
    return schedule_costs(spec, af_task_costs(spec, layout, work, placement=placement, rates=rates, nics=nics))
