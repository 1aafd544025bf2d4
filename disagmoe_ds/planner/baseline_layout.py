"""``--baseline-layout tp=T,pp=P,vpp=V,ep=E,cp=C``: a published co-located layout, parsed and checked against the
cluster, the model and the sequence, so the baseline is priced there instead of searched (pure Python).

Optional keys: ``overlap=paired|partial`` (Megatron's combined 1F1B all-to-all overlap, or not; default partial,
Megatron's default), ``dispatcher=deepep|alltoall`` (default deepep, the one Megatron's MoE recipes use) and
``grads=fp32|bf16`` (Megatron's fp32 main grads, 2 + 4 + 12/d B per parameter; bf16: 16 B in all, which is also
what FSDP2 with fp32 sharded parameters keeps, e.g. NeMo AutoModel).

>>> parse_layout("tp=2,pp=8,vpp=4,ep=32")
Shape(pp=8, vpp=4, tp=2, cp=1, ep=32, overlap='partial', dispatcher='deepep', fp32_grads=True, ulysses=False)
"""

from __future__ import annotations

from disagmoe_ds.errors import ConfigError
from disagmoe_ds.planner.cluster import Cluster
from disagmoe_ds.planner.colocated_costs import DISPATCHERS, Shape, tp_options
from disagmoe_ds.planner.model import ModelSpec
from disagmoe_ds.planner.pipeline_split import chunk_sizes

_SIZES = ("tp", "pp", "vpp", "ep", "cp")
_CHOICES = {"overlap": ("partial", "paired"), "dispatcher": DISPATCHERS, "grads": ("fp32", "bf16")}
_DEFAULTS = {"overlap": "partial", "dispatcher": "deepep", "grads": "fp32"}


def parse_layout(text: str) -> Shape:
    """The layout string as a ``Shape``; a malformed one raises ``ConfigError`` naming the flag."""
    flag = f"--baseline-layout {text!r}"
    values: dict[str, str] = {}
    for item in text.split(","):
        key, sep, value = item.strip().partition("=")
        if not sep or not value or key not in (*_SIZES, *_CHOICES):
            raise ConfigError(
                f"{flag}: expected comma-separated key=value with keys {', '.join((*_SIZES, *_CHOICES))}, "
                f"e.g. tp=2,pp=8,vpp=4,ep=32,cp=1"
            )
        if key in values:
            raise ConfigError(f"{flag}: {key} given twice")
        values[key] = value
    sizes = {}
    for key in _SIZES:
        raw = values.get(key, "1")
        if not raw.isdigit() or int(raw) < 1:
            raise ConfigError(f"{flag}: {key} must be a positive integer, got {raw!r}")
        sizes[key] = int(raw)
    for key, allowed in _CHOICES.items():
        values.setdefault(key, _DEFAULTS[key])
        if values[key] not in allowed:
            raise ConfigError(f"{flag}: {key} must be one of {', '.join(allowed)}, got {values[key]!r}")
    return Shape(
        pp=sizes["pp"],
        vpp=sizes["vpp"],
        tp=sizes["tp"],
        cp=sizes["cp"],
        ep=sizes["ep"],
        overlap=values["overlap"],
        dispatcher=values["dispatcher"],
        fp32_grads=values["grads"] == "fp32",
    )


def check_layout(shape: Shape, spec: ModelSpec, cluster: Cluster, seq_len: int) -> None:
    """Raise ``ConfigError`` (one line) where the layout does not fit the GPUs, the model or the sequence."""
    world, flag = cluster.world_size, "--baseline-layout"
    if world % (shape.pp * shape.tp * shape.cp):
        raise ConfigError(
            f"{flag}: TP {shape.tp} x PP {shape.pp} x CP {shape.cp} = {shape.tp * shape.pp * shape.cp} does not "
            f"divide the {world} GPUs"
        )
    if (world // shape.pp) % shape.ep:
        raise ConfigError(f"{flag}: EP {shape.ep} does not divide the {world // shape.pp} GPUs of a pipeline stage")
    if spec.num_experts % shape.ep:
        raise ConfigError(f"{flag}: EP {shape.ep} does not divide the {spec.num_experts} experts")
    if shape.tp not in tp_options(spec, cluster.gpus_per_node):
        raise ConfigError(f"{flag}: TP {shape.tp} must divide the attention heads and fit a node")
    if shape.vpp > 1 and shape.pp == 1:
        raise ConfigError(f"{flag}: VPP {shape.vpp} needs PP > 1")
    if chunk_sizes(spec.num_layers, shape.pp, shape.vpp) is None:
        raise ConfigError(f"{flag}: {spec.num_layers} layers do not split over PP {shape.pp} x VPP {shape.vpp}")
    if seq_len % (2 * shape.cp):
        raise ConfigError(f"{flag}: CP {shape.cp} needs the sequence length to be a multiple of {2 * shape.cp}")
