"""Our own knobs: the ``"disagmoe"`` section of a DeepSpeed config, parsed once and validated at the entry point.

The rest of the ds_config stays DeepSpeed's. Command-line overrides (``--attention-gpus`` ...) replace section
values before validation, so a bad value fails with the same message wherever it came from.

>>> cfg = DisagMoEConfig.from_ds_config({"disagmoe": {"attention_gpus": 2, "ffn_gpus": 2}}, {"micro_batches": 4})
>>> cfg.attention_gpus, cfg.micro_batches, cfg.world_size
(2, 4, 4)
"""

from __future__ import annotations

import json
from collections.abc import Callable
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
_FLAGS = (
    "compile",
    "cuda_graphs",
    "activation_checkpointing",
    "selective_recompute",
    "comm_stream",
    "resend",
    "split_backward",
)
SIDES = ("attention", "ffn")  # the keys of the per-side settings (offload, zero_stage)
_NOT_NUMBERS = (*_FLAGS, "transport", "offload", "zero_stage", "cluster", "profile", "lora")
ZERO_STAGES = {"attention": (0, 1, 2), "ffn": (0, 1, 2, 3)}  # ZeRO-3 (parameters sharded) on the expert side only


@dataclass(frozen=True)
class DisagMoEConfig(RankCounts):
    """The disaggregated layout and pipeline settings (``world_size`` and ``lanes`` as the layout derives them).

    Attributes:
        attention_gpus: M, attention ranks in total.
        ffn_gpus: N, FFN (expert) ranks in total.
        depth: p, A-groups (= F-groups); group g owns layers g, g+p, ...
        micro_batches: micro-batches per optimizer step per lane (DeepSpeed's gradient_accumulation_steps).
        expert_data_parallel: replicas of each expert shard inside an F-group.
        sequence_parallel: s, ranks of an A-group that hold one micro-batch's sequence in slices (DeepSpeed-Ulysses
            around the attention core, ``models.sequence_parallel``); s consecutive lanes form one SP group, so an
            A-group's lanes / s groups train distinct micro-batches.
        max_in_flight: cap on micro-batches in flight per worker (memory); None lets the schedule choose.
        comm_timeout_s: a rank waiting longer than this for a peer fails the job instead of hanging; a step
            stalled for half of it prints the rank's Python stacks first (``launch.watchdog``).
        compile: fuse the attention parts and the experts' elementwise work with ``torch.compile`` (GPU runs).
        cuda_graphs: replay every attention part, the head and (with one ep rank or a ``capacity_factor``, whose
            messages have fixed rows) every expert shard as CUDA graphs, one launch per forward and per backward,
            so the host no longer holds the GPU back at small micro-batches (``models.graphs``; CUDA only). Costs
            memory: each part keeps the activations of as many micro-batches as the schedule has in flight for it,
            in pools of its own.
        activation_checkpointing: keep only each chunk's inputs and recompute its activations in backward
            (attention parts and expert shards), trading compute for the memory of micro-batches in flight.
        selective_recompute: drop only the large, cheap-to-rebuild activations (attention blocks, shared/dense
            SwiGLUs, the routed experts' gate/up outputs) and rebuild them in backward (``models.recompute``; the
            planner's "recompute selective"). Exclusive with ``activation_checkpointing``, which drops more.
        comm_stream: on GPUs, allocate and post the exchanges' receives on a side CUDA stream, so that a receive
            posted ahead starts at once instead of after the compute queued before it (``comm.channel.CommStream``).
        transport: how exchange payloads move: ``auto`` is torch.distributed's backend (NCCL on GPUs, gloo on
            CPUs); ``rendezvous`` is a CPU stand-in for NCCL's network transport that tests run under, where a send
            completes only once its receive has started (``comm.transport``).
        capacity_factor: with several ep ranks, every m2n message has a fixed capacity, the rows and routed pairs a
            lane sends one ep rank under balanced routing times this factor (``comm.routing.Capacity``): no header,
            one communicator call per message, and no receive waits for its sizes. Exact, never dropping: a step in
            which some message outgrew the capacity is discarded and run again at a capacity grown to what it needed
            (times the factor), logged. None: exact sizes, sent ahead in a header per message. One ep rank has fixed
            sizes anyway.
        resend: the expert side keeps nothing between a micro-batch's forward and backward: the attention side
            sends the routed tokens again with the backward's gradients, and the expert side recomputes its
            forward from them (the planner's "resend" variant: F memory for A->F bytes). With p > 1 the rank that
            sends those gradients (A_next) gets the tokens with the residual hand-off and keeps them until then.
        offload: per side (``attention``, ``ffn``), the share in [0, 1] of each micro-batch's layers whose saved
            activations wait for their backward in host memory (the planner's "offload" variant; ``afpipe.offload``).
        split_backward: each backward computes the input gradients its upstream peer waits for, and defers the weight
            gradients to a task of their own that the schedule runs when the worker would idle (the planner's "split
            backward" variant, the zero-bubble idea on the A/F ring).
        zero_stage: per side (``attention``, ``ffn``), the ZeRO stage of that side's engines, replacing
            ``zero_optimization.stage`` there (the planner's "ZeRO a/f"); the expert side also takes stage 3 (its
            parameters sharded over the expert replicas).
        cluster: what the schedule generator's task costs assume: a planner preset (``h800``, ``h100``, ``h200``)
            or a cluster JSON (``docs/planner.md``), so the order it emits is the one the planner simulated.
        profile: a ``disagmoe-plan profile`` JSON whose measured part times replace peak x efficiency there.
        lora: LoRA fine-tuning (``models.lora.LoraSettings``: rank, alpha, dropout, targets, train_router): adapters
            on both sides, every base weight frozen; None: every parameter trains.
    """

    attention_gpus: int = 1
    ffn_gpus: int = 1
    depth: int = 1
    micro_batches: int = 1
    expert_data_parallel: int = 1
    sequence_parallel: int = 1
    max_in_flight: int | None = None
    comm_timeout_s: float = 300.0
    compile: bool = False
    cuda_graphs: bool = False
    activation_checkpointing: bool = False
    selective_recompute: bool = False
    comm_stream: bool = True
    transport: str = "auto"
    capacity_factor: float | None = None
    resend: bool = False
    offload: dict[str, float] = field(default_factory=dict)
    split_backward: bool = False
    zero_stage: dict[str, int] = field(default_factory=dict)
    cluster: str = "h200"
    profile: str | None = None
    lora: LoraSettings | None = None

    def __post_init__(self) -> None:
        if self.lora is not None:
            object.__setattr__(self, "lora", LoraSettings.from_dict(self.lora))
        for flag in _FLAGS:
            if not isinstance(getattr(self, flag), bool):
                raise ConfigError(f'"{SECTION}.{flag}" must be true or false, got {getattr(self, flag)!r}')
        if self.selective_recompute and self.activation_checkpointing:
            raise ConfigError(
                f'"{SECTION}.selective_recompute" and "{SECTION}.activation_checkpointing" are exclusive: the latter '
                "already recomputes every activation of a chunk; set one of them"
            )
        if self.cuda_graphs:
            _check_graphable(self)
        _check_per_side("offload", self.offload, '{"attention": 0.5, "ffn": 0.0}', _offload_problem)
        _check_per_side("zero_stage", self.zero_stage, '{"attention": 1, "ffn": 2}', _zero_stage_problem)
        if self.transport not in TRANSPORTS:
            raise ConfigError(f'"{SECTION}.transport" must be one of {sorted(TRANSPORTS)}, got {self.transport!r}')
        if self.cluster not in PRESETS and not Path(self.cluster).is_file():
            raise ConfigError(
                f'"{SECTION}.cluster" must be one of the presets {sorted(PRESETS)} or a cluster JSON file; '
                f"{self.cluster!r} is neither"
            )
        if self.profile is not None and not Path(self.profile).is_file():
            raise ConfigError(
                f'"{SECTION}.profile" {self.profile!r} is not a file; write one with disagmoe-plan profile'
            )
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in _NOT_NUMBERS or (f.name in ("max_in_flight", "capacity_factor") and value is None):
                continue
            kind = float if f.name in ("comm_timeout_s", "capacity_factor") else int
            allowed = (int, float) if kind is float else (int,)
            if isinstance(value, bool) or not isinstance(value, allowed) or value <= 0:
                raise ConfigError(f'"{SECTION}.{f.name}" must be a positive {kind.__name__}, got {value!r}')

    @classmethod
    def from_ds_config(cls, ds_config: dict[str, Any], overrides: dict[str, Any] | None = None) -> DisagMoEConfig:
        section = dict(ds_config.get(SECTION, {}))
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(section) - known)
        if unknown:
            raise ConfigError(f'unknown key(s) in "{SECTION}": {", ".join(unknown)}; known: {", ".join(sorted(known))}')
        section.update({k: v for k, v in (overrides or {}).items() if v is not None})
        return cls(**section)

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

    def offload_share(self, side: str) -> float:
        """The offload share of the ``attention`` or ``ffn`` side (0.0 where the section leaves it out)."""
        return float(self.offload.get(side, 0.0))

    def zero_stage_of(self, side: str, default: int) -> int:
        """The ZeRO stage of the ``attention`` or ``ffn`` side (``default``, the ds_config's, where not set)."""
        return int(self.zero_stage.get(side, default))

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


def load_ds_config(path_or_dict: str | Path | dict[str, Any]) -> dict[str, Any]:
    """A DeepSpeed config as a dict, from a JSON file or an in-memory dict (copied)."""
    if isinstance(path_or_dict, dict):
        return json.loads(json.dumps(path_or_dict))
    return read_json_object(path_or_dict, what="DeepSpeed config", fix="see ds_configs/ for examples")
