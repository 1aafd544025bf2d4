"""The job's process groups (``groups.build_process_groups``): exchange communicators only for disaggregated jobs."""

from __future__ import annotations

import torch

from disagmoe_ds.colocated.layout import ColocatedLayout
from disagmoe_ds.comm.transport import make_transport
from disagmoe_ds.groups import build_process_groups
from disagmoe_ds.launch.testing import run_ranks


def _colocated_with_transport_body(rank: int) -> str:
    layout = ColocatedLayout(world_size=1, ep_size=1, num_experts=2)
    groups = build_process_groups(layout, rank)
    assert groups.data_parallel_ranks == (0,) and groups.exchange is None
    try:
        build_process_groups(layout, rank, transport=make_transport("rendezvous"), device=torch.device("cpu"))
    except ValueError as err:
        return str(err)
    return "built"


def test_a_colocated_layout_gets_no_exchange_communicators() -> None:
    # A co-located layout has no exchange; with a transport it once failed deep inside comm_keys with an
    # AttributeError (it lacks the disaggregated Layout's fields); now it is refused by name.
    (message,) = run_ranks(_colocated_with_transport_body, 1, timeout_s=60)
    assert "need a disaggregated Layout" in message and "ColocatedLayout" in message
