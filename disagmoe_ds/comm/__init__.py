"""Token exchange between A-groups and F-groups: local pack (routing), transport (channel), M2N/N2M (exchange).

Only ``channel`` and ``exchange`` communicate; ``routing`` is pure torch. EXCHANGES.md lists every exchange.
"""

from disagmoe_ds.comm.channel import (
    ChannelError,
    CommStream,
    Link,
    MessageSpec,
    Receiver,
    Sender,
    SendHandle,
    TensorSpec,
)
from disagmoe_ds.comm.exchange import (
    ExchangeGroups,
    Kind,
    LaneRows,
    M2NReceiver,
    M2NSender,
    N2MReceiver,
    N2MSender,
    build_exchange_groups,
    dispatch_messages,
    exchange_pairs,
    exchange_specs,
)
from disagmoe_ds.comm.routing import DispatchPlan, combine, pack, plan_dispatch

__all__ = [
    "ChannelError",
    "CommStream",
    "DispatchPlan",
    "ExchangeGroups",
    "Kind",
    "LaneRows",
    "Link",
    "M2NReceiver",
    "M2NSender",
    "MessageSpec",
    "N2MReceiver",
    "N2MSender",
    "Receiver",
    "SendHandle",
    "Sender",
    "TensorSpec",
    "build_exchange_groups",
    "combine",
    "dispatch_messages",
    "exchange_pairs",
    "exchange_specs",
    "pack",
    "plan_dispatch",
]
