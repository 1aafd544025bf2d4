"""Token exchange between A-groups and F-groups: local pack (routing), the typed messages (messages), transport,
fan-out/fan-in (channel), who talks to whom on which communicator (exchange).

Only ``transport``, ``channel`` and ``exchange`` communicate; ``routing`` is pure torch.
"""

from disagmoe_ds.comm.channel import ChannelError, CommStream, FanIn, FanOut, MessageSpec, TensorSpec
from disagmoe_ds.comm.exchange import (
    ExchangeComms,
    LaneRows,
    build_exchange_comms,
    comm_keys,
    comm_pairs,
    comm_ranks,
    endpoint,
    exchange_specs,
)
from disagmoe_ds.comm.messages import (
    Dims,
    ExpertOut,
    ExpertOutGrad,
    Residual,
    ResidualGrad,
    TokenGrads,
    Tokens,
)
from disagmoe_ds.comm.routing import CombinePlan, DispatchPlan, combine, pack, plan_dispatch
from disagmoe_ds.comm.transport import (
    Op,
    RendezvousTransport,
    TorchTransport,
    Transport,
    TransportError,
    make_transport,
)
from disagmoe_ds.schedule import Kind

__all__ = [
    "ChannelError",
    "Dims",
    "ExpertOut",
    "ExpertOutGrad",
    "Residual",
    "ResidualGrad",
    "TokenGrads",
    "Tokens",
    "CombinePlan",
    "CommStream",
    "DispatchPlan",
    "ExchangeComms",
    "FanIn",
    "FanOut",
    "Kind",
    "LaneRows",
    "MessageSpec",
    "Op",
    "RendezvousTransport",
    "TensorSpec",
    "TorchTransport",
    "Transport",
    "TransportError",
    "build_exchange_comms",
    "combine",
    "comm_keys",
    "comm_pairs",
    "comm_ranks",
    "endpoint",
    "exchange_specs",
    "make_transport",
    "pack",
    "plan_dispatch",
]
