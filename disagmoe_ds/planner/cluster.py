"""Cluster descriptions (presets and a JSON file format) and the achievable-rate model (pure Python).

Bandwidths are bytes per second in one direction: ``nvlink_bw`` per GPU, ``nic_bw`` per NIC; ``hbm_bw`` is one
GPU's memory bandwidth (the optimizer step is bound by it). The planner never uses peak numbers directly:
``Rates`` multiplies them by documented efficiency factors, or replaces the compute rates by FLOP/s measured with
``disagmoe-plan profile``.

>>> c = preset("h800", nodes=4)
>>> c.world_size, c.total_nics, c.nic_bw / 1e9
(32, 32, 50.0)
>>> Cluster.from_dict(c.to_dict()) == c
True
>>> c.hbm_bw / 1e12, preset("h200", nodes=1).hbm_bw / 1e12
(3.35, 4.8)
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from disagmoe_ds.errors import ConfigError
from disagmoe_ds.planner.inputs import read_json

_MIB = 1 << 20
# PCIe Gen5 x16 between an H100/H800/H200 SXM GPU and its PCIe switch: 32 GT/s x 16 lanes x 128b/130b = 63 GB/s
# per direction (the presets' default; a cluster JSON may set pcie_bw).
PCIE_GEN5_X16 = 63e9
# Host memory of a DGX H100/H800-class node: 2 TiB (32 x 64 GiB DIMMs).
DGX_HOST_BYTES = float(2 << 40)
# Its memory bandwidth: two Xeon Platinum 8480C sockets of 8 DDR5-4800 channels (38.4 GB/s each) = 614 GB/s.
DGX_HOST_MEM_BW = 2 * 8 * 38.4e9
# HBM bandwidth per GPU (NVIDIA's data sheets): H100 and H800 SXM, 80 GB of HBM3, 3.35 TB/s; H200 SXM, 141 GB of
# HBM3e, 4.8 TB/s. A cluster JSON without hbm_bw gets the one of its memory size (``default_hbm_bw``).
HBM_BW_H100 = 3.35e12
HBM_BW_H200 = 4.8e12
_H200_CLASS_BYTES = 100e9  # more HBM than any 80 GB part: an H200-class GPU
# A device-to-device copy through PyTorch moves about 4.3 of an H200's 4.8 TB/s (read plus write; measured on this
# project's machines): the share of HBM bandwidth streaming kernels such as the optimizer step reach.
STREAMING_HBM_SHARE = 0.9


def default_hbm_bw(hbm_bytes: float) -> float:
    """HBM bandwidth of a GPU with ``hbm_bytes`` of memory, for a cluster JSON that does not say: the H200's
    4.8 TB/s above 100 GB (141 GB parts), else the H100/H800's 3.35 TB/s (80 GB parts)."""
    return HBM_BW_H200 if hbm_bytes > _H200_CLASS_BYTES else HBM_BW_H100


@dataclass(frozen=True)
class Cluster:
    """A homogeneous GPU cluster.

    Args:
        name: label for reports.
        nodes: number of nodes.
        gpus_per_node: GPUs in each node.
        peak_flops: dense bf16 FLOP/s of one GPU.
        hbm_bytes: memory of one GPU in bytes.
        nvlink_bw: intra-node bandwidth of one GPU, bytes/s, one direction.
        nics_per_node: RDMA NICs of one node.
        nic_bw: bandwidth of one NIC, bytes/s, one direction.
        hosts: optional host names, one per node, used for the hostfile.
        pcie_bw: host link of one GPU, bytes/s, one direction (activation offload; the GPU's NIC traffic
            crosses the same x16 link to its PCIe switch under GPUDirect RDMA).
        host_bytes: host memory of one node in bytes (where offloaded activations go).
        host_mem_bw: host memory bandwidth of one node, bytes/s (where an offloaded optimizer steps).
        hbm_bw: memory bandwidth of one GPU, bytes/s (None: ``default_hbm_bw(hbm_bytes)``).
        message_host_s: host seconds a rank spends issuing one exchange operation (a grouped send, a posted
            receive, an all-to-all call), on the critical path of a rank whose host is the busier side. 0 by
            default; the runtime's timeline measured 0.3-0.4 ms on H200 hosts (docs/planner.md section 5).
    """

    name: str
    nodes: int
    gpus_per_node: int
    peak_flops: float
    hbm_bytes: float
    nvlink_bw: float
    nics_per_node: int
    nic_bw: float
    hosts: tuple[str, ...] = ()
    pcie_bw: float = PCIE_GEN5_X16
    host_bytes: float = DGX_HOST_BYTES
    host_mem_bw: float = DGX_HOST_MEM_BW
    hbm_bw: float | None = None
    message_host_s: float = 0.0

    def __post_init__(self) -> None:
        if self.hbm_bw is None and isinstance(self.hbm_bytes, (int, float)):
            object.__setattr__(self, "hbm_bw", self.memory_bw)
        for f in ("nodes", "gpus_per_node", "nics_per_node"):
            value = getattr(self, f)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"cluster field {f} must be a positive integer, got {value!r}")
        for f in ("peak_flops", "hbm_bytes", "nvlink_bw", "nic_bw", "pcie_bw", "host_bytes", "host_mem_bw", "hbm_bw"):
            value = getattr(self, f)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"cluster field {f} must be a positive number, got {value!r}")
        host_s = self.message_host_s
        if isinstance(host_s, bool) or not isinstance(host_s, (int, float)) or not host_s >= 0:
            raise ConfigError(f"cluster field message_host_s must be a number >= 0, got {host_s!r}")
        if self.hosts and len(self.hosts) != self.nodes:
            raise ConfigError(f"cluster hosts lists {len(self.hosts)} names but nodes is {self.nodes}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def memory_bw(self) -> float:
        """``hbm_bw``, or the one of ``hbm_bytes`` where none is given (which ``__post_init__`` fills in)."""
        return default_hbm_bw(self.hbm_bytes) if self.hbm_bw is None else self.hbm_bw

    @property
    def total_nics(self) -> int:
        return self.nodes * self.nics_per_node

    @property
    def nic_bw_per_gpu(self) -> float:
        return self.nics_per_node * self.nic_bw / self.gpus_per_node

    def host(self, node: int) -> str:
        return self.hosts[node] if self.hosts else f"node-{node}"

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["hosts"] = list(self.hosts)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Cluster:
        """Validated construction from a JSON object; unknown or missing keys are errors."""
        if not isinstance(data, dict):
            raise ConfigError(f"a cluster JSON must be an object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown cluster field(s) {unknown}; allowed: {sorted(known)}")
        optional = ("hosts", "pcie_bw", "host_bytes", "host_mem_bw", "hbm_bw", "message_host_s")
        missing = sorted(f.name for f in fields(cls) if f.name not in data and f.name not in optional)
        if missing:
            raise ConfigError(f"cluster JSON lacks field(s) {missing}")
        return cls(**{**data, "hosts": tuple(data.get("hosts") or ())})


def _h800(nodes: int) -> Cluster:
    # H800 SXM: 989 TFLOP/s dense bf16, 80 GB (81559 MiB reported), NVLink 400 GB/s total (200 one way),
    # 8 x ConnectX-7 400 Gb/s per node (the DisagMoE paper's testbed).
    return Cluster("h800", nodes, 8, 989e12, 81559 * _MIB, 200e9, 8, 50e9, hbm_bw=HBM_BW_H100)


def _h100(nodes: int) -> Cluster:
    # H100 SXM: 989 TFLOP/s dense bf16, 80 GB, NVLink 900 GB/s total (450 one way), 8 x 400 Gb/s NICs.
    return Cluster("h100", nodes, 8, 989e12, 81559 * _MIB, 450e9, 8, 50e9, hbm_bw=HBM_BW_H100)


def _h200(nodes: int) -> Cluster:
    # H200 SXM: 989 TFLOP/s dense bf16, 141 GB (143771 MiB reported), NVLink 450 GB/s one way, 8 x 400 Gb/s.
    return Cluster("h200", nodes, 8, 989e12, 143771 * _MIB, 450e9, 8, 50e9, hbm_bw=HBM_BW_H200)


def _a100(nodes: int) -> Cluster:
    # A100 SXM 80 GB: 312 TFLOP/s dense bf16, 81920 MiB, 2.04 TB/s HBM2e, NVLink 600 GB/s total (300 one way),
    # 8 x 200 Gb/s HDR NICs per node (DGX A100), PCIe Gen4 x16 (16 GT/s x 16 lanes x 128b/130b = 31.5 GB/s).
    # Host: two EPYC 7742 sockets of 8 DDR4-3200 channels (25.6 GB/s each).
    return Cluster(
        "a100",
        nodes,
        8,
        312e12,
        81920 * _MIB,
        300e9,
        8,
        25e9,
        pcie_bw=31.5e9,
        host_mem_bw=2 * 8 * 25.6e9,
        hbm_bw=2.039e12,
    )


PRESETS = {"h800": _h800, "h100": _h100, "h200": _h200, "a100": _a100}


def preset(name: str, nodes: int) -> Cluster:
    if name not in PRESETS:
        raise ConfigError(f"unknown cluster preset {name!r}; presets: {', '.join(PRESETS)}, or a JSON file")
    return PRESETS[name](nodes)


def load_cluster(spec: str, nodes: int | None = None) -> Cluster:
    """A preset name or a JSON file path; ``nodes`` (if given) overrides the file's node count."""
    if spec in PRESETS:
        if nodes is None:
            raise ConfigError(f"cluster preset {spec!r} needs --nodes")
        return preset(spec, nodes)
    path = Path(spec)
    if not path.is_file():
        raise ConfigError(f"--cluster {spec!r} is neither a preset ({', '.join(PRESETS)}) nor an existing JSON file")
    cluster = Cluster.from_dict(read_json(path, "--cluster"))
    if nodes is not None and nodes != cluster.nodes:
        cluster = replace(cluster, nodes=nodes, hosts=cluster.hosts[:nodes] if len(cluster.hosts) >= nodes else ())
    return cluster


def save_cluster(cluster: Cluster, path: str | Path) -> None:
    Path(path).write_text(json.dumps(cluster.to_dict(), indent=2) + "\n", encoding="utf-8")


# what a node of each type must share for one placement to hold both
_SAME_PER_NODE = ("gpus_per_node", "nics_per_node")
# the hardware fields the whole fleet, run as one homogeneous cluster, gets at its weaker type's value
_WEAKEST = ("peak_flops", "hbm_bytes", "nvlink_bw", "nic_bw", "pcie_bw", "host_bytes", "host_mem_bw", "hbm_bw")


@dataclass(frozen=True)
class Fleet:
    """The attention type's nodes and the expert type's nodes."""

    attention: Cluster
    ffn: Cluster

    def __post_init__(self) -> None:
        for name in _SAME_PER_NODE:
            a, f = getattr(self.attention, name), getattr(self.ffn, name)
            if a != f:
                raise ConfigError(f"the fleet's node types differ in {name} ({a} and {f}): one placement needs them")

    @property
    def name(self) -> str:
        return f"{self.attention.nodes} x {self.attention.name} + {self.ffn.nodes} x {self.ffn.name}"

    def whole(self) -> Cluster:
        """Both types' nodes in one cluster, the attention type's first (its hardware fields name the A side's; the
        expert side's come from ``Rates.ffn``)."""
        hosts = tuple(_host(c, node) for c in (self.attention, self.ffn) for node in range(c.nodes))
        host_bytes = min(self.attention.host_bytes, self.ffn.host_bytes)
        nodes = self.attention.nodes + self.ffn.nodes
        return replace(self.attention, name=self.name, nodes=nodes, hosts=hosts, host_bytes=host_bytes)

    def weakest(self) -> Cluster:
        """The whole fleet as one homogeneous cluster: every rate and memory at the weaker type's value."""
        weaker = {f: min(getattr(self.attention, f), getattr(self.ffn, f)) for f in _WEAKEST}
        return replace(self.whole(), name=f"{self.name}, at the weaker type", **weaker)


def _host(cluster: Cluster, node: int) -> str:
    """A node's host name: the cluster's own, else its type and number (``h200-0``), so a hostfile says which."""
    return cluster.hosts[node] if cluster.hosts else f"{cluster.name}-{node}"


@dataclass(frozen=True)
class Efficiency:
    """Fractions of peak that real kernels and collectives reach (defaults, overridable on the command line).

    compute 0.5: one share for every shape (``Rates.from_cluster``, ``--compute-efficiency``); without it the CLI,
    the study and the sweep time each shape at its own share (``gemm_efficiency.shape_rates``).
    network 0.8: NCCL send/recv and all-to-all bus bandwidth on 400 Gb/s RDMA with large messages.
    nvlink 0.8: NCCL intra-node bus bandwidth relative to the NVLink line rate.
    memory 0.9: usable share of HBM after the CUDA context, NCCL buffers and allocator fragmentation.
    pcie 0.8: achieved share of the PCIe line rate by large pinned-memory DMA copies (~50 of 63 GB/s on Gen5).
    hbm 0.9: achieved share of HBM bandwidth by streaming kernels (``STREAMING_HBM_SHARE``).
    host 0.5: achieved share of a node's host memory bandwidth by the optimizer steps of its GPUs' offloaded state
        (DeepSpeed's CPU Adam, one process per GPU, beside the DMA of gradients and parameters). An assumption, not
        measured on these machines: a streaming kernel reaches 70-80% of a two-socket server's DRAM bandwidth.
    """

    compute: float = 0.5
    hbm: float = STREAMING_HBM_SHARE
    network: float = 0.8
    nvlink: float = 0.8
    memory: float = 0.9
    pcie: float = 0.8
    host: float = 0.5

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not 0 < value <= 1:
                raise ConfigError(f"efficiency {f.name} must be in (0, 1], got {value!r}")


@dataclass(frozen=True)
class PartModel:
    """Seconds of one call of a layer part on one GPU, from its forward FLOPs (a fitted roofline):

        t = per_flop * linear_flops + per_core_flop * core_flops + per_call

    ``linear_flops`` scale with tokens (projections, router, MLPs); ``core_flops`` are the attention core
    (s^2). From peak numbers both per-FLOP terms are 1 / (peak x efficiency) (x2 for backward) and per_call is 0;
    a profile fits all three to measurements (``profile_fit.py``)."""

    per_flop: float
    per_core_flop: float
    per_call: float = 0.0

    def seconds(self, linear_flops: float, core_flops: float = 0.0, calls: float = 1.0) -> float:
        return self.per_flop * linear_flops + self.per_core_flop * core_flops + self.per_call * calls


@dataclass(frozen=True)
class Rates:
    """Achievable speeds: per-call time models of the attention part and the expert part (forward and
    backward, both in terms of the part's forward FLOPs), bytes/s per NIC, over NVLink and from HBM, usable
    memory."""

    attention_fwd: PartModel
    attention_bwd: PartModel
    experts_fwd: PartModel
    experts_bwd: PartModel
    nic_bw: float
    nvlink_bw: float
    usable_hbm: float
    hbm_bw: float  # bytes/s one GPU's streaming kernels move to and from its memory (the optimizer step)
    source: str
    pcie_bw: float = PCIE_GEN5_X16 * 0.8  # bytes/s per GPU and direction over its host link
    host_mem_bw: float = DGX_HOST_MEM_BW * 0.5 / 8  # bytes/s of host memory one GPU's offloaded optimizer streams
    message_host_s: float = 0.0  # host seconds per exchange operation (``Cluster.message_host_s``)
    # the busiest rank's expert load over the mean: 1 is forced-balanced routing; real (dropless) routing is
    # above 1, and every MoE layer waits for its busiest rank (``part_times.expert_call_s``, the all-to-all)
    routing_imbalance: float = 1.0
    # a fleet of two GPU types (``fleet.py``): the expert side's own rates; None where both sides share these
    ffn: Rates | None = None
    # (keys a query attends, the attention core's speed relative to ``attention_*``'s core model), ascending: a model
    # with learned sinks run through flex_attention (``gemm_efficiency.FLEX_SINK_CORE``); empty: as the core model says
    sink_core: tuple[tuple[int, float], ...] = ()

    def side(self, name: str) -> Rates:
        """The rates of the ``"attention"`` or ``"ffn"`` side's GPUs."""
        return self.ffn if name == "ffn" and self.ffn is not None else self

    @classmethod
    def from_cluster(cls, cluster: Cluster, eff: Efficiency) -> Rates:
        per = 1.0 / (cluster.peak_flops * eff.compute)
        fwd, bwd = PartModel(per, per), PartModel(2 * per, 2 * per)
        return cls(
            attention_fwd=fwd,
            attention_bwd=bwd,
            experts_fwd=fwd,
            experts_bwd=bwd,
            nic_bw=cluster.nic_bw * eff.network,
            nvlink_bw=cluster.nvlink_bw * eff.nvlink,
            usable_hbm=cluster.hbm_bytes * eff.memory,
            hbm_bw=cluster.memory_bw * eff.hbm,
            pcie_bw=cluster.pcie_bw * eff.pcie,
            host_mem_bw=cluster.host_mem_bw * eff.host / cluster.gpus_per_node,
            message_host_s=cluster.message_host_s,
            source=f"peak x efficiency (compute {eff.compute:g}, network {eff.network:g}, nvlink {eff.nvlink:g})",
        )

    def nic_bw_per_gpu(self, cluster: Cluster) -> float:
        """Achievable NIC bytes/s of one GPU, the node's NICs shared evenly by its GPUs."""
        return cluster.nics_per_node * self.nic_bw / cluster.gpus_per_node
