"""Our own knobs: the ``"disagmoe"`` section of a DeepSpeed config, parsed once and validated at the entry point.

The rest of the ds_config stays DeepSpeed's. Command-line overrides (``--attention-gpus`` ...) replace section
values before validation, so a bad value fails with the same message wherever it came from.

The section is flat JSON (the keys users write), but each key belongs to one typed section below, a small frozen
dataclass with one concept that checks its own keys: ``LayoutCounts``, ``Accumulation``, ``Pipeline``,
``Watchdog``, ``Exchange``, ``Kernels``, ``MemoryLevers``, ``ZeroPerSide``, ``CostModel`` and ``FineTuning``.
``DisagMoEConfig`` is composed of them as bases, so its fields are still exactly the section's keys (what
``from_ds_config``, ``dataclasses.replace`` and ``to_dict`` work on) and ``cfg.micro_batches`` is typed; a function
that needs one concept can be typed by that section alone. The co-located mode's ``ColocatedConfig`` is composed of
the sections both modes read (``Accumulation``, ``Watchdog``, ``Kernels``, ``FineTuning``).

Also here, beside the keys they are about: each side's effective ZeRO stage (``effective_zero_stage``, the one rule
every ZeRO check and build step goes through) and the flag table (``SECTION_FLAGS``) from which run_pretrain.py,
disagmoe-verify, the co-located verify and bench_e2e.py make their flags for section keys (``add_section_flags``).

>>> cfg = DisagMoEConfig.from_ds_config({"disagmoe": {"attention_gpus": 2, "ffn_gpus": 2}}, {"micro_batches": 4})
>>> cfg.attention_gpus, cfg.micro_batches, cfg.world_size
(2, 4, 4)
>>> cfg.zero_stage_of("ffn", {"zero_optimization": {"stage": 1}})  # no per-side stage: the ds_config's
1
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from disagmoe_ds.comm.transport import TRANSPORTS
from disagmoe_ds.errors import ConfigError
from disagmoe_ds.jsonfile import read_json_object
from disagmoe_ds.layout import Layout, RankCounts
from disagmoe_ds.models.lora import LoraSettings
from disagmoe_ds.planner.cluster import PRESETS

SECTION = "disagmoe"
SIDES = ("attention", "ffn")  # the keys of the per-side settings (offload, zero_stage)
# ZeRO-3 (parameters sharded) on the expert side only, and only by its per-side stage: "zero_optimization.stage" is
# every side's default and the stage of one engine over both kinds of parameters (co-located, DeepSpeed-MoE).
ZERO_STAGES = {"attention": (0, 1, 2), "ffn": (0, 1, 2, 3)}
DS_STAGES = (0, 1, 2)


# ----- the typed sections -----
@dataclass(frozen=True, kw_only=True)
class Section:
    """A typed group of a config's keys. ``__post_init__`` runs the ``_check`` of every section a config is composed
    of once, bases first, then the config's own (the rules across sections)."""

    def __post_init__(self) -> None:
        for cls in reversed(type(self).__mro__):
            check = cls.__dict__.get("_check")
            if check is not None:
                check(self)

    def _named(self, key: str) -> str:
        """How a message names ``key`` (the co-located config names its own)."""
        return f'"{SECTION}.{key}"'

    def _positive(self, key: str, kind: type, *, optional: bool = False) -> None:
        value = getattr(self, key)
        if optional and value is None:
            return
        allowed = (int, float) if kind is float else (int,)
        if isinstance(value, bool) or not isinstance(value, allowed) or value <= 0:
            raise ConfigError(f"{self._named(key)} must be a positive {kind.__name__}, got {value!r}")

    def _switches(self, *keys: str) -> None:
        for key in keys:
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"{self._named(key)} must be true or false, got {getattr(self, key)!r}")


@dataclass(frozen=True, kw_only=True)
class LayoutCounts(Section, RankCounts):
    """How many ranks do what (``world_size`` and ``lanes`` as ``layout.RankCounts`` derives them).

    Attributes:
        attention_gpus: M, attention ranks in total.
        ffn_gpus: N, FFN (expert) ranks in total.
        depth: p, A-groups (= F-groups); group g owns layers g, g+p, ...
        expert_data_parallel: replicas of each expert shard inside an F-group.
        sequence_parallel: s, ranks of an A-group that hold one micro-batch's sequence in slices (DeepSpeed-Ulysses
            around the attention core, ``models.sequence_parallel``); s consecutive lanes form one SP group, so an
            A-group's lanes / s groups train distinct micro-batches.
    """

    attention_gpus: int = 1
    ffn_gpus: int = 1
    depth: int = 1
    expert_data_parallel: int = 1
    sequence_parallel: int = 1

    def _check(self) -> None:
        for key in ("attention_gpus", "ffn_gpus", "depth", "expert_data_parallel", "sequence_parallel"):
            self._positive(key, int)

    def layout(self, *, num_layers: int, num_experts: int) -> Layout:
        return Layout(
            attention_gpus=self.attention_gpus,
            ffn_gpus=self.ffn_gpus,
            num_layers=num_layers,
            num_experts=num_experts,
            depth=self.depth,
            expert_data_parallel=self.expert_data_parallel,
            sequence_parallel=self.sequence_parallel,
        )


@dataclass(frozen=True, kw_only=True)
class Accumulation(Section):
    """What one optimizer step consumes (both modes).

    Attributes:
        micro_batches: micro-batches per optimizer step per lane (DeepSpeed's gradient_accumulation_steps).
    """

    micro_batches: int = 1

    def _check(self) -> None:
        self._positive("micro_batches", int)


@dataclass(frozen=True, kw_only=True)
class Pipeline(Section):
    """How the AF-Pipe schedule orders a step's tasks.

    Attributes:
        max_in_flight: cap on micro-batches in flight per worker (memory); None lets the schedule choose.
        split_backward: each backward computes the input gradients its upstream peer waits for, and defers the weight
            gradients to a task of their own that the schedule runs when the worker would idle (the planner's "split
            backward" variant, the zero-bubble idea on the A/F ring).
    """

    max_in_flight: int | None = None
    split_backward: bool = False

    def _check(self) -> None:
        self._positive("max_in_flight", int, optional=True)
        self._switches("split_backward")


@dataclass(frozen=True, kw_only=True)
class Watchdog(Section):
    """When a rank stops waiting (both modes).

    Attributes:
        comm_timeout_s: a rank waiting longer than this for a peer fails the job instead of hanging; a step
            stalled for half of it prints the rank's Python stacks first (``launch.watchdog``).
    """

    comm_timeout_s: float = 300.0

    def _check(self) -> None:
        self._positive("comm_timeout_s", float)


@dataclass(frozen=True, kw_only=True)
class Exchange(Section):
    """How the A/F exchanges move their payloads.

    Attributes:
        comm_stream: on GPUs, allocate and post the exchanges' receives on a side CUDA stream, so that a receive
            posted ahead starts at once instead of after the compute queued before it (``comm.channel.CommStream``).
        transport: ``auto`` is torch.distributed's backend (NCCL on GPUs, gloo on CPUs); ``rendezvous`` is a CPU
            stand-in for NCCL's network transport that tests run under, where a send completes only once its receive
            has started (``comm.transport``).
        capacity_factor: with several ep ranks, every m2n message has a fixed capacity, the rows and routed pairs a
            lane sends one ep rank under balanced routing times this factor (``comm.routing.Capacity``): no header,
            one communicator call per message, and no receive waits for its sizes. Exact, never dropping: a step in
            which some message outgrew the capacity is discarded and run again at a capacity grown to what it needed
            (times the factor), logged. None: exact sizes, sent ahead in a header per message. One ep rank has fixed
            sizes anyway.
    """

    comm_stream: bool = True
    transport: str = "auto"
    capacity_factor: float | None = None

    def _check(self) -> None:
        self._switches("comm_stream")
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"{self._named('transport')} must be one of {sorted(TRANSPORTS)}, got {self.transport!r}")
        self._positive("capacity_factor", float, optional=True)


@dataclass(frozen=True, kw_only=True)
class Kernels(Section):
    """How the parts run on a GPU (both modes; CUDA only).

    Attributes:
        compile: fuse the attention parts and the experts' elementwise work with ``torch.compile``.
        cuda_graphs: replay every attention part, the head and (with one ep rank or, disaggregated, a
            ``capacity_factor``, whose messages have fixed rows) every expert shard as CUDA graphs, one launch per
            forward and per backward, so the host no longer holds the GPU back at small micro-batches
            (``models.graphs``). Costs memory: each part keeps the activations of as many micro-batches as the
            schedule has in flight for it, in pools of its own.
    """

    compile: bool = False
    cuda_graphs: bool = False

    def _check(self) -> None:
        self._switches("compile", "cuda_graphs")


@dataclass(frozen=True, kw_only=True)
class MemoryLevers(Section):
    """What a worker keeps of a micro-batch between its forward and its backward (the planner's memory variants).

    Attributes:
        activation_checkpointing: keep only each chunk's inputs and recompute its activations in backward
            (attention parts and expert shards), trading compute for the memory of micro-batches in flight.
        selective_recompute: drop only the large, cheap-to-rebuild activations (attention blocks, shared/dense
            SwiGLUs, the routed experts' gate/up outputs) and rebuild them in backward (``models.recompute``; the
            planner's "recompute selective"). Exclusive with ``activation_checkpointing``, which drops more.
        resend: the expert side keeps nothing between a micro-batch's forward and backward: the attention side
            sends the routed tokens again with the backward's gradients, and the expert side recomputes its
            forward from them (the planner's "resend" variant: F memory for A->F bytes). With p > 1 the rank that
            sends those gradients (A_next) gets the tokens with the residual hand-off and keeps them until then.
        offload: per side (``attention``, ``ffn``), the share in [0, 1] of each micro-batch's layers whose saved
            activations wait for their backward in host memory (the planner's "offload" variant; ``afpipe.offload``).
    """

    activation_checkpointing: bool = False
    selective_recompute: bool = False
    resend: bool = False
    offload: dict[str, float] = field(default_factory=dict)

    def _check(self) -> None:
        self._switches("activation_checkpointing", "selective_recompute", "resend")
        if self.selective_recompute and self.activation_checkpointing:
            raise ConfigError(
                f'"{SECTION}.selective_recompute" and "{SECTION}.activation_checkpointing" are exclusive: the latter '
                "already recomputes every activation of a chunk; set one of them"
            )
        _check_per_side("offload", self.offload, '{"attention": 0.5, "ffn": 0.0}', _offload_problem)

    def offload_share(self, side: str) -> float:
        """The offload share of the ``attention`` or ``ffn`` side (0.0 where the section leaves it out)."""
        return float(self.offload.get(side, 0.0))


@dataclass(frozen=True, kw_only=True)
class ZeroPerSide(Section):
    """Each side's ZeRO stage (the planner's "ZeRO a/f").

    Attributes:
        zero_stage: per side (``attention``, ``ffn``), the ZeRO stage of that side's engines, replacing
            ``zero_optimization.stage`` there; the expert side also takes stage 3 (its parameters sharded over the
            expert replicas).
    """

    zero_stage: dict[str, int] = field(default_factory=dict)

    def _check(self) -> None:
        _check_per_side("zero_stage", self.zero_stage, '{"attention": 1, "ffn": 2}', _zero_stage_problem)

    def zero_stage_of(self, side: str, ds_config: dict[str, Any]) -> int:
        """The ZeRO stage of the ``attention`` or ``ffn`` side's engines under ``ds_config``: its per-side stage,
        else ``zero_optimization.stage``; refused with the fix where those engines cannot run it."""
        return effective_zero_stage(ds_config, side, self.zero_stage.get(side))

    def zero_stages(self, ds_config: dict[str, Any]) -> dict[str, int]:
        """``zero_stage_of`` both sides."""
        return {side: self.zero_stage_of(side, ds_config) for side in SIDES}

    @property
    def experts_sharded(self) -> bool:
        """ZeRO-3 on the expert side, which only its per-side stage sets (``effective_zero_stage`` refuses 3 as the
        ds_config's stage): known without the ds_config, as the schedule's costs need it."""
        return self.zero_stage.get("ffn") == 3


@dataclass(frozen=True, kw_only=True)
class CostModel(Section):
    """What the schedule generator's task costs assume.

    Attributes:
        cluster: a planner preset (``h800``, ``h100``, ``h200``) or a cluster JSON (``docs/planner.md``), so the
            order it emits is the one the planner simulated.
        profile: a ``disagmoe-plan profile`` JSON whose measured part times replace peak x efficiency there.
    """

    cluster: str = "h200"
    profile: str | None = None

    def _check(self) -> None:
        if self.cluster not in PRESETS and not Path(self.cluster).is_file():
            raise ConfigError(
                f"{self._named('cluster')} must be one of the presets {sorted(PRESETS)} or a cluster JSON file; "
                f"{self.cluster!r} is neither"
            )
        if self.profile is not None and not Path(self.profile).is_file():
            raise ConfigError(
                f"{self._named('profile')} {self.profile!r} is not a file; write one with disagmoe-plan profile"
            )


@dataclass(frozen=True, kw_only=True)
class FineTuning(Section):
    """What trains (both modes).

    Attributes:
        lora: LoRA fine-tuning (``models.lora.LoraSettings``: rank, alpha, dropout, targets, train_router): adapters
            on both sides, every base weight frozen; None: every parameter trains.
    """

    lora: LoraSettings | None = None

    def _check(self) -> None:
        if self.lora is not None:  # the JSON object, parsed (and checked) into its settings
            object.__setattr__(self, "lora", LoraSettings.from_dict(self.lora))


# Bases in reverse of the order their keys are listed in (dataclasses collect fields from the last base first).
@dataclass(frozen=True, kw_only=True)
class DisagMoEConfig(
    FineTuning, CostModel, ZeroPerSide, MemoryLevers, Kernels, Exchange, Watchdog, Pipeline, Accumulation, LayoutCounts
):
    """The disaggregated layout and pipeline settings: the ``"disagmoe"`` section, its keys grouped by the typed
    sections it is composed of (their docstrings describe the keys)."""

    def _check(self) -> None:
        if self.cuda_graphs:
            _check_graphable(self)

    @classmethod
    def from_ds_config(cls, ds_config: dict[str, Any], overrides: dict[str, Any] | None = None) -> DisagMoEConfig:
        section = dict(ds_config.get(SECTION, {}))
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(section) - known)
        if unknown:
            raise ConfigError(f'unknown key(s) in "{SECTION}": {", ".join(unknown)}; known: {", ".join(sorted(known))}')
        section.update({k: v for k, v in (overrides or {}).items() if v is not None})
        return cls(**section)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _check_graphable(cfg: DisagMoEConfig) -> None:
    """Refuse what cannot run inside a captured graph: recomputation and offload move or rebuild a part's saved
    tensors, and the split backward runs a part's backward in two halves, where a graph replays it whole."""
    refused = {
        "activation_checkpointing": cfg.activation_checkpointing,
        "selective_recompute": cfg.selective_recompute,
        "offload": any(cfg.offload_share(side) > 0 for side in SIDES),
        "split_backward": cfg.split_backward,
        "sequence_parallel": cfg.sequence_parallel > 1,  # the head takes the slice's shifted labels
    }
    chosen = [f'"{SECTION}.{name}"' for name, on in refused.items() if on]
    if chosen:
        raise ConfigError(
            f'"{SECTION}.cuda_graphs" does not work with {", ".join(chosen)}: a graph replays a part\'s forward and '
            "backward whole, with its activations in a pool of its own; turn one of them off"
        )


def _check_per_side(key: str, value: Any, example: str, problem: Callable[[str, Any], str | None]) -> None:
    """A per-side object (``{"attention": ..., "ffn": ...}``): its type, its keys and each side's value (``problem``
    says what is wrong with one, or None)."""
    if not isinstance(value, dict):
        raise ConfigError(f'"{SECTION}.{key}" must be an object like {example}, got {value!r}')
    unknown = sorted(map(str, set(value) - set(SIDES)))
    if unknown:
        raise ConfigError(f'unknown key(s) in "{SECTION}.{key}": {", ".join(unknown)}; known: attention, ffn')
    for side, item in value.items():
        wrong = problem(side, item)
        if wrong:
            raise ConfigError(f'"{SECTION}.{key}.{side}" {wrong}')


def _offload_problem(side: str, share: Any) -> str | None:
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
        return f"is the share of layers offloaded to host memory, in [0, 1]; got {share!r}"
    return None


def _zero_stage_problem(side: str, stage: Any) -> str | None:
    if isinstance(stage, bool) or stage not in ZERO_STAGES[side]:
        hint = " (ZeRO-3 shards parameters on the expert side only)" if side == "attention" and stage == 3 else ""
        return f"must be one of {list(ZERO_STAGES[side])}, got {stage!r}{hint}"
    return None


# ----- the effective ZeRO stage -----
def ds_stage(ds_config: dict[str, Any]) -> int:
    """The ds_config's own ``zero_optimization.stage`` (each side's default)."""
    return int(ds_config.get("zero_optimization", {}).get("stage", 0))


def effective_zero_stage(ds_config: dict[str, Any], side: str | None = None, side_stage: int | None = None) -> int:
    """The ZeRO stage an engine runs at, refused with the fix where it cannot: ``side_stage`` (the section's stage
    for ``side``, checked with the section), else ``zero_optimization.stage``, which is 0-2 (``side`` None: one
    engine over both kinds of parameters). bf16 needs stage >= 1 (DeepSpeed's BF16 optimizer or ZeRO's)."""
    bf16 = bool(ds_config.get("bf16", {}).get("enabled"))
    on_side = "" if side is None else f" on the {'expert' if side == 'ffn' else 'attention'} side"
    if side_stage is not None:
        if bf16 and side_stage == 0:
            raise ConfigError(
                f'bf16 needs ZeRO stage >= 1{on_side} in DisagMoE-DS ("{SECTION}.zero_stage.{side}" is 0: set it to '
                "1 or more, or use fp32)"
            )
        return side_stage
    stage = ds_stage(ds_config)
    if stage not in DS_STAGES:
        if side is None:
            hint = "ZeRO-3 shards a disaggregated job's expert side only, and one engine holds both kinds here"
        else:
            hint = f'ZeRO-3 shards the expert side only: "{SECTION}": {{"zero_stage": {{"attention": 2, "ffn": 3}}}}'
        raise ConfigError(f'"zero_optimization.stage" {stage} is not supported; use 0, 1 or 2 (--zero 1); {hint}')
    if bf16 and stage == 0:
        raise ConfigError(
            f'bf16 needs "zero_optimization.stage" 1 or 2{on_side} in DisagMoE-DS (--zero 1, or --dtype fp32)'
        )
    return stage


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


# The CLIs that make flags from this table; "run_pretrain" overrides a ds_config, so its flags default to None (the
# ds_config's value), the others build a config from the flags alone and default to the section's default.
CLIS = ("run_pretrain", "verify", "colocated_verify", "bench")
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
    "sequence_parallel": Flag(
        "attention ranks that hold one micro-batch's sequence in slices (DeepSpeed-Ulysses around the attention "
        "core); divides the lanes of an attention group, the attention heads and --seq-len"
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
        choices=tuple(sorted(TRANSPORTS)),
    ),
    "comm_timeout_s": Flag(
        "seconds a rank may wait for a peer; stacks at half of it", type=float, name="--comm-timeout"
    ),
    "compile": Flag("torch.compile the parts", type=None),
    # AF-Pipe's memory levers (LEVER_KEYS)
    "resend": Flag("experts keep nothing between forward and backward", type=None),
    "cuda_graphs": Flag("replay the parts as CUDA graphs (GPU ranks)", type=None),
    "capacity_factor": Flag(
        "several ep ranks: m2n messages at a fixed capacity (balanced routing times this), no headers; a step that "
        "outgrows it runs again at a larger one",
        type=float,
    ),
    "selective_recompute": Flag("recompute attention blocks, SwiGLUs, experts' gate/up", type=None),
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
}
LAYOUT_KEYS = ("attention_gpus", "ffn_gpus", "depth", "expert_data_parallel", "sequence_parallel")
LEVER_KEYS = (
    "resend",
    "cuda_graphs",
    "capacity_factor",
    "selective_recompute",
    "split_backward",
    "offload",
    "zero_stage",
)
_SECTION_DEFAULTS = {f.name: f.default for f in fields(DisagMoEConfig)}


def flag_of(name: str) -> str:
    """The flag of an ``argparse`` destination: ``ep_size`` -> ``--ep-size``."""
    return "--" + name.replace("_", "-")


def add_section_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, keys: tuple[str, ...], *, cli: str
) -> None:
    """``keys``' flags from ``SECTION_FLAGS`` as ``cli`` (one of ``CLIS``) has them; each action's destination is
    its key and its ``section_key`` attribute names it (tests check every CLI's against the table)."""
    if cli not in CLIS:
        raise ValueError(f"unknown CLI {cli!r}; one of {CLIS}")
    for key in keys:
        spec = SECTION_FLAGS[key]
        kwargs: dict[str, Any] = {"dest": key, "help": spec.help}
        if cli in spec.notes:
            kwargs["help"] += f" (default: {spec.notes[cli]})"
        if spec.type is None:  # a switch turns a key on; left out, run_pretrain.py keeps the ds_config's value
            kwargs |= {"action": "store_true", "default": None if cli == "run_pretrain" else False}
        else:
            kwargs |= {"type": spec.type, "choices": spec.choices, "default": _default(key, spec, cli)}
            if spec.per_side:
                kwargs |= {"nargs": 2, "metavar": ("A", "F")}
            elif spec.name is not None:  # named after the flag, not the key it sets
                kwargs["metavar"] = spec.name.removeprefix("--").replace("-", "_").upper()
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


def load_ds_config(path_or_dict: str | Path | dict[str, Any]) -> dict[str, Any]:
    """A DeepSpeed config as a dict, from a JSON file or an in-memory dict (copied)."""
    if isinstance(path_or_dict, dict):
        return json.loads(json.dumps(path_or_dict))
    return read_json_object(path_or_dict, what="DeepSpeed config", fix="see ds_configs/ for examples")
