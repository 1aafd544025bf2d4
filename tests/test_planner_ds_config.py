"""The planner's ds_config runs in the runtime as planned: each variant the runtime runs is written into the
"disagmoe" section and passes the runtime's own checks; each it refuses is left out, and the planner's reason
(``runtime_files.runtime_refusal``) is the runtime's."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from disagmoe_ds.afpipe.build import check_zero_stages
from disagmoe_ds.config import DisagMoEConfig
from disagmoe_ds.errors import ConfigError
from disagmoe_ds.layout import Layout
from disagmoe_ds.planner.runtime_files import ds_config, runtime_refusal
from disagmoe_ds.planner.workload import Workload


def _written(work: Workload, depth: int) -> dict:
    layout = Layout(attention_gpus=2 * depth, ffn_gpus=2 * depth, num_layers=4, num_experts=8, depth=depth)
    candidate = SimpleNamespace(layout=layout, micro_batches=8, work=work)
    request = SimpleNamespace(work=Workload(4096, 1), cluster=SimpleNamespace(name="h800"))
    return ds_config(SimpleNamespace(request=request, af=SimpleNamespace(candidate=candidate, in_flight=5)))


def _runtime_accepts(ds: dict) -> bool:
    try:
        cfg = DisagMoEConfig.from_ds_config(ds)
        check_zero_stages(cfg, ds)
    except ConfigError:
        return False
    return True


def _full_variant(work: Workload, depth: int) -> dict:
    """The ds_config with every switch of ``work`` set, as if the planner wrote it whatever the runtime refuses."""
    ds = _written(Workload(4096, 1), depth)
    ds["disagmoe"] |= {
        "activation_checkpointing": work.recompute == "full",
        "selective_recompute": work.recompute == "selective",
        "resend": work.resend,
        "split_backward": work.split_backward,
        "offload": {"attention": work.offload[0], "ffn": work.offload[1]},
        "zero_stage": {"attention": work.zero_of("attention"), "ffn": work.zero_of("ffn")},
    }
    return ds


VARIANTS = list(
    itertools.product(
        ("none", "selective", "full"), (False, True), (False, True), (1, 2), (1, 2, 3), (0.0, 0.5), (1, 2)
    )
)


@pytest.mark.parametrize(("recompute", "resend", "split", "za", "zf", "offload_f", "depth"), VARIANTS)
def test_the_planners_refusals_are_the_runtimes(recompute, resend, split, za, zf, offload_f, depth):
    work = Workload(
        4096,
        1,
        recompute=recompute,
        resend=resend,
        split_backward=split,
        attention_zero_stage=za,
        ffn_zero_stage=zf,
        offload=(0.15000000000000002, offload_f),  # the writer rounds
    )
    refusal = runtime_refusal(work)
    assert _runtime_accepts(_full_variant(work, depth)) == (refusal is None), refusal
    written = _written(work, depth)
    assert _runtime_accepts(written)  # what the planner writes always launches
    section = written["disagmoe"]
    if refusal is None:  # the variant as planned
        cfg = DisagMoEConfig.from_ds_config(written)
        assert cfg.selective_recompute == (recompute == "selective")
        assert cfg.activation_checkpointing == (recompute == "full")
        assert (cfg.resend, cfg.split_backward) == (resend, split)
        assert cfg.zero_stage == {"attention": za, "ffn": zf} and cfg.offload_share("attention") == 0.15
    else:  # the layout alone
        assert "zero_stage" not in section and "offload" not in section


def test_the_planner_knows_which_a_lane_degrees_the_runtime_runs():
    """``runtime_files.RUNTIME_LANE_FIELDS`` names which of "sequence_parallel" and "tensor_parallel"
    ``DisagMoEConfig`` reads (the planner cannot import it): a plan with a degree > 1 the runtime does not read gets
    no ds_config."""
    from dataclasses import fields

    from disagmoe_ds.planner.runtime_files import RUNTIME_LANE_FIELDS

    names = {f.name for f in fields(DisagMoEConfig)}
    assert RUNTIME_LANE_FIELDS == {"sequence_parallel", "tensor_parallel"} & names
