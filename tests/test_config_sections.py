"""The section's keys grouped into typed sections (each key in exactly one, both modes sharing theirs), and each
side's effective ZeRO stage derived by one rule."""

from __future__ import annotations

from dataclasses import fields

import pytest

from disagmoe_ds import config
from disagmoe_ds.colocated.layout import ColocatedConfig
from disagmoe_ds.config import (
    Accumulation,
    DisagMoEConfig,
    FineTuning,
    Kernels,
    LayoutCounts,
    Recompute,
    Watchdog,
    effective_zero_stage,
)
from disagmoe_ds.config.sections import LaneSlices, Section
from disagmoe_ds.errors import ConfigError

SECTIONS = [cls for cls in DisagMoEConfig.__mro__[1:] if issubclass(cls, Section) and cls is not Section]


def _own_keys(cls: type) -> set[str]:
    inherited = {f.name for base in cls.__mro__[1:] if hasattr(base, "__dataclass_fields__") for f in fields(base)}
    return {f.name for f in fields(cls)} - inherited


def test_every_key_is_in_exactly_one_section():
    keys = [key for cls in SECTIONS for key in _own_keys(cls)]
    assert sorted(keys) == sorted(f.name for f in fields(DisagMoEConfig)) and len(keys) == len(set(keys))
    assert not _own_keys(DisagMoEConfig)  # the config adds no key of its own, only the rules across sections
    assert all(len(_own_keys(cls)) <= 5 for cls in SECTIONS)  # small: one concept each


def test_the_colocated_config_shares_the_sections_both_modes_read():
    shared = {f.name for f in fields(ColocatedConfig)} & {f.name for f in fields(DisagMoEConfig)}
    sections = {
        f.name for cls in (Accumulation, Watchdog, Kernels, Recompute, FineTuning, LaneSlices) for f in fields(cls)
    }
    assert shared == sections | {"transport"}  # the exchange's, and the co-located pipeline's hand-offs
    assert issubclass(ColocatedConfig, Accumulation) and not issubclass(ColocatedConfig, LayoutCounts)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: DisagMoEConfig(depth=0), r'"disagmoe.depth" must be a positive int, got 0'),
        (lambda: DisagMoEConfig(max_in_flight=0), r'"disagmoe.max_in_flight" must be a positive int'),
        (lambda: DisagMoEConfig(comm_timeout_s=-1.0), r'"disagmoe.comm_timeout_s" must be a positive float'),
        (lambda: DisagMoEConfig(capacity_factor=0), r'"disagmoe.capacity_factor" must be a positive float'),
        (lambda: DisagMoEConfig(comm_stream=1), r'"disagmoe.comm_stream" must be true or false'),
        (lambda: DisagMoEConfig(transport="tcp"), r'"disagmoe.transport" must be one of'),
        (lambda: DisagMoEConfig(cluster="nowhere"), r'"disagmoe.cluster" must be one of the presets'),
        (lambda: DisagMoEConfig(zero_stage={"attention": 3}), r"ZeRO-3 shards parameters on the expert side only"),
        (lambda: DisagMoEConfig(cuda_graphs=True, resend=True, split_backward=True), r"split_backward"),
        (lambda: ColocatedConfig(compile="yes"), r"colocated.compile must be true or false"),
        (lambda: ColocatedConfig(world_size=0), r"colocated.world_size must be a positive int"),
    ],
)
def test_each_section_checks_its_keys(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


def test_lora_is_parsed_once_into_its_settings():
    cfg = DisagMoEConfig(lora={"rank": 4})
    assert cfg.lora is not None and cfg.lora.rank == 4 and DisagMoEConfig(**cfg.to_dict()) == cfg


def _ds(stage: int, *, bf16: bool = False) -> dict:
    return {"zero_optimization": {"stage": stage}, "bf16": {"enabled": bf16}}


def test_each_sides_effective_stage():
    cfg = DisagMoEConfig(zero_stage={"ffn": 3})
    assert cfg.zero_stages(_ds(1)) == {"attention": 1, "ffn": 3} and cfg.experts_sharded
    assert DisagMoEConfig().zero_stages(_ds(2)) == {"attention": 2, "ffn": 2}
    assert not DisagMoEConfig(zero_stage={"attention": 2}).experts_sharded
    assert ColocatedConfig().zero_stage_of("ffn", _ds(2)) == ColocatedConfig().zero_stage_of("attention", _ds(2)) == 2
    assert effective_zero_stage({}) == 0  # no zero_optimization: stage 0


def test_the_ds_configs_stage_is_zero_to_two_for_every_side():
    """ZeRO-3 comes from the expert side's own stage only, so ``experts_sharded`` is known without the ds_config."""
    with pytest.raises(ConfigError, match=r'"zero_optimization.stage" 3 is not supported; use 0, 1 or 2'):
        DisagMoEConfig(zero_stage={"attention": 2}).zero_stage_of("ffn", _ds(3))
    with pytest.raises(ConfigError, match=r'"zero_optimization.stage" 3 is not supported; .* one engine'):
        ColocatedConfig().zero_stage_of("ffn", _ds(3))
    with pytest.raises(ConfigError, match=r'bf16 needs ZeRO stage >= 1 on the expert side .*"disagmoe.zero_stage.ffn"'):
        DisagMoEConfig(zero_stage={"ffn": 0}).zero_stage_of("ffn", _ds(1, bf16=True))
    with pytest.raises(ConfigError, match=r"co-located rank has one engine"):
        ColocatedConfig().zero_stage_of("ffn", {**_ds(1), config.SECTION: {"zero_stage": {"ffn": 2}}})


def test_the_transport_names_are_the_transports() -> None:
    from disagmoe_ds.comm.transport import TRANSPORTS
    from disagmoe_ds.config.sections import TRANSPORT_NAMES

    assert set(TRANSPORT_NAMES) == set(TRANSPORTS)


def test_the_cluster_preset_names_are_the_planners() -> None:
    from disagmoe_ds.config.sections import CLUSTER_PRESETS
    from disagmoe_ds.planner.cluster import PRESETS

    assert CLUSTER_PRESETS == tuple(PRESETS)
