"""The flag table: one entry per section key that a command line sets (``SECTION_FLAGS``), from which
run_pretrain.py, disagmoe-verify, the co-located verify, disagmoe-convert and bench_e2e.py make their flags
(``add_section_flags``)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from disagmoe_ds.config.disagmoe import DisagMoEConfig
from disagmoe_ds.config.sections import RECOMPUTE, SIDES, TRANSPORT_NAMES
from disagmoe_ds.models.attention_kernel import ATTENTION_KERNELS


# ----- the flag table -----
@dataclass(frozen=True)
class Flag:
    """How one section key is given on a command line, whichever CLI declares it (``add_section_flags``).

    Attributes:
        help: what the key does, in every CLI's ``--help``.
        type: argparse's ``type``; None for a switch (``store_true``).
        name: the flag where it is not the key's (``flag_of``).
        per_side: two values, the attention side's then the FFN side's, for a ``{"attention": a, "ffn": f}`` key.
        choices: the values argparse accepts.
        defaults: the default of a CLI that deliberately differs from the section's (``cli -> value``).
        notes: what such a default means where the value does not say it (``cli -> text``, shown in ``--help``).
    """

    help: str
    type: Callable[[str], Any] | None = int
    name: str | None = None
    per_side: bool = False
    choices: tuple[Any, ...] | None = None
    defaults: Mapping[str, Any] = field(default_factory=dict)
    notes: Mapping[str, str] = field(default_factory=dict)

    def flag(self, key: str) -> str:
        return self.name or flag_of(key)


def switch(text: str) -> bool:
    """A true/false command-line value (true, false, 1, 0, on, off)."""
    value = {"true": True, "1": True, "on": True, "false": False, "0": False, "off": False}.get(text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return value


# The CLIs that make flags from this table; "run_pretrain" overrides a ds_config, so its flags default to None (the
# ds_config's value), the others build a config from the flags alone and default to the section's default.
CLIS = ("run_pretrain", "verify", "colocated_verify", "convert", "bench")


SECTION_FLAGS: dict[str, Flag] = {
    "attention_gpus": Flag(
        "ranks that run the attention side (M), in total", notes={"bench": "half the ranks"}, defaults={"bench": None}
    ),
    "ffn_gpus": Flag(
        "ranks that run the experts (N), in total", notes={"bench": "the other ranks"}, defaults={"bench": None}
    ),
    "depth": Flag(
        "pipeline depth (p): the layers are split over this many attention groups and as many expert groups; "
        "divides the layer count"
    ),
    "expert_data_parallel": Flag("copies of each expert shard within an expert group"),
    "node_dedup": Flag(
        "expert ranks of one node that share one message of an attention rank: a token bound for several of them "
        "crosses the network once and fans out inside the node (the GPUs per node an expert group spans; 1: off)"
    ),
    "sequence_parallel": Flag(
        "attention ranks that hold one micro-batch's sequence in slices (DeepSpeed-Ulysses around the attention "
        "core); divides the lanes of an attention group (--mode colocated: the ranks of a pipeline stage), the "
        "attention heads and --seq-len"
    ),
    "tensor_parallel": Flag(
        "attention ranks that hold one micro-batch's sequence in slices and each attention module's heads in shards "
        "(tensor parallel with sequence parallel); divides the lanes of an attention group (--mode colocated: the "
        "ranks of a pipeline stage, and --ep-size), the query and KV heads and --seq-len; with --sequence-parallel s, "
        "s x t ranks hold a micro-batch (Ulysses over a TP rank's heads)"
    ),
    "micro_batches": Flag(
        "micro-batches per optimizer step on each data-parallel lane (DeepSpeed's gradient accumulation steps)",
        defaults={"verify": 2, "colocated_verify": 2},  # one micro-batch would not test accumulation
    ),
    "activation_checkpointing": Flag("recompute chunk activations in backward", type=None),
    "transport": Flag(
        "exchange transport: auto (NCCL on GPUs, gloo on CPUs) or rendezvous (CPU ranks; a send completes only once "
        "its receive has started, as on NCCL's network transport: shows deadlocks gloo hides)",
        type=str,
        choices=TRANSPORT_NAMES,
    ),
    "comm_timeout_s": Flag(
        "seconds a rank may wait for a peer; stacks at half of it", type=float, name="--comm-timeout"
    ),
    "compile": Flag("torch.compile the parts", type=None),
    "attention": Flag(
        "HF's attention function for the attention parts: auto is HF's choice (SDPA where the model has it), but "
        "flex_attention on CUDA where HF would run eager (GPT-OSS's sinks)",
        type=str,
        choices=ATTENTION_KERNELS,
    ),
    "fp8": Flag(
        "FP8 GEMMs (rowwise scales) for the routed experts and the attention side's projections, forward and backward",
        type=None,
    ),
    "fp8_cast_per_call": Flag(
        "with --fp8, cast the routed experts' weights to FP8 in every call, not once per optimizer step: no FP8 copies "
        "kept (2 bytes an expert parameter), one more HBM pass over those weights per micro-batch",
        type=None,
    ),
    # AF-Pipe's memory levers (LEVER_KEYS)
    "resend": Flag("experts keep nothing between forward and backward", type=None),
    "cuda_graphs": Flag("replay the parts as CUDA graphs (GPU ranks)", type=None),
    "capacity_factor": Flag(
        "several ep ranks: m2n messages at a fixed capacity (balanced routing times this), no headers; a step that "
        "outgrows it runs again at a larger one",
        type=float,
    ),
    "selective_recompute": Flag("recompute attention blocks, SwiGLUs, experts' gate/up", type=None),
    "recompute": Flag(
        "what the attention and the FFN side rebuild in backward (none, selective or full), each side on its own; "
        "replaces --activation-checkpointing and --selective-recompute",
        type=str,
        per_side=True,
        choices=RECOMPUTE,
    ),
    "split_backward": Flag(
        "each backward sends its input gradients first and runs its weight gradients when the rank would idle",
        type=None,
    ),
    "offload": Flag(
        "share of each micro-batch's layers whose saved activations go to host memory, attention and FFN side",
        type=float,
        per_side=True,
    ),
    "zero_stage": Flag(
        "ZeRO stage of the attention and the FFN side (F may be 3: expert parameters sharded), replacing --zero",
        per_side=True,
    ),
    "offload_optimizer": Flag(
        "whether the attention and the FFN side keep their optimizer state and step in host memory (DeepSpeed's "
        "ZeRO-Offload on that side's engines; true or false each, e.g. false true)",
        type=switch,
        per_side=True,
    ),
}


LAYOUT_KEYS = (
    "attention_gpus",
    "ffn_gpus",
    "depth",
    "expert_data_parallel",
    "node_dedup",
    "sequence_parallel",
    "tensor_parallel",
)


LEVER_KEYS = (
    "fp8",
    "fp8_cast_per_call",
    "resend",
    "cuda_graphs",
    "capacity_factor",
    "selective_recompute",
    "recompute",
    "split_backward",
    "offload",
    "zero_stage",
    "offload_optimizer",
)


_SECTION_DEFAULTS = {f.name: f.default for f in fields(DisagMoEConfig)}


def flag_of(name: str) -> str:
    """The flag of an ``argparse`` destination: ``ep_size`` -> ``--ep-size``."""
    return "--" + name.replace("_", "-")


def add_section_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    keys: tuple[str, ...],
    *,
    cli: str,
    required: tuple[str, ...] = (),
    without_default: tuple[str, ...] = (),
    notes: Mapping[str, str] | None = None,
) -> None:
    """``keys``' flags from ``SECTION_FLAGS`` as ``cli`` (one of ``CLIS``) has them, those of ``required`` without a
    default, those of ``without_default`` too but optional (the caller asks for them where it needs them); each
    action's destination is its key and its ``section_key`` attribute names it (tests check every CLI's against the
    table). ``notes``: what a key's default means in this parser, where it differs from the table's note for
    ``cli`` (a subcommand's own)."""
    if cli not in CLIS:
        raise ValueError(f"unknown CLI {cli!r}; one of {CLIS}")
    for key in keys:
        spec = SECTION_FLAGS[key]
        kwargs: dict[str, Any] = {"dest": key, "help": spec.help}
        note = (notes or {}).get(key, spec.notes.get(cli))
        if note is not None:
            kwargs["help"] += f" (default: {note})"
        if spec.type is None:  # a switch turns a key on; left out, run_pretrain.py keeps the ds_config's value
            kwargs |= {"action": "store_true", "default": None if cli == "run_pretrain" else False}
        else:
            kwargs |= {"type": spec.type, "choices": spec.choices, "default": _default(key, spec, cli)}
            if spec.per_side:
                kwargs |= {"nargs": 2, "metavar": ("A", "F")}
            elif spec.name is not None:  # named after the flag, not the key it sets
                kwargs["metavar"] = spec.name.removeprefix("--").replace("-", "_").upper()
        if key in required or key in without_default:
            kwargs |= {"required": key in required, "default": None}
        action = parser.add_argument(spec.flag(key), **kwargs)
        action.section_key = key  # type: ignore[attr-defined]


def _default(key: str, spec: Flag, cli: str) -> Any:
    if cli in spec.defaults:
        return spec.defaults[cli]
    if cli == "run_pretrain":
        return None
    default = _SECTION_DEFAULTS[key]
    return None if spec.per_side else default  # a per-side key left out: the section's empty object


def section_values(ns: argparse.Namespace, keys: tuple[str, ...]) -> dict[str, Any]:
    """The section keys ``add_section_flags`` parsed into ``ns``, as the section holds them (a pair of per-side values
    becomes ``{"attention": a, "ffn": f}``); a flag not given and without a default is left out."""
    values = {}
    for key in keys:
        value = getattr(ns, key)
        if value is None:
            continue
        values[key] = dict(zip(SIDES, value, strict=True)) if SECTION_FLAGS[key].per_side else value
    return values
