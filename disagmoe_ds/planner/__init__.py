"""Roofline planner, allocator and step simulator for disaggregated MoE training (pure Python, no torch).

>>> from disagmoe_ds.planner import ModelSpec, preset
>>> preset("h200", nodes=2).world_size
16

Entry points: ``plan(PlanRequest(...))`` -> ``PlanResult``; the ``disagmoe-plan`` console script
(``disagmoe_ds.planner.cli:main``); ``docs/planner.md`` explains the model and shows plans.
"""

from disagmoe_ds.planner.allocator import AfPlan, BaselinePlan, PlanRequest, PlanResult, plan
from disagmoe_ds.planner.cluster import (
    PRESETS,
    Cluster,
    Efficiency,
    PartModel,
    Rates,
    load_cluster,
    preset,
    save_cluster,
)
from disagmoe_ds.planner.memory import RankMemory
from disagmoe_ds.planner.model import ModelSpec, WireBytes, causal_pairs, load_model_spec
from disagmoe_ds.planner.placement import Placement
from disagmoe_ds.planner.simulate import SimResult, megatron_order, simulate_af, simulate_baseline, write_timeline
from disagmoe_ds.planner.training_state import Precision
from disagmoe_ds.planner.workload import Workload

__all__ = [
    "PRESETS",
    "AfPlan",
    "BaselinePlan",
    "Cluster",
    "Efficiency",
    "ModelSpec",
    "PartModel",
    "Placement",
    "PlanRequest",
    "PlanResult",
    "Precision",
    "RankMemory",
    "Rates",
    "SimResult",
    "WireBytes",
    "Workload",
    "causal_pairs",
    "load_cluster",
    "load_model_spec",
    "megatron_order",
    "plan",
    "preset",
    "save_cluster",
    "simulate_af",
    "simulate_baseline",
    "write_timeline",
]
